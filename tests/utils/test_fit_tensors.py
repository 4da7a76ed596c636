"""Snapshots of a fit's parameters, putting one (or one layer's slice) back, and AdamW after a bad update."""
import torch

from tcal.utils.fit_tensors import heldout_step, reset_optimizer, restore, set_lr, snapshot


def stepped_adam(n_layers=3):
    p = torch.nn.Parameter(torch.randn(n_layers, 4, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.AdamW([{"params": [p], "lr": 0.1}, {"params": [], "lr": 0.01}])
    p.sum().backward()
    opt.step()
    return p, opt


def test_snapshot_and_restore_whole_or_one_slice():
    p, _ = stepped_adam()
    saved = snapshot([p])
    assert not saved[0].requires_grad and saved[0].data_ptr() != p.data_ptr()
    with torch.no_grad():
        p.add_(1.0)
    moved = p.detach().clone()
    restore([p], saved, index=1)
    assert torch.equal(p[1], saved[0][1]) and torch.equal(p[0], moved[0]) and torch.equal(p[2], moved[2])
    restore([p], saved)
    assert torch.equal(p, saved[0]) and p.requires_grad


def test_reset_drops_the_state_or_zeroes_one_layers_moments():
    p, opt = stepped_adam()
    reset_optimizer(opt, [p], "moments", index=1)
    st = opt.state[p]
    for buf in ("exp_avg", "exp_avg_sq"):
        assert torch.all(st[buf][1] == 0) and torch.all(st[buf][0] != 0) and torch.all(st[buf][2] != 0)
    assert float(st["step"]) == 1.0  # the stack's shared step count stays
    reset_optimizer(opt, [p], "optimizer")
    assert len(opt.state) == 0


def test_set_lr_scales_each_groups_base_rate():
    _, opt = stepped_adam()
    set_lr(opt, [0.1, 0.01], 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.1 * 0.5, 0.01 * 0.5]


def test_heldout_step_scores_only_when_due_and_keeps_a_copy_of_a_new_best():
    from tcal.utils.fit import FitRules, begin
    from tcal.utils.schedule import Schedule

    rules = FitRules(Schedule("constant", 6), eval_every=2, patience=1)
    p = torch.nn.Parameter(torch.zeros(2))
    best, curve, calls = snapshot([p]), [], []

    def score():
        calls.append(float(p.detach()[0]))
        return 1.0 - calls[-1]

    fit = begin(1.0)
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            p.add_(1.0 if step <= 2 else -5.0)  # better until update 2, worse after
        fit, best = heldout_step(rules, fit, step, score, [p], best, curve)
    assert calls == [2.0, -8.0] and curve == [(2, -1.0), (4, 9.0)]  # checks after updates 2 and 4 only
    assert fit.best_step == 2 and fit.stopped and torch.equal(best[0], torch.full((2,), 2.0))
