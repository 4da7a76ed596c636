"""Learning-rate schedule, warm-up and the token counts at which a run evaluates or checkpoints."""
from types import SimpleNamespace

import pytest

from tcal.train.schedule import crossed, eval_due, warmup_steps
from tcal.utils.schedule import lr_at


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
