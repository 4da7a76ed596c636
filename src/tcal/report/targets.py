"""Recovery targets: when a distillation curve first reaches a PPL, and how many times fewer tokens
one init needs than the baseline.

Tokens to a target: the first evaluation point at or below the target PPL. A target never
reached is reported as ``> N`` (N = the tokens the run trained on), never extrapolated. Where
reached, a linear interpolation (in PPL, between the two evaluation points that bracket the
target) is given as well, labelled as such.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from tcal.utils.errors import TcalError

TARGET_FACTORS = (1.1, 1.2, 1.5, 2.0)


BASELINE = "copy"


def curve_points(curve) -> list[tuple[int, float]]:
    pts = []
    for r in curve:
        t, p = (r["tokens"], r["eval_ppl"]) if isinstance(r, dict) else r
        pts.append((int(t), float(p)))
    return sorted(pts)


def tokens_to_target(curve, target: float) -> dict:
    """When a curve (rows with ``tokens``/``eval_ppl``, or (tokens, ppl) pairs) first reaches ``target``.

    Returns ``reached``, ``tokens`` (first evaluation point with PPL <= target, else None),
    ``interp`` (linear interpolation in PPL between the bracketing points; equals ``tokens``
    when the first point already qualifies), ``budget`` (last evaluated tokens) and ``display``
    (``"1,234"`` or ``"> N"``).
    """
    pts = curve_points(curve)
    if not pts:
        raise TcalError("empty curve")
    budget = pts[-1][0]
    prev = None
    for t, p in pts:
        if p <= target:
            interp = float(t)
            if prev is not None and math.isfinite(prev[1]) and prev[1] > p:
                t0, p0 = prev
                interp = t0 + (p0 - target) / (p0 - p) * (t - t0)
            return {"reached": True, "tokens": t, "interp": interp, "budget": budget, "display": f"{t:,}"}
        prev = (t, p)
    return {"reached": False, "tokens": None, "interp": None, "budget": budget, "display": f"> {budget:,}"}


def _ratio(base: dict, other: dict) -> dict:
    """copy tokens / init tokens, with bounds where a run never reached the target."""
    if base["reached"] and other["reached"]:
        if other["tokens"] == 0:
            return {"value": None if base["tokens"] == 0 else math.inf, "bound": "=",
                    "display": "n/a (both at 0)" if base["tokens"] == 0 else "inf (reached before training)"}
        v = base["tokens"] / other["tokens"]
        return {"value": v, "bound": "=", "display": f"{v:.2f}x"}
    if not base["reached"] and other["reached"]:
        if other["tokens"] == 0:
            return {"value": math.inf, "bound": "=", "display": "inf (reached before training)"}
        v = base["budget"] / other["tokens"]
        return {"value": v, "bound": ">", "display": f"> {v:.2f}x"}
    if base["reached"] and not other["reached"]:
        v = base["tokens"] / other["budget"] if other["budget"] else math.inf
        return {"value": v, "bound": "<", "display": f"< {v:.2f}x"}
    return {"value": None, "bound": None, "display": "n/a (neither reached)"}


def target_table(curves: dict, teacher_ppl: float, *, baseline: str = BASELINE,
                 factors: Sequence[float] = TARGET_FACTORS) -> dict:
    """Tokens each run needs to reach each target, and the ratio baseline / run.

    ``curves``: ``{init: curve}`` (see :func:`tokens_to_target`). Targets: ``f x teacher_ppl``
    for each factor, and the baseline run's final PPL when the baseline is among the curves.
    Returns ``{"teacher_ppl", "baseline", "inits", "targets": [{"name", "ppl", "runs": {init:
    tokens_to_target}, "ratio": {init: {"value", "bound", "display"}}}]}``.
    """
    if not curves:
        raise TcalError("no curves to tabulate")
    targets = [(f"{f:g}x teacher PPL", f * teacher_ppl) for f in factors]
    if baseline in curves:
        final = curve_points(curves[baseline])[-1][1]
        targets.append((f"{baseline} final PPL", final))
    rows = []
    for name, ppl in targets:
        runs = {init: tokens_to_target(c, ppl) for init, c in curves.items()}
        ratio = {}
        if baseline in runs:
            ratio = {init: _ratio(runs[baseline], r) for init, r in runs.items() if init != baseline}
        rows.append({"name": name, "ppl": ppl, "runs": runs, "ratio": ratio})
    return {"teacher_ppl": teacher_ppl, "baseline": baseline, "inits": list(curves), "targets": rows}


def table_markdown(table: dict) -> str:
    inits = table["inits"]
    base = table["baseline"]
    others = [i for i in inits if i != base] if base in inits else []
    head = ["target", "PPL"] + [f"{i}: tokens" for i in inits] + [f"{base}/{i}" for i in others]
    head += [f"{i}: interp." for i in inits]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["targets"]:
        cells = [row["name"], f"{row['ppl']:.2f}"]
        cells += [row["runs"][i]["display"] for i in inits]
        cells += [row["ratio"][i]["display"] for i in others]
        cells += [f"{row['runs'][i]['interp']:,.0f}" if row["runs"][i]["reached"] else "-" for i in inits]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Teacher PPL {table['teacher_ppl']:.3f}. \"tokens\": the first evaluation point at or below the target "
        "(\"> N\": not reached within the N tokens trained; never extrapolated). "
        f"\"{base}/init\": {base}'s tokens divided by the init's (\"> r\" / \"< r\": bounds where one run did not "
        "reach the target). \"interp.\": linear interpolation in PPL between the two evaluation points that "
        "bracket the target (an estimate, not a measured point).",
    ]
    return "\n".join(lines) + "\n"




SCORE_FRACTIONS = (0.8, 0.9)


def tokens_to_score(curve, name: str, target: float) -> dict:
    """When a curve first reaches a score ``name`` (higher is better, e.g. ``humaneval`` pass@1) of at least
    ``target``: ``reached``, ``tokens`` (the first evaluation point at or above it), ``budget``, ``display``."""
    pts = sorted((int(r["tokens"]), float(r[name])) for r in curve if isinstance(r.get(name), (int, float)))
    if not pts:
        raise TcalError(f"the curve has no {name!r} score at any point")
    budget = pts[-1][0]
    for t, v in pts:
        if v >= target - 1e-12:
            return {"reached": True, "tokens": t, "budget": budget, "display": f"{t:,}"}
    return {"reached": False, "tokens": None, "budget": budget, "display": f"> {budget:,}"}


def score_table(curves: dict, name: str, teacher_score: float, *, baseline: str = BASELINE,
                fractions: Sequence[float] = SCORE_FRACTIONS) -> dict:
    """Tokens each run needs to reach each fraction of the teacher's score ``name`` (pass@1), with the ratio
    baseline / run, and each run's best and last score: ``{"name", "teacher", "inits", "targets": [...], "runs":
    {init: {"first", "best", "last"}}}``."""
    rows = []
    for f in fractions:
        target = f * teacher_score
        runs = {init: tokens_to_score(c, name, target) for init, c in curves.items()}
        ratio = ({init: _ratio(runs[baseline], r) for init, r in runs.items() if init != baseline}
                 if baseline in runs else {})
        rows.append({"name": f"{f:.0%} of the teacher's {name}", "target": target, "runs": runs, "ratio": ratio})
    summary = {}
    for init, c in curves.items():
        vals = [(int(r["tokens"]), float(r[name])) for r in c if isinstance(r.get(name), (int, float))]
        summary[init] = {"first": vals[0][1], "best": max(v for _, v in vals), "last": vals[-1][1]}
    return {"name": name, "teacher": teacher_score, "baseline": baseline, "inits": list(curves), "targets": rows,
            "runs": summary}


def score_table_markdown(table: dict) -> str:
    inits, base, name = table["inits"], table["baseline"], table["name"]
    others = [i for i in inits if i != base] if base in inits else []
    head = ["target", name] + [f"{i}: tokens" for i in inits] + [f"{base}/{i}" for i in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["targets"]:
        cells = [row["name"], f"{row['target']:.3f}"] + [row["runs"][i]["display"] for i in inits]
        cells += [row["ratio"][i]["display"] for i in others]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| init | " + name + " before | best | last |", "|---|---:|---:|---:|"]
    lines += [f"| {i} | {r['first']:.3f} | {r['best']:.3f} | {r['last']:.3f} |" for i, r in table["runs"].items()]
    lines += ["", f"Teacher {name} {table['teacher']:.3f}. \"tokens\": the first evaluation point at or above the "
              "target (\"> N\": not reached within the N tokens trained)."]
    return "\n".join(lines) + "\n"
