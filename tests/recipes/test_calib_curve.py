"""bench/calib_curve.py: which sweep row stands for each (init, budget), and files that do not compare."""
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
T = {"method": "teacher", "ppl": {"wiki:eval": 16.0, "sotu:eval": 45.0}}


def curve_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it reads BUDGETS from its sibling calib_sweep.py
    spec = importlib.util.spec_from_file_location("calib_curve", BENCH / "calib_curve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(method, budget, wiki, kl_steps=None, **kw):
    r = {"keep": "50", "calib": "mix", "method": method, "budget": budget,
         "ppl": {"wiki:eval": wiki, "sotu:eval": 2 * wiki}, "convert_s": 10.0, **kw}
    if kl_steps is not None:
        r["kl"] = {"steps_run": kl_steps}
    return r


def test_the_longest_kl_stage_stands_for_a_budget_and_other_rows_are_left_out(monkeypatch, tmp_path):
    cc = curve_module(monkeypatch)
    a = [T, row("tes-kl", "256k", 19.9, 100), row("phase2", "256k", 24.0), row("tes-kl", "1m", 18.5, 595)]
    b = [T, row("tes-kl", "256k", 19.5, 300), row("tes-kl", "1m", 18.0, 1200), row("tes-kl", "256k", 19.0, 90),
         row("tes-kl", "16k", 9.0, keep="73"), row("tes-kl", "16k", 9.0, calib="wiki"),
         {"keep": "50", "calib": "mix", "method": "tes-kl", "budget": "4k", "error": "OOM"}]
    teacher, pts = cc.pick_points([("a", a), ("b", b)], "50", "mix")
    assert teacher == T["ppl"]
    assert sorted(pts) == ["phase2", "taylor"]  # names a user types; keep 73, wiki and the failed job left out
    assert {t: (r["ppl"]["wiki:eval"], f) for t, (r, f) in pts["taylor"].items()} == {
        512 * 512: (19.5, "b"), 2048 * 512: (18.0, "b")}  # no "tokens" in the rows: the budget's
    md = cc.markdown(teacher, pts)
    assert "| 262,144 | taylor | 300 | 19.50 (1.22x) | 39.00 (0.87x) | 10 s | b |" in md
    out = tmp_path / "o"
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in b))
    cc.main([str(tmp_path / "b.jsonl"), "--out", str(out)])
    assert (out / "calib_curve.png").read_bytes()[:4] == b"\x89PNG" and (out / "calib_curve.md").exists()


def test_files_scored_on_other_evaluation_windows_are_refused(monkeypatch):
    cc = curve_module(monkeypatch)
    other = {"method": "teacher", "ppl": {"wiki:eval": 16.5, "sotu:eval": 50.8}}
    with pytest.raises(SystemExit, match="other evaluation windows"):
        cc.pick_points([("a", [T]), ("cpu", [other])], "50", "mix")
    with pytest.raises(SystemExit, match="no teacher row"):
        cc.pick_points([("a", [row("phase2", "1k", 30.0)])], "50", "mix")


def test_the_long_budget_is_the_measured_sweep_job(monkeypatch):
    """`--calib-budget long` must run what the GPU sweep measured (long-window-4k, 90 KL steps, recall mix 0.5)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import calib_sweep

    from tcal.taylor.budget import CalibArgs
    from tcal.taylor.stage_config import KLConfig

    b = CalibArgs(calib_budget="long").budget("cuda")
    n, w = b.windows, b.window
    assert calib_sweep.BUDGETS["256k-4k"] == (n, w)
    assert b.align == calib_sweep.align_for("256k-4k", 300)
    sweep_kl = KLConfig(steps=90, batch_size=max(1, calib_sweep.KL_TOKENS // w), eval_every=5, patience=4,
                        recall_frac=0.5)  # run_job's KLConfig for that job with --kl-steps-all 90 --kl-recall-frac 0.5
    assert b.kl == sweep_kl


def test_sweep_jobs_name_the_registrys_inits_and_old_rows_keep_their_labels(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import calib_sweep

    from tcal.conversion.inits import ALIGN_MODES, INITS

    jobs = [j for js in calib_sweep.job_sets().values() for j in js]
    assert {j["method"] for j in jobs} <= set(INITS) and all(j.get("align", "local") in ALIGN_MODES for j in jobs)
    job = dict(keep="50", method="taylor-exact-silent", align="sequential", calib="mix", budget="16k")
    spec = calib_sweep.init_spec(job)
    assert (spec.phase1, spec.phase2, spec.kl, spec.align) == ("exact-silent", True, False, "sequential")
    assert calib_sweep.init_spec(dict(job, method="taylor", align=None)) is INITS["taylor"]
    assert calib_sweep.job_name(dict(job, method="taylor"), kl_steps=100) == "50-taylor-sequential-mix-16k-kl100"
    cc = curve_module(monkeypatch)
    assert cc.init_label({"method": "taylor-exact-silent", "align": "sequential"}) == cc.init_label(
        {"method": "tes-seq"}) == "taylor-exact-silent, sequential"
