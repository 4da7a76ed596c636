"""The training pattern every fit in tcal shares, as pure pieces: the learning rate of each update, when a
held-out check is due, which state is the best so far, when patience runs out, and what a non-finite update
does.

Phase 2 (:func:`tcal.taylor.phase2.align_layer`, and :func:`~tcal.taylor.phase2.align_group` for layers side
by side), the KL stage (:func:`tcal.taylor.kl_stage.kl_stage`) and distillation
(:class:`tcal.train.trainer.Trainer`) each build one :class:`FitRules` from their settings and fold what
happens into a :class:`FitState` with :func:`heldout_check`, :func:`train_loss` and :func:`nonfinite`. Where
the loops differ, the difference is an option of :class:`FitRules`. The tensors (snapshots, the optimizer)
stay with the loop (:mod:`tcal.utils.fit_tensors`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tcal.utils.errors import TcalError
from tcal.utils.schedule import Schedule, eval_due

NONFINITE = ("stop", "skip", "raise")
RESETS = ("optimizer", "moments")


@dataclass(frozen=True)
class FitRules:
    """How a fit steps, checks, stops and recovers."""

    schedule: Schedule
    # a held-out check every this many tokens (updates x tokens_per_step) and after the last update
    eval_every: int = 1
    # Distillation counts its budget and its checks in tokens (its curve's points are token marks); the
    # calibration stages count updates (1 token per step).
    tokens_per_step: int = 1
    # Distillation's extra checks at eval_every/2, /4, ... (this many): its curve moves fastest early on.
    eval_early: int = 0
    # held-out checks without a new best that end the fit; None: it runs to the end. Distillation has none: it
    # picks no state, its checks are the curve's points and a run ends on its last state.
    patience: int | None = None
    # The KL stage's floor on the patience, a share of the run's checks: late in a long stage the held-out KL
    # still falls, slowly and with plateaus, and a fixed few checks cut it off mid-descent. Phase 2: 0.
    patience_frac: float = 0.0
    # After a non-finite update: "stop" ends the fit (the KL stage; Phase 2 by default), "skip" goes on
    # (Phase 2 on request: one bad minibatch need not end a layer), "raise" fails the run (distillation: hours
    # of training must not end quietly on a learning rate that is too high). Phase 2 checks the loss, the
    # gradient and the updated weights in one read of the device and undoes the update; the KL stage and
    # distillation read their loss before the update anyway and check that alone, so nothing is applied.
    on_nonfinite: str = "stop"
    max_nonfinite: int = 10  # with "skip": stop after this many non-finite updates
    # What a non-finite update leaves of AdamW's state: "optimizer" drops it, step count included (one
    # layer's fit restarts its bias correction), "moments" zeroes the layer's moments only (the layers of a
    # stack fitted side by side share one step count, which cannot restart for one of them).
    reset: str = "optimizer"

    def __post_init__(self):
        for name, least in (("eval_every", 1), ("tokens_per_step", 1), ("eval_early", 0)):
            if getattr(self, name) < least:
                raise TcalError(f"a fit's {name} must be >= {least}, got {getattr(self, name)}")
        if self.patience is not None and self.patience < 1:
            raise TcalError(f"a fit's patience must be >= 1 checks (or None), got {self.patience}")
        if self.on_nonfinite not in NONFINITE:
            raise TcalError(f"a fit's on_nonfinite must be one of {', '.join(NONFINITE)}, got {self.on_nonfinite!r}")
        if self.reset not in RESETS:
            raise TcalError(f"a fit's reset must be one of {', '.join(RESETS)}, got {self.reset!r}")

    @property
    def steps(self) -> int:
        return self.schedule.steps

    def check_due(self, step: int) -> bool:
        """Whether a held-out check follows update ``step`` (1-based)."""
        return eval_due(step, self.steps, self.tokens_per_step, self.eval_every, self.eval_early)

    def stale_limit(self) -> int | None:
        """Held-out checks without a new best that end the fit (None: it never stops early)."""
        if self.patience is None:
            return None
        return max(self.patience, math.ceil(self.patience_frac * self.steps / self.eval_every))


@dataclass(frozen=True)
class FitState:
    """What a fit has seen so far; every event gives a new one."""

    best: float = math.inf  # the best score so far: held-out, or the training loss without held-out sequences
    best_step: int = 0  # updates behind the best state (0: the state the fit started from)
    new_best: bool = False  # the last event made a new best: the loop keeps a copy of that state
    stale: int = 0  # held-out checks since the last new best
    nonfinite: tuple[int, ...] = ()  # the updates that came out non-finite and were undone
    stopped: bool = False  # by patience or by non-finite updates


def begin(score: float | None = None) -> FitState:
    """The state before the first update; ``score``: the held-out score of the starting weights, the best so
    far (None: no held-out sequences, the training loss picks the state)."""
    return FitState() if score is None else FitState(best=score)


def heldout_check(rules: FitRules, state: FitState, step: int, score: float) -> FitState:
    """After the held-out check of the state after update ``step``: a finite score below the best is a new best;
    anything else is one more stale check, and at ``rules.stale_limit()`` of them the fit stops."""
    if math.isfinite(score) and score < state.best:
        return replace(state, best=score, best_step=step, new_best=True, stale=0)
    stale, limit = state.stale + 1, rules.stale_limit()
    return replace(state, new_best=False, stale=stale, stopped=state.stopped or (limit is not None and stale >= limit))


def train_loss(state: FitState, step: int, loss: float) -> FitState:
    """Without held-out sequences the training loss picks the state: the loss of update ``step`` was measured
    on the weights before it, so a new best is the state after step - 1 updates. Phase 2 only (the reference's
    rule, with ``heldout_frac=0``); the KL stage refuses to run without held-out sequences, which make it
    never return a worse model than it was given."""
    if loss < state.best:
        return replace(state, best=loss, best_step=step - 1, new_best=True)
    return replace(state, new_best=False)


def nonfinite(rules: FitRules, state: FitState, step: int, error: str = "") -> FitState:
    """After update ``step`` came out non-finite (the loop has undone it, or never applied it): with "raise"
    a :class:`TcalError` saying ``error``; else the update is recorded and the fit stops ("stop", or "skip"
    at ``max_nonfinite`` of them)."""
    if rules.on_nonfinite == "raise":
        raise TcalError(error or f"non-finite loss, gradient or weights at update {step}")
    bad = (*state.nonfinite, step)
    stop = rules.on_nonfinite == "stop" or len(bad) >= rules.max_nonfinite
    return replace(state, new_best=False, nonfinite=bad, stopped=state.stopped or stop)
