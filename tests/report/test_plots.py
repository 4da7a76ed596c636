"""Plots (smoke): every plot writes a real image without touching pyplot's global state."""
import sys

import torch
from helpers import tiny_teacher

from tcal.conversion.select import Selection
from tcal.report.plots import (
    fmt_ppl,
    plot_ablation,
    plot_bench,
    plot_calib_budget,
    plot_curve,
    plot_recovery,
    plot_selection,
    plot_stats,
)
from tcal.report.targets import target_table
from tcal.taylor.statistics import collect_stats

PNG = b"\x89PNG"
COPY = [(0, 1000.0), (100, 50.0), (200, 20.0), (300, 15.0)]
TAYLOR = [(0, 100.0), (100, 14.0), (200, 11.5), (300, 10.5)]


def rows(curve):
    return [{"tokens": t, "step": i, "eval_ppl": p, "train_loss": float("nan") if i == 0 else 3.0 - i,
             "lr": 1e-3, "elapsed_s": float(i)} for i, (t, p) in enumerate(curve)]


def is_png(path):
    return open(path, "rb").read(4) == PNG


def test_fmt_ppl():
    assert (fmt_ppl(12.34), fmt_ppl(12345.6), fmt_ppl(float("inf"))) == ("12.3", "12,346", "inf")


def test_curve_and_recovery_plots(tmp_path):
    assert is_png(plot_curve(rows(TAYLOR), tmp_path / "curve.png", teacher_ppl=10.0, title="t"))
    curves = {"copy": rows(COPY), "taylor": rows(TAYLOR)}
    table = target_table(curves, teacher_ppl=10.0)
    assert is_png(plot_recovery(curves, 10.0, tmp_path / "recovery.png", table=table, title="r"))


def test_stats_ablation_and_selection_plots(tmp_path):
    pyplot_before = "matplotlib.pyplot" in sys.modules
    teacher = tiny_teacher("llama", num_hidden_layers=2)
    stats = collect_stats(teacher, torch.randint(0, 97, (2, 8)), progress=False)
    assert is_png(plot_stats(stats, tmp_path / "sub" / "stats.png"))
    res = {"rows": [{"init": "copy", "ppl": 900.0}, {"init": "taylor-exact-silent", "ppl": 40.0}],
           "teacher_ppl": 20.0, "evaluation": {"data": "wiki:eval"}, "teacher": "tiny", "converted_fraction": 0.5}
    plot_ablation(res, tmp_path / "ablation.png", baselines=("copy",))
    assert is_png(tmp_path / "ablation.png")
    sel = Selection("ar:2", [1, 3], [30.0, 50.0, 20.0, 60.0], "ppl_with_layer_attention_removed")
    plot_selection(sel, tmp_path / "selection.png", teacher_ppl=15.0)
    assert is_png(tmp_path / "selection.png")
    assert pyplot_before or "matplotlib.pyplot" not in sys.modules  # the plots never import pyplot


def test_bench_plot_skips_errors_and_missing_numbers(tmp_path):
    cells = [{"model": "teacher-eager", "context": 2048, "decode_ms": 20.0, "prefill_tok_s": 9e3},
             {"model": "teacher-eager", "context": 8192, "error": "out of memory"},
             {"model": "teacher-compiled", "context": 2048, "decode_ms": 8.0},  # no prefill number
             {"model": "hybrid-fast", "context": 2048, "decode_ms": 5.0, "prefill_tok_s": 2e4},
             {"model": "hybrid-fast", "context": 8192, "decode_ms": 5.5, "prefill_tok_s": 1.9e4}]
    assert is_png(plot_bench(cells, tmp_path / "bench.png", title="b"))
    assert is_png(plot_bench([{"model": "generate", "context": 16, "error": "x"}], tmp_path / "empty.png"))


def test_calib_budget_plot_draws_each_domain_and_refuses_nothing_to_draw(tmp_path):
    import pytest

    from tcal.utils.errors import TcalError

    series = {"phase2": [(16384, {"a": 25.0, "b": 60.0}), (1 << 20, {"a": 24.0, "b": 58.0})],
              "taylor": [(1 << 20, {"a": 18.0})]}  # a point may lack a domain
    assert is_png(plot_calib_budget(series, {"a": 16.3, "b": 42.5}, tmp_path / "c.png", title="t"))
    with pytest.raises(TcalError, match="no evaluation domain"):
        plot_calib_budget({}, {}, tmp_path / "d.png")
