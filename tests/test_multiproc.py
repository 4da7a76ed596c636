"""The test helper that runs ranks: a rank left blocked after its peer ended is killed and reported."""
import time

from multiproc import RankFailed, run_ranks


def _one_hangs():
    import os

    if os.environ["RANK"] == "1":
        time.sleep(3600)
    return "done"


def test_a_rank_left_running_is_killed_and_reported():
    t0 = time.monotonic()
    r0, r1 = run_ranks(_one_hangs, 2, init=False, grace_s=2.0)
    assert r0 == "done"
    assert isinstance(r1, RankFailed) and r1.type == "Hung", r1
    assert time.monotonic() - t0 < 120
