"""Which layers each selection policy keeps, and the zero-shot PPL of an init under each policy.

    python bench/select_policies.py --ks 8,15 --init taylor --out runs/select

Phase 2 is teacher-forced and layer-local, so every layer's GDN is initialised once (the same
modules GA scores with) and each policy's student is assembled from them: the whole table costs
L layer calibrations + 2L validation evaluations + one held-out evaluation per (policy, K).

Data: calibration = the first --calib-windows x --calib-window tokens of --calib; the ar/ga
validation slice = --val-windows windows of --calib after its first 64 x 512 tokens; held-out
PPL = the first --eval-windows x 512 of --eval (disjoint from both).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tcal.conversion.convert import calibration_ids
from tcal.conversion.inits import get_init
from tcal.conversion.policy import top_k, uniform_layers
from tcal.conversion.select import (
    Selection,
    SelectionConfig,
    ar_scores,
    assemble,
    ga_scores,
    gdn_for_every_layer,
    validation_windows,
)
from tcal.data.teachers import load_teacher
from tcal.data.tokens import token_windows
from tcal.evaluate import window_ppl
from tcal.report.plots import plot_selection
from tcal.taylor.phase2 import AlignConfig
from tcal.utils.runtime import resolve_device


def ppl(model, windows):
    return window_ppl(model, windows, progress=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--ks", default="8,15")
    p.add_argument("--init", default="taylor")
    p.add_argument("--calib", default="wiki:calib")
    p.add_argument("--calib-window", type=int, default=256)
    p.add_argument("--calib-windows", type=int, default=4)
    p.add_argument("--align-steps", type=int, default=300)
    p.add_argument("--val-windows", type=int, default=8)
    p.add_argument("--eval", default="wiki:eval")
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--out", default="runs/select")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)  # recorded in select.json as the device that ran
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    teacher, tok = load_teacher(args.teacher, device=args.device)
    L = teacher.config.num_hidden_layers
    scfg = SelectionConfig(data=args.calib, val_windows=args.val_windows)
    val = validation_windows(tok, scfg)
    heldout = token_windows(args.eval, tok, window=512, n_windows=args.eval_windows)
    calib = calibration_ids(args.calib, tok, args.calib_window, args.calib_windows)
    timings = {}

    t0 = time.perf_counter()
    ar = ar_scores(teacher, val)
    timings["ar_scores_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kw = {} if not get_init(args.init).calibrated else {
        "calib_ids": calib, "align": AlignConfig(steps=args.align_steps), "progress": True}
    modules = gdn_for_every_layer(teacher, args.init, **kw)
    timings["init_every_layer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ga = ga_scores(teacher, val, modules)
    timings["ga_scores_s"] = time.perf_counter() - t0
    teacher_ppl = ppl(teacher, heldout)

    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        picks = {"uniform": uniform_layers(k, L), "ar": top_k(ar, k, largest=True), "ga": top_k(ga, k, largest=False)}
        for policy, keep in picks.items():
            with assemble(teacher, keep, modules) as student:
                value = ppl(student, heldout)
            rows.append({"K": k, "policy": policy, "layers": keep, "ppl": value})
            print(json.dumps(rows[-1]), flush=True)
    for name, scores in (("ar", ar), ("ga", ga)):
        sel = Selection(name, top_k(scores, int(args.ks.split(",")[0]), largest=(name == "ar")), scores,
                        "ppl_with_layer_attention_removed" if name == "ar" else "ppl_keeping_only_this_layer")
        plot_selection(sel, out / f"scores_{name}.png", teacher_ppl)
    result = {"teacher": args.teacher, "teacher_ppl": teacher_ppl, "init": args.init, "ar_scores": ar,
              "ga_scores": ga, "rows": rows, "timings": timings, "device": args.device, "args": vars(args)}
    (out / "select.json").write_text(json.dumps(result, indent=2))
    lines = [f"teacher {args.teacher}, init {args.init}, held-out PPL on {args.eval} "
             f"({args.eval_windows} x 512; teacher {teacher_ppl:.2f})", "",
             "| K | policy | layers kept as attention | held-out PPL |", "|---|---|---|---:|"]
    lines += [f"| {r['K']} | {r['policy']} | {','.join(map(str, r['layers']))} | {r['ppl']:.2f} |" for r in rows]
    lines += ["", "selection wall time: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
              + f" ({args.device})"]
    (out / "select.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
