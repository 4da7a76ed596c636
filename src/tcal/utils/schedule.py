"""The learning rate over a run, and the points of a run where it checks a held-out score or checkpoints.

Pure functions (no torch), shared by Phase 2, the KL stage and distillation: :class:`Schedule` is the
learning rate of each update, :func:`eval_due` and :func:`crossed` say where a run stops to look.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tcal.utils.errors import TcalError

SCHEDULES = ("constant", "cosine")


def lr_at(step: int, *, peak: float, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up to ``peak``, then constant or cosine."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    span = max(1, total_steps - warmup)
    p = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


@dataclass(frozen=True)
class Schedule:
    """The learning rate of each update of a run of ``steps`` updates: a linear warm-up over ``warmup``
    updates, then constant (``kind="constant"``) or a cosine down to ``min_ratio`` of the peak."""

    kind: str = "constant"
    steps: int = 0
    warmup: int = 0
    # the calibration stages' 0.1, not 0: their last updates still move weights they may keep as their best
    # state; distillation's is --min-lr-ratio
    min_ratio: float = 0.1
    # Where the cosine reaches min_ratio. The calibration stages: at their last update (steps - 1), whose weights
    # they may keep. Distillation: at update ``steps``, one past its last: moving it would change the learning rate
    # of every distillation and switch the schedule of runs resumed from the checkpoints they already wrote.
    floor_at_last: bool = True

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise TcalError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.steps < 0:
            raise TcalError(f"schedule steps must be >= 0, got {self.steps}")
        if self.warmup < 0:
            raise TcalError(f"schedule warm-up must be >= 0, got {self.warmup}")

    def lr(self, step: int, peak: float = 1.0) -> float:
        """The learning rate of update ``step`` (0-based) for a peak of ``peak`` (1: the factor on a base rate)."""
        end = self.steps - 1 if self.floor_at_last else self.steps
        return lr_at(step, peak=peak, total_steps=end, warmup=self.warmup, schedule=self.kind,
                     min_ratio=self.min_ratio)


def warmup_steps(cfg, total_steps: int, tokens_per_step: int) -> int:
    """Distillation's warm-up in updates: ``cfg.warmup`` is a share of the run (< 1) or a number of tokens."""
    w = cfg.warmup * total_steps if cfg.warmup < 1 else cfg.warmup / tokens_per_step
    return min(total_steps, int(math.ceil(w)))


def crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in (before, after]."""
    return after // every > before // every


def eval_due(step: int, total_steps: int, tokens_per_step: int, every: int, early: int) -> bool:
    """Whether a check is due after update ``step`` (1-based) of ``total_steps``: after the last update, where
    a multiple of ``every`` tokens is crossed, and at the ``early`` marks every/2, every/4, ... With one token
    per step and no early marks: every ``every`` updates and after the last."""
    after, before = step * tokens_per_step, (step - 1) * tokens_per_step
    if step >= total_steps or crossed(before, after, every):
        return True
    for k in range(1, early + 1):
        mark = every // (2 ** k)
        if mark > 0 and before < mark <= after:
            return True
    return False
