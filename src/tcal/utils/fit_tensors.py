"""The tensor side of a fit (:mod:`tcal.utils.fit`): copies of the trained parameters, putting one back, and
AdamW's state after a non-finite update. ``index`` picks one layer of a stack fitted side by side (the
stacked tensors' first dimension)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tcal.utils.fit import FitRules, FitState, heldout_check


def snapshot(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


@torch.no_grad()
def restore(params: Sequence[torch.Tensor], state: Sequence[torch.Tensor], index: int | None = None) -> None:
    """Copy ``state`` into ``params`` (only their ``index`` slice, if given)."""
    for p, s in zip(params, state):
        if index is None:
            p.copy_(s)
        else:
            p[index].copy_(s[index])


def heldout_step(rules: FitRules, fit: FitState, step: int, score: Callable[[], float],
                 params: Sequence[torch.Tensor], best: list[torch.Tensor], curve: list) -> tuple[FitState, list]:
    """After update ``step``, the held-out check if one is due: ``score()`` of the current state, appended to
    ``curve`` as (step, score) and folded into ``fit``. Returns (fit, best state: a snapshot of ``params`` on a
    new best, else ``best``)."""
    if not rules.check_due(step):
        return fit, best
    value = score()
    curve.append((step, value))
    fit = heldout_check(rules, fit, step, value)
    return fit, (snapshot(params) if fit.new_best else best)


@torch.no_grad()
def reset_optimizer(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], reset: str,
                    index: int | None = None) -> None:
    """Forget what a non-finite update may have left in AdamW's moments (:attr:`FitRules.reset`): "optimizer"
    drops its whole state, "moments" zeroes the ``index`` slice of each parameter's moments."""
    if reset == "optimizer":
        opt.state.clear()
        return
    for p in params:
        for buf in ("exp_avg", "exp_avg_sq"):
            if buf in opt.state.get(p, {}):
                opt.state[p][buf][index].zero_()


def set_lr(opt: torch.optim.Optimizer, base_lrs: Sequence[float], factor: float) -> None:
    """Each parameter group's learning rate: its base rate times ``factor`` (the schedule's, :mod:`tcal.utils.schedule`)."""
    for group, lr in zip(opt.param_groups, base_lrs):
        group["lr"] = lr * factor
