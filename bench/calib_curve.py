"""Zero-shot held-out PPL against calibration tokens, per init, from the rows of `calib_sweep.py run`.

    python bench/calib_curve.py bench/results/2026-12-03-calibration-budget/sweep_*.jsonl --keep 50 --calib mix --out DIR

Writes DIR/calib_curve.png (one panel per evaluation domain) and DIR/calib_curve.md (the points, with each
conversion's wall time and the file it came from). Per (init, budget) it takes the row whose KL stage ran the
most steps (a later file wins a tie): the curve shows what each budget gives with the longest stage measured.
Every file must carry the same teacher PPL (the same evaluation windows), or the points would not compare.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from calib_sweep import BUDGETS

from tcal.report.plots import plot_calib_budget

# Rows name their init as the registry does (tcal.conversion.inits), with ", ALIGN" for another Phase-2 fit. Older
# sweep files used short names of their own: those -> the names a user types (tcal.conversion.inits)
NAMES = {"tes-kl": "taylor", "tes": "taylor-exact-silent", "p2-kl": "phase2 + KL stage",
         "tes-seq": "taylor-exact-silent, sequential", "tes-res": "taylor-exact-silent, residual",
         "p2-seq": "phase2, sequential", "tes-seq-kl": "taylor, sequential"}


def init_label(row: dict) -> str:
    name = NAMES.get(row["method"], row["method"])
    return f"{name}, {row['align']}" if row.get("align") else name


def budget_tokens(row: dict) -> int:
    if row.get("tokens"):
        return int(row["tokens"])
    n, w = BUDGETS[row["budget"]]
    return n * w


def kl_steps_run(row: dict) -> int:
    return int((row.get("kl") or {}).get("steps_run", 0))


def pick_points(files: list[tuple[str, list[dict]]], keep: str, calib: str) -> tuple[dict, dict]:
    """(teacher {domain: ppl}, {init: {tokens: (row, file)}}) over the rows of ``files`` = [(name, rows)]."""
    teacher: dict | None = None
    points: dict[str, dict[int, tuple[dict, str]]] = {}
    for name, rows in files:
        for r in rows:
            if r.get("method") == "teacher":
                if teacher is None:
                    teacher = r["ppl"]
                elif any(not math.isclose(teacher[d], r["ppl"].get(d, math.nan), rel_tol=1e-4) for d in teacher):
                    raise SystemExit(f"{name}: its teacher PPL {r['ppl']} differs from {teacher}: other evaluation "
                                     "windows; plot those files apart")
                continue
            if r.get("error") or not r.get("ppl") or r.get("keep") != keep or r.get("calib") != calib:
                continue
            init = init_label(r)
            t = budget_tokens(r)
            old = points.setdefault(init, {}).get(t)
            if old is None or kl_steps_run(r) >= kl_steps_run(old[0]):
                points[init][t] = (r, name)
    if teacher is None:
        raise SystemExit("no teacher row in the files (calib_sweep.py writes one per run)")
    return teacher, points


def markdown(teacher: dict, points: dict) -> str:
    doms = list(teacher)
    lines = ["| calibration tokens | init | KL steps run | " + " | ".join(doms) + " | conversion | file |",
             "|---:|---|---:|" + "---:|" * len(doms) + "---:|---|"]
    lines.append("| | teacher | | " + " | ".join(f"{teacher[d]:.2f}" for d in doms) + " | | |")
    for t in sorted({t for p in points.values() for t in p}):
        for init, p in points.items():
            if t not in p:
                continue
            r, name = p[t]
            cells = " | ".join(f"{r['ppl'][d]:.2f} ({r['ppl'][d] / teacher[d]:.2f}x)" for d in doms)
            conv = f"{r['convert_s']:.0f} s" if r.get("convert_s") else ""
            lines.append(f"| {t:,} | {init} | {kl_steps_run(r) or ''} | {cells} | {conv} | {name} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="sweep .jsonl files")
    p.add_argument("--keep", default="50", help="the sweep's keep name (50, 73, niah15, ...)")
    p.add_argument("--calib", default="mix", help="the sweep's calibration name (mix, wiki)")
    p.add_argument("--inits", default="phase2,taylor", help="inits to draw (comma list; the table lists all)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    files = [(f, [json.loads(line) for line in open(f) if line.strip()]) for f in args.files]
    teacher, points = pick_points(files, args.keep, args.calib)
    if not points:
        raise SystemExit(f"no rows with keep {args.keep} and calibration {args.calib}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    want = args.inits.split(",")
    series = {i: [(t, r["ppl"]) for t, (r, _) in sorted(points[i].items())] for i in want if i in points}
    plot_calib_budget(series, teacher, out / "calib_curve.png",
                      title=f"zero-shot PPL against calibration tokens (keep {args.keep}, calibration {args.calib})")
    (out / "calib_curve.md").write_text(markdown(teacher, points))
    print((out / "calib_curve.md").read_text())
    print("wrote", out / "calib_curve.png")


if __name__ == "__main__":
    main()
