"""Warm-up length and the token counts at which a run evaluates or checkpoints (the learning rate
itself: :func:`tcal.utils.schedule.lr_at`)."""
from __future__ import annotations

import math


def warmup_steps(cfg, total_steps: int, tokens_per_step: int) -> int:
    w = cfg.warmup * total_steps if cfg.warmup < 1 else cfg.warmup / tokens_per_step
    return min(total_steps, int(math.ceil(w)))


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


