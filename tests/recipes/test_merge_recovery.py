"""bench/merge_recovery.py: runs made in separate device calls merge into one table only when every init
was calibrated the same way (the recorded, resolved settings, not the command line)."""
import importlib.util
import json
from pathlib import Path

import pytest

from tcal.train.curve import curve_csv

BENCH = Path(__file__).resolve().parents[2] / "bench" / "merge_recovery.py"
ALIGN = {"steps": 300, "batch_size": 16}


def merge_module():
    spec = importlib.util.spec_from_file_location("merge_recovery", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_run(root: Path, init: str, calib: dict | None) -> Path:
    run = root / init
    (run / init).mkdir(parents=True)
    (run / "tcal_config.json").write_text(json.dumps({"teacher": "smollm2-135m", "keep": "0,2", "inits": init,
                                                      "tokens": 1000}))
    (run / "teacher_ppl.json").write_text(json.dumps({"ppl": 16.0}))
    (run / init / "report.json").write_text(json.dumps({"status": "done"}))
    rows = [dict(tokens=t, step=s, eval_ppl=p, train_loss=1.0, lr=1e-4, elapsed_s=1.0)
            for s, (t, p) in enumerate([(0, 40.0), (500, 25.0), (1000, 19.0)])]
    (run / init / "curve.csv").write_text(curve_csv(rows))
    (run / f"{init}.init.json").write_text(json.dumps({"init": init, "calib": calib}))
    return run


def test_runs_calibrated_alike_merge_and_record_their_settings(tmp_path):
    mod = merge_module()
    calib = {"data": "wiki:calib", "window": 512, "windows": 512, "align": ALIGN}
    a = make_run(tmp_path, "phase2", calib)
    b = make_run(tmp_path, "taylor", {**calib, "kl": {"steps": 300}})
    c = make_run(tmp_path, "copy", None)
    mod.main([str(a), str(b), str(c), "--out", str(tmp_path / "merged")])
    out = json.loads((tmp_path / "merged" / "recovery.json").read_text())
    assert out["calib"]["taylor"]["kl"] == {"steps": 300} and out["calib"]["copy"] is None


def test_a_changed_budget_preset_refuses_the_merge(tmp_path):
    mod = merge_module()
    calib = {"data": "wiki:calib", "window": 512, "windows": 512}
    a = make_run(tmp_path, "phase2", {**calib, "align": ALIGN})
    b = make_run(tmp_path, "taylor", {**calib, "align": {**ALIGN, "steps": 100}, "kl": {"steps": 300}})
    with pytest.raises(SystemExit, match="calibrated with different settings: align"):
        mod.main([str(a), str(b), "--out", str(tmp_path / "merged")])
    assert mod.calib_conflicts({"x": {"kl": {"steps": 100}}, "y": {"kl": {"steps": 300}}, "z": {}}) == [
        'kl: x {"steps": 100}; y {"steps": 300}']
    assert mod.calib_conflicts({"x": {"align": ALIGN}, "y": None, "copy": None}) == []
