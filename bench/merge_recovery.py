"""One recovery table from `tcal recover` runs made separately (for instance one init per device call).

The inits of one recovery experiment may finish in different runs. This script puts their curves into
one table and plot, and refuses to do so unless every setting that shapes training (data, order,
schedule, budget, calibration, evaluation) is the same in every run; only the init list and the
settings a resume may change differ.

    python bench/merge_recovery.py RUN_DIR [RUN_DIR ...] --out DIR

A RUN_DIR is a finished or interrupted `tcal recover` output (or its archived results: settings in
``tcal_config.json`` or ``recover_config.json``, one ``INIT/curve.csv`` per init trained to the end).
Writes ``DIR/recovery.md``, ``recovery.json`` and ``recovery.png``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tcal.conversion.inits import get_init
from tcal.recipes.recover import RESUME_FREE
from tcal.report.plots import plot_recovery
from tcal.report.targets import table_markdown, target_table
from tcal.train.curve import read_curve
from tcal.train.options import changed_settings

FREE = set(RESUME_FREE) | {"inits", "stage", "overwrite"}
# KL-stage settings that no longer exist, at the value that left them off: recorded so by older runs, they
# compare equal to not being recorded
RETIRED_KL = {"attn_input_weight": 0.0, "attn_map_weight": 0.0, "attn_query_weight": 0.0}


def run_settings(run: Path) -> dict:
    for name in ("tcal_config.json", "recover_config.json"):
        if (run / name).is_file():
            return json.loads((run / name).read_text())
    raise SystemExit(f"{run}: no tcal_config.json or recover_config.json; pass a `tcal recover` output directory")


def finished_curves(run: Path, settings: dict) -> dict:
    """``{init: curve}`` of the inits that trained the full budget in ``run``."""
    curves = {}
    for init in settings["inits"].split(","):
        report = run / init / "report.json"
        if report.is_file() and json.loads(report.read_text()).get("status") == "done":
            curves[init] = read_curve(run / init / "curve.csv")
    return curves


def calib_of(run: Path, init: str) -> dict | None:
    """The Phase 2 / KL-stage settings ``init`` was calibrated with in ``run`` (None for an uncalibrated init or
    a run too old to record them)."""
    info = run / f"{init}.init.json"
    if info.is_file():
        return json.loads(info.read_text()).get("calib")
    summary = run / "recovery.json"
    if summary.is_file():
        return (json.loads(summary.read_text()).get("runs", {}).get(init) or {}).get("calib")
    return None


def calib_conflicts(calibs: dict) -> list[str]:
    """``calibs``: {init: recorded calib settings or None}. The differences that make a merged table unfair:
    calibrated inits whose data or Phase 2 settings differ, or two KL stages with different settings.
    A budget preset that changed between versions looks the same on the command line; this does not."""
    rec = {i: {**c, "kl": _current_kl(c["kl"])} if "kl" in c else c for i, c in calibs.items() if c}
    out = []
    for key in ("data", "window", "windows", "align", "kl"):
        values = {i: c.get(key) for i, c in rec.items() if key != "kl" or "kl" in c}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            out.append(f"{key}: " + "; ".join(f"{i} {json.dumps(v, sort_keys=True)}" for i, v in values.items()))
    return out


def _current_kl(kl):
    if not isinstance(kl, dict):
        return kl
    return {k: v for k, v in kl.items() if not (k in RETIRED_KL and v == RETIRED_KL[k])}


def teacher_ppl_of(run: Path) -> float:
    for name, key in (("recovery.json", "teacher_ppl"), ("teacher_ppl.json", "ppl")):
        if (run / name).is_file():
            return float(json.loads((run / name).read_text())[key])
    raise SystemExit(f"{run}: no recovery.json or teacher_ppl.json to read the teacher's PPL from")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--order", default="copy,taylor-reference,taylor", help="column order of the inits")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    first = run_settings(args.runs[0])
    curves, teacher, calibs = {}, [], {}
    for run in args.runs:
        s = run_settings(run)
        diff = changed_settings(first, s, free=FREE)
        if diff:
            raise SystemExit(f"{run} differs from {args.runs[0]} in {', '.join(diff)}: not one experiment")
        for init, c in finished_curves(run, s).items():
            if init in curves:
                raise SystemExit(f"init {init} finished in more than one run; pass one of them")
            curves[init] = c
            calibs[init] = calib_of(run, init)
        teacher.append(teacher_ppl_of(run))
    conflicts = calib_conflicts(calibs)
    if conflicts:
        raise SystemExit("the inits were calibrated with different settings: " + " | ".join(conflicts))
    unknown = [i for i, c in calibs.items() if c is None and get_init(i).calibrated]
    if unknown:
        print(f"note: no recorded calibration settings for {', '.join(unknown)} (a run too old to record them): "
              "they could not be compared")
    if max(teacher) - min(teacher) > 1e-3 * max(teacher):
        raise SystemExit(f"the runs measured different teacher PPLs ({teacher}): not one evaluation")
    order = [i for i in args.order.split(",") if i in curves] + sorted(set(curves) - set(args.order.split(",")))
    curves = {i: curves[i] for i in order}
    table = target_table(curves, teacher[0])
    args.out.mkdir(parents=True, exist_ok=True)
    md = table_markdown(table)
    (args.out / "recovery.md").write_text(md)
    summary = {"teacher_ppl": teacher[0], "runs": [str(r) for r in args.runs], "inits": list(curves),
               "settings": {k: v for k, v in first.items() if k not in FREE}, "calib": calibs, "table": table,
               "curves": curves}
    (args.out / "recovery.json").write_text(json.dumps(summary, indent=1, default=str))
    plot_recovery(curves, teacher[0], args.out / "recovery.png", table=table,
                  title=f"{first['teacher']}, attention kept at {first['keep']} (merged runs)")
    print(md)


if __name__ == "__main__":
    main()
