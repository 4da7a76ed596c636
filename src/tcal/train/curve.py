"""The training curve as CSV: one row per evaluation point."""
from __future__ import annotations

import csv
import io
import math

CURVE_FIELDS = ("tokens", "step", "eval_ppl", "train_loss", "lr", "elapsed_s")


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else repr(v)
    return str(v)


def probe_fields(rows: list[dict]) -> list[str]:
    """The score columns beside the fixed ones (e.g. ``single@4096`` from ``--eval-passkey``), in first-seen order."""
    extra: dict[str, None] = {}
    for r in rows:
        extra.update((k, None) for k in r if k not in CURVE_FIELDS)
    return list(extra)


def curve_csv(rows: list[dict]) -> str:
    fields = [*CURVE_FIELDS, *probe_fields(rows)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(fields)
    for r in rows:
        w.writerow([_fmt(r.get(k, float("nan"))) for k in fields])
    return buf.getvalue()


def read_curve(path) -> list[dict]:
    """Rows of a ``curve.csv`` (ints for tokens/step, floats for the rest)."""
    with open(path, newline="") as f:
        return [
            {k: (int(v) if k in ("tokens", "step") else float(v)) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]




TIMING_FIELDS = ("tokens", "step", "point", "ppl")


def timing_csv(rows: list[dict]) -> str:
    """Where each curve point's time went (``timing.csv``): seconds of the whole point, of the held-out PPL, of each
    probe (HumanEval also as ``humaneval_generate`` and ``humaneval_score``), of the best-model and checkpoint writes
    after it, and the training since the point before (seconds, tokens/s)."""
    extra: dict[str, None] = {}
    for r in rows:
        extra.update((k, None) for k in r if k not in TIMING_FIELDS)
    fields = [*TIMING_FIELDS, *extra]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(fields)
    for r in rows:
        w.writerow(["" if r.get(k) is None else _fmt(r[k]) for k in fields])
    return buf.getvalue()
