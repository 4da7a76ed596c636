"""Learning-rate schedule as a pure function: shared by distillation and the calibration stages."""
from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up to ``peak``, then constant or cosine."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    span = max(1, total_steps - warmup)
    p = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))
