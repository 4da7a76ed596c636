"""The shared fit pattern: held-out checks, best state, patience and non-finite updates, as pure functions."""
import math

import pytest

from tcal.utils.errors import TcalError
from tcal.utils.fit import FitRules, FitState, begin, heldout_check, nonfinite, train_loss
from tcal.utils.schedule import Schedule


def rules(steps=20, **kw):
    return FitRules(Schedule("constant", steps), **kw)


def run_checks(r, scores, start=1.0):
    """Fold held-out scores (one check after each update) into a state; stop where the rules say."""
    s = begin(start)
    for step, score in enumerate(scores, 1):
        s = heldout_check(r, s, step, score)
        if s.stopped:
            break
    return s, step


def test_a_new_best_is_finite_and_strictly_lower():
    s = begin(1.0)
    assert (s.best, s.best_step, s.stale, s.stopped) == (1.0, 0, 0, False)  # the starting weights are the best
    s = heldout_check(rules(), s, 3, 0.5)
    assert (s.best, s.best_step, s.new_best, s.stale) == (0.5, 3, True, 0)
    for score in (0.5, math.nan, math.inf, 0.7):  # a tie, non-finite or worse score is no new best
        s = heldout_check(rules(), s, 4, score)
        assert (s.best, s.best_step, s.new_best) == (0.5, 3, False)
    assert s.stale == 4 and not s.stopped  # no patience: it never stops
    s = heldout_check(rules(), s, 5, 0.25)
    assert (s.best_step, s.stale, s.new_best) == (5, 0, True)


def test_patience_counts_checks_without_a_new_best():
    s, step = run_checks(rules(patience=2), [0.9, 1.2, 0.95, 1.0, 0.8])
    assert s.stopped and step == 3 and s.best_step == 1  # checks 2 and 3 were stale
    s, step = run_checks(rules(patience=2), [0.9, 1.2, 0.8, 1.0, 0.7])
    assert not s.stopped and s.best_step == 5  # a new best resets the count


def test_the_patience_floor_is_a_share_of_the_run():
    assert rules(300, eval_every=5, patience=4, patience_frac=0.1).stale_limit() == 6
    assert rules(40, eval_every=5, patience=4, patience_frac=0.1).stale_limit() == 4  # short runs keep the patience
    assert rules(300, eval_every=5, patience=4).stale_limit() == 4  # Phase 2: no floor
    assert rules(300, patience=None, patience_frac=0.5).stale_limit() is None
    s, step = run_checks(rules(20, patience=2, patience_frac=0.5), [2.0] * 20)
    assert s.stopped and step == 10 and s.best_step == 0


def test_without_heldout_the_training_loss_picks_the_state_before_its_update():
    s = begin()
    assert s.best == math.inf
    s = train_loss(s, 1, 3.0)  # measured on the starting weights
    assert (s.best, s.best_step, s.new_best) == (3.0, 0, True)
    s = train_loss(s, 2, 2.0)
    assert (s.best_step, s.new_best) == (1, True)
    s = train_loss(s, 3, 2.5)
    assert (s.best, s.best_step, s.new_best, s.stopped) == (2.0, 1, False, False)


@pytest.mark.parametrize("policy, bad, stopped", [("stop", (3,), True), ("skip", (3, 5), False),
                                                  ("skip", (3, 5, 6), True)])
def test_nonfinite_updates_stop_or_are_skipped(policy, bad, stopped):
    r = rules(on_nonfinite=policy, max_nonfinite=3)
    s = heldout_check(r, begin(1.0), 1, 0.5)
    for step in bad:
        s = nonfinite(r, s, step)
    assert s.nonfinite == bad and s.stopped == stopped
    assert (s.best, s.best_step, s.new_best) == (0.5, 1, False)  # the best state stays the best


def test_raise_fails_with_the_loops_message():
    with pytest.raises(TcalError, match="lower --lr"):
        nonfinite(rules(on_nonfinite="raise"), FitState(), 7, "the loss is not finite at step 7; lower --lr")
    with pytest.raises(TcalError, match="update 7"):
        nonfinite(rules(on_nonfinite="raise"), FitState(), 7)


def test_checks_fall_every_n_updates_or_on_token_marks():
    r = rules(12, eval_every=5)
    assert [s for s in range(1, 13) if r.check_due(s)] == [5, 10, 12]
    r = FitRules(Schedule("cosine", 40), eval_every=100, tokens_per_step=10, eval_early=3)  # distillation's
    assert [s for s in range(1, 41) if r.check_due(s)] == [2, 3, 5, 10, 20, 30, 40]
    assert r.steps == 40


def test_bad_rules_are_refused():
    for bad, message in ((dict(eval_every=0), "eval_every must be >= 1, got 0"),
                         (dict(tokens_per_step=0), "tokens_per_step must be >= 1, got 0"),
                         (dict(eval_early=-1), "eval_early must be >= 0, got -1"),
                         (dict(patience=0), "patience must be >= 1 checks"),
                         (dict(on_nonfinite="ignore"), "on_nonfinite must be one of stop, skip, raise, got 'ignore'"),
                         (dict(reset="all"), "reset must be one of optimizer, moments, got 'all'")):
        with pytest.raises(TcalError, match=f"^a fit's {message}"):
            rules(**bad)
