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


def curve_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CURVE_FIELDS)
    for r in rows:
        w.writerow([_fmt(r[k]) for k in CURVE_FIELDS])
    return buf.getvalue()


def read_curve(path) -> list[dict]:
    """Rows of a ``curve.csv`` (ints for tokens/step, floats for the rest)."""
    with open(path, newline="") as f:
        return [
            {k: (int(v) if k in ("tokens", "step") else float(v)) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


