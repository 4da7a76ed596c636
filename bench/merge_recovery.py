"""One recovery table from `tcal recover` runs made in separate device calls or sessions.

A device session has 30 minutes, so the inits of one recovery experiment may finish in different
runs. This script puts their curves into one table and plot, and refuses to do so unless every
setting that shapes training (data, order, schedule, budget, calibration, evaluation) is the same in
every run; only the init list and the settings a resume may change differ.

    python bench/merge_recovery.py RUN_DIR [RUN_DIR ...] --out DIR

A RUN_DIR is a finished or interrupted `tcal recover` output (or its archived results: settings in
``tcal_config.json`` or ``recover_config.json``, one ``INIT/curve.csv`` per init trained to the end).
Writes ``DIR/recovery.md``, ``recovery.json`` and ``recovery.png``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tcal.recipes.recover import RESUME_FREE
from tcal.report.plots import plot_recovery
from tcal.report.targets import table_markdown, target_table
from tcal.train.config import changed_settings
from tcal.train.curve import read_curve

FREE = set(RESUME_FREE) | {"inits", "stage", "overwrite"}


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
    curves, teacher = {}, []
    for run in args.runs:
        s = run_settings(run)
        diff = changed_settings(first, s, free=FREE)
        if diff:
            raise SystemExit(f"{run} differs from {args.runs[0]} in {', '.join(diff)}: not one experiment")
        for init, c in finished_curves(run, s).items():
            if init in curves:
                raise SystemExit(f"init {init} finished in more than one run; pass one of them")
            curves[init] = c
        teacher.append(teacher_ppl_of(run))
    if max(teacher) - min(teacher) > 1e-3 * max(teacher):
        raise SystemExit(f"the runs measured different teacher PPLs ({teacher}): not one evaluation")
    order = [i for i in args.order.split(",") if i in curves] + sorted(set(curves) - set(args.order.split(",")))
    curves = {i: curves[i] for i in order}
    table = target_table(curves, teacher[0])
    args.out.mkdir(parents=True, exist_ok=True)
    md = table_markdown(table)
    (args.out / "recovery.md").write_text(md)
    summary = {"teacher_ppl": teacher[0], "runs": [str(r) for r in args.runs], "inits": list(curves),
               "settings": {k: v for k, v in first.items() if k not in FREE}, "table": table,
               "curves": curves}
    (args.out / "recovery.json").write_text(json.dumps(summary, indent=1, default=str))
    plot_recovery(curves, teacher[0], args.out / "recovery.png", table=table,
                  title=f"{first['teacher']}, attention kept at {first['keep']} (merged runs)")
    print(md)


if __name__ == "__main__":
    main()
