"""Learning-rate schedule and the token counts at which a run evaluates or checkpoints."""
from __future__ import annotations

import math


def warmup_steps(cfg, total_steps: int, tokens_per_step: int) -> int:
    w = cfg.warmup * total_steps if cfg.warmup < 1 else cfg.warmup / tokens_per_step
    return min(total_steps, int(math.ceil(w)))


def lr_at(step: int, *, peak: float, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up to ``peak``, then constant or cosine."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    span = max(1, total_steps - warmup)
    p = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


def crossed(before: int, after: int, every: int) -> bool:
    return after // every > before // every


def eval_due(step: int, total_steps: int, tokens_per_step: int, every: int, early: int) -> bool:
    after, before = step * tokens_per_step, (step - 1) * tokens_per_step
    if step >= total_steps or crossed(before, after, every):
        return True
    for k in range(1, early + 1):
        mark = every // (2 ** k)
        if mark > 0 and before < mark <= after:
            return True
    return False


