"""Which layers each selection policy keeps, and the zero-shot PPL (and retrieval) of an init under each.

    python bench/select_policies.py --ks 8,15 --init taylor-exact-silent --out runs/select
    python bench/select_policies.py --ks 15 --policies uniform,ar,ga,niah --retrieval 512,1024,2048 --out runs/select

Policies: uniform, ar, ga, niah (tcal.conversion.select). --retrieval scores every (policy, K) student
on the single-needle task of tcal.evaluate.niah at those lengths (haystack sotu:eval, seed 0: the
evaluation prompts), while the niah policy picks layers on its own prompts (haystack sotu:calib, seed 1).

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
from tcal.conversion.surgery import build_hybrid
from tcal.conversion.select import (
    Selection,
    SelectionConfig,
    ar_scores,
    assemble,
    ga_scores,
    gdn_for_every_layer,
    niah_scores,
    validation_windows,
)
from tcal.data.teachers import load_teacher
from tcal.data.tokens import token_windows
from tcal.evaluate import window_ppl
from tcal.evaluate.niah import niah
from tcal.report.plots import plot_selection
from tcal.taylor.phase2 import AlignConfig
from tcal.utils.runtime import resolve_device


def ppl(model, windows):
    return window_ppl(model, windows, progress=False)


def student_hybrid(teacher, keep, modules):
    """The student as a real hybrid (its own config and cache layout, so generate() can run it): the
    teacher's weights, and ``modules``' GDN weights at every converted layer."""
    hybrid = build_hybrid(teacher, keep)
    for i, gdn in hybrid.gdn_modules().items():
        gdn.load_state_dict(modules[i].state_dict())
    return hybrid.eval()


def cached(out: Path, key: dict, name: str, compute):
    """Scores of an earlier run with the same settings (OUT/scores.json), or ``compute()`` saved there."""
    f = out / "scores.json"
    saved = json.loads(f.read_text()) if f.is_file() else {}
    if saved.get("key") != key:
        saved = {"key": key}
    if name not in saved:
        saved[name] = compute()
        f.write_text(json.dumps(saved))
    return saved[name]


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
    p.add_argument("--policies", default="uniform,ar,ga", help="comma list of uniform, ar, ga, niah")
    p.add_argument("--retrieval", default="", help="also score single-needle retrieval at these lengths")
    p.add_argument("--retrieval-samples", type=int, default=8)
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

    key = {k: getattr(args, k) for k in ("teacher", "init", "calib", "calib_window", "calib_windows", "align_steps",
                                         "val_windows")}
    t0 = time.perf_counter()
    ar = cached(out, key, "ar", lambda: ar_scores(teacher, val))
    timings["ar_scores_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kw = {} if not get_init(args.init).calibrated else {
        "calib_ids": calib, "align": AlignConfig(steps=args.align_steps), "progress": True}
    modules = gdn_for_every_layer(teacher, args.init, **kw)
    timings["init_every_layer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ga = cached(out, key, "ga", lambda: ga_scores(teacher, val, modules))
    timings["ga_scores_s"] = time.perf_counter() - t0
    policies = [x for x in args.policies.split(",") if x]
    nh = None
    if "niah" in policies:
        t0 = time.perf_counter()
        nh = cached(out, key, "niah", lambda: niah_scores(teacher, tok, scfg))
        timings["niah_scores_s"] = time.perf_counter() - t0
    teacher_ppl = ppl(teacher, heldout)
    lengths = [int(x) for x in args.retrieval.split(",") if x]

    def retrieval(model):
        if not lengths:
            return None
        t0 = time.perf_counter()
        acc = niah(model, tok, lengths, samples=args.retrieval_samples, seed=0, task="single", haystack="sotu:eval")
        timings["retrieval_s"] = timings.get("retrieval_s", 0.0) + time.perf_counter() - t0
        return {str(n): a for n, a in acc.items()}

    teacher_retrieval = retrieval(teacher)
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        picks = {"uniform": uniform_layers(k, L), "ar": top_k(ar, k, largest=True), "ga": top_k(ga, k, largest=False)}
        if nh is not None:
            picks["niah"] = top_k(nh, k, largest=True)
        for policy in policies:
            keep = picks[policy]
            with assemble(teacher, keep, modules) as student:
                value = ppl(student, heldout)
            acc = retrieval(student_hybrid(teacher, keep, modules)) if lengths else None
            rows.append({"K": k, "policy": policy, "layers": keep, "ppl": value, "retrieval": acc})
            print(json.dumps(rows[-1]), flush=True)
    for name, scores in (("ar", ar), ("ga", ga)):
        sel = Selection(name, top_k(scores, int(args.ks.split(",")[0]), largest=(name == "ar")), scores,
                        "ppl_with_layer_attention_removed" if name == "ar" else "ppl_keeping_only_this_layer")
        plot_selection(sel, out / f"scores_{name}.png", teacher_ppl)
    result = {"teacher": args.teacher, "teacher_ppl": teacher_ppl, "teacher_retrieval": teacher_retrieval,
              "init": args.init, "ar_scores": ar, "ga_scores": ga, "niah_scores": nh, "rows": rows,
              "timings": timings, "device": args.device, "args": vars(args)}
    (out / "select.json").write_text(json.dumps(result, indent=2))
    lines = [f"teacher {args.teacher}, init {args.init}, held-out PPL on {args.eval} "
             f"({args.eval_windows} x 512; teacher {teacher_ppl:.2f})", ""]
    head = "| K | policy | layers kept as attention | held-out PPL |"
    rule = "|---|---|---|---:|"
    if lengths:
        head += "".join(f" passkey @ {n} |" for n in lengths)
        rule += "---:|" * len(lengths)
        lines += [f"passkey: single needle, {args.retrieval_samples} prompts per length, haystack sotu:eval; "
                  "teacher " + ", ".join(f"{n}: {a:.2f}" for n, a in teacher_retrieval.items()), ""]
    lines += [head, rule]
    for r in rows:
        cells = "".join(f" {r['retrieval'][str(n)]:.2f} |" for n in lengths) if lengths else ""
        lines.append(f"| {r['K']} | {r['policy']} | {','.join(map(str, r['layers']))} | {r['ppl']:.2f} |{cells}")
    lines += ["", "selection wall time: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
              + f" ({args.device})"]
    (out / "select.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
