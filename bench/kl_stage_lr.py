"""The KL stage's held-out KL by learning rate, from a converted hybrid: does the stage improve on what Phase 2 gave?

    python bench/kl_stage_lr.py runs/m16k --teacher qwen2.5-coder-0.5b --lrs 3e-5,1e-4 --steps 20 --out DIR

The hybrid is a ``tcal convert`` output whose KL stage kept its starting state (its report says "kept the state of step
0"), so its GDN layers are Phase 2's. For each learning rate the stage runs again from those layers on the same
calibration windows as the conversion (its recorded data, windows and window length; the last quarter held out, as
the conversion held it out), with the held-out KL every ``--eval-every`` steps and no early stop. Writes
DIR/kl_lr.json (every curve) and prints one line per rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tcal.conversion.convert import calibration_ids
from tcal.data.teachers import load_teacher
from tcal.taylor.kl_stage import kl_stage
from tcal.taylor.pipeline import split_calibration
from tcal.taylor.stage_config import AlignConfig, KLConfig
from tcal.train.checkpoint import load_model


def _recorded(cls, values: dict):
    """The stage config ``cls`` as the conversion's report recorded it (fields a newer config lacks are dropped)."""
    return cls(**{k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(cls)}})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("hybrid")
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--lrs", default="3e-5,1e-4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    report = json.loads((Path(args.hybrid) / "report.json").read_text())
    calib = report["calibration"]
    align, kl0 = _recorded(AlignConfig, calib["align"]), _recorded(KLConfig, calib["kl"])
    teacher, tok = load_teacher(args.teacher, device="cpu")
    ids = calibration_ids(calib["data"], tok, calib["tokens_per_sequence"], calib["sequences"])
    train_rows, held_rows = split_calibration(ids.shape[0], align.heldout_frac, align.heldout_max_sequences)
    train, held = ids[train_rows], ids[held_rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for lr in [float(x) for x in args.lrs.split(",") if x.strip()]:
        hybrid = load_model(args.hybrid)
        cfg = dataclasses.replace(kl0, steps=args.steps, lr=lr, eval_every=args.eval_every, patience=None,
                                  warmup_steps=args.warmup)
        t = time.time()
        rec = kl_stage(hybrid, teacher, train, held, cfg)
        row = {"lr": lr, "steps": args.steps, "warmup": args.warmup, "curve": rec["heldout_curve"],
               "best_step": rec["best_step"], "seconds": time.time() - t}
        rows.append(row)
        (out / "kl_lr.json").write_text(json.dumps({"hybrid": args.hybrid, "calibration": calib, "runs": rows},
                                                   indent=2))
        print(f"lr {lr:g}: held-out KL " + ", ".join(f"{s}: {k:.4f}" for s, k in rec["heldout_curve"]) +
              f"; best step {rec['best_step']}", flush=True)
        del hybrid


if __name__ == "__main__":
    main()
