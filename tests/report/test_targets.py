"""Recovery targets: tokens to reach a PPL, and the table of ratios against the copy baseline."""
import pytest

from tcal.report.targets import BASELINE, TARGET_FACTORS, table_markdown, target_table, tokens_to_target
from tcal.utils.errors import TcalError

COPY = [(0, 1000.0), (100, 50.0), (200, 20.0), (300, 15.0)]
TAYLOR = [(0, 100.0), (100, 14.0), (200, 11.5), (300, 10.5)]


def test_tokens_to_target():
    r = tokens_to_target(COPY, 12.0)
    assert r == {"reached": False, "tokens": None, "interp": None, "budget": 300, "display": "> 300"}
    r = tokens_to_target(TAYLOR, 15.0)
    assert r["reached"] and r["tokens"] == 100 and r["display"] == "100"
    assert r["interp"] == pytest.approx((100 - 15) / (100 - 14) * 100)
    assert tokens_to_target(TAYLOR, 200.0)["tokens"] == 0  # already there before training
    # non-monotone curve: the first point at or below the target counts
    assert tokens_to_target([(0, 30.0), (10, 19.0), (20, 25.0), (30, 18.0)], 20.0)["tokens"] == 10


def test_target_table_and_ratios():
    table = target_table({"copy": COPY, "taylor": TAYLOR}, teacher_ppl=10.0)
    rows = {r["name"]: r for r in table["targets"]}
    assert list(rows) == ["1.1x teacher PPL", "1.2x teacher PPL", "1.5x teacher PPL", "2x teacher PPL",
                          "copy final PPL"]
    assert rows["1.1x teacher PPL"]["runs"]["copy"]["display"] == "> 300"
    assert rows["1.1x teacher PPL"]["runs"]["taylor"]["tokens"] == 300
    assert rows["1.2x teacher PPL"]["ratio"]["taylor"] == {"value": 1.5, "bound": ">", "display": "> 1.50x"}
    assert rows["1.5x teacher PPL"]["ratio"]["taylor"]["value"] == pytest.approx(3.0)
    assert rows["1.5x teacher PPL"]["ratio"]["taylor"]["bound"] == "="
    assert rows["2x teacher PPL"]["ratio"]["taylor"]["value"] == pytest.approx(2.0)
    assert rows["copy final PPL"]["ppl"] == 15.0 and rows["copy final PPL"]["runs"]["copy"]["tokens"] == 300
    # an init that never reaches a target the baseline reaches: an upper bound on the ratio
    worse = target_table({"copy": COPY, "slow": [(0, 900.0), (300, 40.0)]}, teacher_ppl=10.0)
    r2 = {r["name"]: r for r in worse["targets"]}["2x teacher PPL"]
    assert r2["runs"]["slow"]["display"] == "> 300" and r2["ratio"]["slow"]["bound"] == "<"
    assert r2["ratio"]["slow"]["value"] == pytest.approx(200 / 300)
    md = table_markdown(table)
    assert "> 300" in md and "copy/taylor" in md and "interp." in md and "3.00x" in md


def test_curve_rows_empty_curve_and_constants():
    rows = [{"tokens": t, "eval_ppl": p} for t, p in TAYLOR]
    assert tokens_to_target(rows, 15.0) == tokens_to_target(TAYLOR, 15.0)
    with pytest.raises(TcalError, match="empty curve"):
        tokens_to_target([], 10.0)
    assert TARGET_FACTORS == (1.1, 1.2, 1.5, 2.0) and BASELINE == "copy"
