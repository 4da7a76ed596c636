"""The learning-rate schedule, warm-up and the points at which a run checks or checkpoints."""
import math
from types import SimpleNamespace

import pytest

from tcal.utils.errors import TcalError
from tcal.utils.schedule import Schedule, crossed, eval_due, lr_at, warmup_steps


def lr_factor(step, steps, kind, warmup):
    """The calibration stages' factor on their base learning rates at update ``step`` (0-based) of ``steps``."""
    return Schedule(kind, steps, warmup).lr(step)


def test_schedule_and_eval_points():
    kw = dict(peak=1.0, total_steps=100, warmup=10, min_ratio=0.1)
    assert lr_at(0, schedule="constant", **kw) == pytest.approx(0.1)
    assert lr_at(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(50, schedule="constant", **kw) == 1.0
    assert lr_at(99, schedule="cosine", **kw) == pytest.approx(0.1, abs=1e-3)
    steps = [s for s in range(1, 41) if eval_due(s, 40, 10, every=100, early=3)]
    assert steps == [2, 3, 5, 10, 20, 30, 40]  # early marks 50, 25, 12 tokens, then every 100, and the end


def test_warmup_steps_and_crossed():
    assert warmup_steps(SimpleNamespace(warmup=0.02), 100, 64) == 2  # a fraction of the run
    assert warmup_steps(SimpleNamespace(warmup=640), 100, 64) == 10  # a number of tokens
    assert warmup_steps(SimpleNamespace(warmup=10 ** 9), 100, 64) == 100  # never past the run
    assert warmup_steps(SimpleNamespace(warmup=0.0), 100, 64) == 0
    assert crossed(90, 110, 100) and not crossed(100, 199, 100) and crossed(199, 200, 100)


def test_lr_factor_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0, 100, "constant", 0) == 1.0 and lr_factor(99, 100, "constant", 0) == 1.0
    assert lr_factor(0, 100, "cosine", 10) == pytest.approx(0.1) and lr_factor(9, 100, "cosine", 10) == 1.0
    assert lr_factor(10, 100, "cosine", 10) == pytest.approx(1.0)
    assert lr_factor(99, 100, "cosine", 10) == pytest.approx(0.1)
    mid = lr_factor(10 + 89 // 2, 100, "cosine", 10)
    assert 0.5 < mid < 0.6 and not math.isnan(mid)


def test_the_floor_is_the_last_update_or_one_past_it():
    calib = Schedule("cosine", 10, 0, min_ratio=0.2)
    distill = Schedule("cosine", 10, 0, min_ratio=0.2, floor_at_last=False)
    assert calib.lr(9, peak=3.0) == pytest.approx(0.6) and distill.lr(9, peak=3.0) > 0.6
    for step in range(10):  # each is lr_at with its own end, the peak passed through unrounded
        assert distill.lr(step, peak=3e-3) == lr_at(step, peak=3e-3, total_steps=10, warmup=0, schedule="cosine",
                                                     min_ratio=0.2)
        assert calib.lr(step) == lr_at(step, peak=1.0, total_steps=9, warmup=0, schedule="cosine", min_ratio=0.2)


def test_one_token_per_step_checks_every_n_updates_and_after_the_last():
    assert [s for s in range(1, 13) if eval_due(s, 12, 1, every=5, early=0)] == [5, 10, 12]
    assert [s for s in range(1, 4) if eval_due(s, 3, 1, every=1, early=0)] == [1, 2, 3]


def test_bad_schedules_are_refused():
    for bad, message in ((dict(kind="linear"), "schedule must be one of constant, cosine, got 'linear'"),
                         (dict(steps=-1), "schedule steps must be >= 0, got -1"),
                         (dict(warmup=-1), "schedule warm-up must be >= 0, got -1")):
        with pytest.raises(TcalError, match=f"^{message}$"):
            Schedule(**bad)
