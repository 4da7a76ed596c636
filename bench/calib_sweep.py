"""Taylor-Calibrate method and budget sweep on the real teacher: which init (the registry's names,
tcal.conversion.inits) and which Phase-2 fit (layer-local, sequential, residual-stream target), how many
calibration tokens, which calibration text, at 50 % and 73 % converted, each scored on three held-out domains.

Two steps, because the GPU machine reaches no registry and has no tokenizer cache:

  here:    python bench/calib_sweep.py tokens --out .dev/sweep          (token ids as .npy, ~10 MB)
  device:  python bench/calib_sweep.py run --tokens .dev/sweep --jobs methods --worker 0 --workers 6 \
               --out $OUT/methods.jsonl      (one process per worker, each taking every 6th job)

Data roles: calibration from ``*:calib`` splits only (``wiki`` = wiki:calib; ``mix`` = wiki:calib
+ shakespeare:calib interleaved, none of it in the default training pool); evaluation the first 32 x 512 tokens of
``wiki:eval``, ``shakespeare:eval`` and ``sotu:eval``, used for nothing else.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

CALIB = {"wiki": "wiki:calib", "mix": "wiki:calib+shakespeare:calib"}
EVAL = ("wiki:eval", "shakespeare:eval", "sotu:eval")
EVAL_WINDOWS, EVAL_WINDOW = 32, 512
BUDGETS = {"1k": (4, 256), "4k": (8, 512), "16k": (32, 512), "64k": (128, 512), "256k": (512, 512),
           "1m": (2048, 512), "256k-2k": (128, 2048), "256k-4k": (64, 4096)}
# tokens per Phase 2 / KL-stage step at 512-token windows; longer windows take fewer of them per step
ALIGN_TOKENS, KL_TOKENS = 16 * 512, 8 * 512
# niah15: the 15 layers whose attention carries retrieval on the teacher (`tcal convert --keep niah:15`,
# scored on sotu:calib prompts; docs/results.md, *Layer selection*)
KEEP = {"50": list(range(0, 30, 2)), "73": list(range(0, 30, 4)),
        "niah15": [0, 1, 2, 8, 15, 16, 18, 19, 20, 21, 23, 24, 27, 28, 29],
        # niah15 with layer 7 kept instead of 27: the layer whose attention the CPU niah15 hybrid's retrieval needed
        # most at 2K (bench/results/2026-12-02-retrieval-layer-revert/)
        "niah15-7": [0, 1, 2, 7, 8, 15, 16, 18, 19, 20, 21, 23, 24, 28, 29],
        # and layer 4 for 28: the layer the same revert test found the layer-7 set's retrieval needed most (CPU: 2.5 % lower
        # PPL, passkey within noise; bench/results/2026-12-02-retrieval-layer-revert/swap-4-for-28/)
        "niah15-7-4": [0, 1, 2, 4, 7, 8, 15, 16, 18, 19, 20, 21, 23, 24, 29]}
BUILTIN_KEEPS = tuple(KEEP)  # `run --keep-file NAME=FILE` adds a set made on the machine (`tcal convert --keep niah:K`'s selection.json)

# (init, Phase-2 fit): an init of the registry as registered (None), or with its Phase 2 fitting the layers
# another way (InitSpec.align). Phase 2 + KL stage alone is no init of the registry and no job here.
METHODS = [("phase2", None), ("taylor-reference", None), ("taylor-exact-silent", None),
           ("taylor-exact-silent", "sequential"), ("taylor-exact-silent", "residual"), ("phase2", "sequential"),
           ("taylor", None), ("taylor", "sequential")]


def jobs_of(methods, **job) -> list[dict]:
    """One job per (init, Phase-2 fit) of ``methods``; ``job`` the rest of each (keep, calib, budget...)."""
    return [{**job, "method": init, **({"align": align} if align else {})} for init, align in methods]


def job_sets() -> dict[str, list[dict]]:
    """Named job lists; a worker takes every n-th job, so the long ones come first."""
    methods16 = [j for k in ("73", "50") for j in jobs_of(METHODS, keep=k, calib="wiki", budget="16k")]
    methods1 = [j for k in ("73", "50") for j in jobs_of(METHODS, keep=k, calib="wiki", budget="1k")]
    mix = jobs_of([("phase2", None), ("taylor-exact-silent", None), ("taylor-exact-silent", "sequential"),
                   ("taylor", "sequential")], keep="50", calib="mix", budget="16k")
    curve = [j for b in ("1m", "256k", "64k", "4k", "1k")
             for j in jobs_of([("phase2", None), ("taylor-exact-silent", "sequential"), ("taylor", "sequential")],
                              keep="50", calib="mix", budget=b)]
    # every combination, largest budgets first; pick a slice with --methods/--aligns/--keeps/--budgets/--calibs
    grid = [j for b in reversed(BUDGETS) for k in KEEP for c in CALIB
            for j in jobs_of(METHODS, keep=k, calib=c, budget=b)]
    # the long KL stage at the GPU budget: both ratios and the retrieval layers; phase2 at 73 % to compare with
    long_kl = [dict(keep=k, method="taylor", calib="mix", budget="256k", kl_steps=300) for k in ("50", "niah15", "73")]
    long_kl.append(dict(keep="73", method="phase2", calib="mix", budget="256k"))
    # twice the KL steps at 256K, then the 1M-token end of the curve (phase2 and taylor)
    longer_kl = [dict(keep="50", method="taylor", calib="mix", budget=b, kl_steps=600) for b in ("256k", "1m")]
    longer_kl.append(dict(keep="50", method="phase2", calib="mix", budget="1m"))
    # the 1M-token point with the KL stage's steps scaled with the data (600 steps read 2.4 epochs of 1M tokens)
    kl_1m = [dict(keep="50", method="taylor", calib="mix", budget="1m", kl_steps=1200)]
    # retrieval beyond the calibration length: the same 256K tokens in 2K-token windows (the quality step's
    # passkey then says whether the GDN layers keep up with the kept attention beyond 1K)
    long_window = [dict(keep=k, method="taylor", calib="mix", budget="256k-2k", kl_steps=300) for k in ("niah15", "50")]
    # the same 256K tokens in 4K-token windows, the longest passkey length tested (the teacher's context is 8K)
    long_window4k = [dict(keep=k, method="taylor", calib="mix", budget="256k-4k", kl_steps=300)
                     for k in ("niah15", "50", "niah15-7", "niah15-7-4") + tuple(k for k in KEEP if k not in BUILTIN_KEEPS)]
    # 73 % converted at the GPU budget: taylor (300 KL steps) against phase2 on the same tokens
    ratio73 = [dict(keep="73", method="taylor", calib="mix", budget="256k", kl_steps=300),
               dict(keep="73", method="phase2", calib="mix", budget="256k")]
    return {"grid": grid, "methods16": methods16, "long-kl": long_kl, "longer-kl": longer_kl, "kl-1m": kl_1m,
            "long-window": long_window, "long-window-4k": long_window4k, "ratio73": ratio73,
            "mix": mix, "methods1": methods1, "curve": curve,
            "smoke": jobs_of([("taylor", "sequential")], keep="50", calib="wiki", budget="1k")}


def tokens_step(args) -> None:
    import numpy as np

    from tcal.data.teachers import load_teacher
    from tcal.data.tokens import mixed_windows, token_windows

    _, tok = load_teacher("smollm2-135m", device="cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cname, spec in CALIB.items():
        for bname, (n, w) in BUDGETS.items():
            try:
                ids = mixed_windows(spec, tok, window=w, n_windows=n)
            except Exception as e:  # the corpus is too small for this budget: recorded, not faked
                print(f"skip {cname} {bname}: {e}")
                continue
            np.save(out / f"calib-{cname}-{bname}.npy", ids.numpy().astype(np.int32))
    for spec in EVAL:
        ids = token_windows(spec, tok, window=EVAL_WINDOW, n_windows=EVAL_WINDOWS)
        np.save(out / f"eval-{spec.replace(':', '_')}.npy", ids.numpy().astype(np.int32))
    print("wrote", sorted(p.name for p in out.iterdir()))


def align_for(budget: str, steps: int):
    from tcal.taylor.stage_config import AlignConfig

    n, w = BUDGETS[budget]
    if budget == "1k":  # the reference protocol: full-batch steps, held-out check every step
        return AlignConfig(steps=steps)
    return AlignConfig(steps=steps, batch_size=min(max(1, ALIGN_TOKENS // w), n), eval_every=5, schedule="cosine",
                       warmup_steps=10)


def kl_steps_run(job: dict, kl_steps: int, kl_steps_all: int | None = None) -> int:
    """The KL stage's steps for ``job``: --kl-steps-all over the job's own, the job's over --kl-steps."""
    return job.get("kl_steps", kl_steps) if kl_steps_all is None else kl_steps_all


def init_spec(job: dict):
    """The job's init: the registry's, with the job's Phase-2 fit if it names one."""
    from tcal.conversion.inits import get_init

    spec = get_init(job["method"])
    align = job.get("align")
    return dataclasses.replace(spec, name=f"{spec.name}-{align}", align=align) if align else spec


def job_name(job: dict, kl_steps: int, kl_steps_all: int | None = None) -> str:
    # with the steps the KL stage ran: under --kl-steps-all those, not the job's own
    kl = f"-kl{kl_steps_run(job, kl_steps, kl_steps_all)}" if init_spec(job).kl else ""
    recall = f"-recall{round(100 * job['kl_recall'])}" if kl and job.get("kl_recall") else ""
    return f"{job['keep']}-{init_spec(job).name}-{job['calib']}-{job['budget']}{kl}{recall}"


def run_job(job: dict, teacher, tokens: Path, evals: dict, device: str, steps: int = 300, kl_steps: int = 100,
            save: Path | None = None, tokenizer=None, kl_steps_all: int | None = None, kl_patience: int = 4) -> dict:
    import numpy as np
    import torch

    from tcal.conversion.convert import convert_with_record
    from tcal.evaluate.likelihood import window_ppl
    from tcal.taylor.pipeline import prepare
    from tcal.taylor.stage_config import KLConfig

    spec = init_spec(job)
    path = tokens / f"calib-{job['calib']}-{job['budget']}.npy"
    if not path.exists():
        return {**job, "error": f"no calibration tokens {path.name}"}
    ids = torch.from_numpy(np.load(path).astype(np.int64))
    keep = KEEP[job["keep"]]
    gdn = [i for i in range(teacher.config.num_hidden_layers) if i not in keep]
    align = align_for(job["budget"], steps)
    t0 = time.perf_counter()
    cal = prepare(teacher, ids, gdn, heldout_frac=align.heldout_frac, max_heldout=align.heldout_max_sequences,
                  statistics=spec.phase1 is not None, device=device)
    prep_s = time.perf_counter() - t0
    kl_batch = 3 if job["budget"] == "1k" else max(1, KL_TOKENS // BUDGETS[job["budget"]][1])
    kl_cfg = KLConfig(steps=kl_steps_run(job, kl_steps, kl_steps_all),
                      batch_size=kl_batch, eval_every=5, patience=kl_patience, recall_frac=job.get("kl_recall", 0.0))
    # progress bars go to the worker's log: a call cut off by its time limit still shows how far each job got
    conv = convert_with_record(teacher, keep, spec, calib_ids=cal, align=align, kl=kl_cfg if spec.kl else None,
                               progress=True)
    convert_s = time.perf_counter() - t0
    ppl = {spec: window_ppl(conv.hybrid, ids_e, progress=False) for spec, ids_e in evals.items()}
    detail = conv.record["detail"]
    p2 = detail.get("phase2", {})
    label = job_name(job, kl_steps, kl_steps_all)
    if save is not None:  # the quality suite and the distillation runs read it later
        from tcal.train.checkpoint import save_model

        save_model(conv.hybrid, save / label)
        if tokenizer is not None:
            tokenizer.save_pretrained(save / label)
    return {**job, "name": label, "tokens": int(ids.numel()), "ppl": ppl, "prepare_s": prep_s, "convert_s": convert_s,
            "phase1_s": sum(r.get("wall_s", 0) for r in (detail.get("phase1") or {}).values()),
            "phase2_s": sum(r["wall_s"] for r in p2.values()),
            "phase2_groups": sorted({tuple(r.get("group", [r["layer"]])) for r in p2.values()}),
            "lazy_teacher_passes": cal.passes,
            "heldout_cos": sum(r["heldout_cos"] for r in p2.values()) / max(1, len(p2)),
            "kl": {k: detail["kl"][k] for k in ("heldout_kl_before", "heldout_kl", "best_step", "steps_run", "wall_s")}
            if "kl" in detail else None}


def run_step(args) -> None:
    import numpy as np
    import torch

    from tcal.data.teachers import load_teacher
    from tcal.evaluate.likelihood import window_ppl

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, args.workers)))
    device = args.device
    for spec in args.keep_file:
        name, _, path = spec.partition("=")
        KEEP[name] = [int(x) for x in Path(path).read_text().split(",")]
        print(f"keep {name}: {KEEP[name]}")
    jobs = [j for s in args.jobs.split(",") for j in job_sets()[s]]
    for key in ("method", "align", "keep", "budget", "calib"):
        want = getattr(args, key + "s")
        if want:
            jobs = [j for j in jobs if j.get(key, "local") in want.split(",")]
    if args.small_first:
        order = list(BUDGETS)
        jobs = sorted(jobs, key=lambda j: order.index(j["budget"]))
    jobs = jobs[args.worker :: args.workers]
    if args.kl_recall_frac:  # the KL stage's recall mix (KLConfig.recall_frac) for every job; its name says so
        jobs = [{**j, "kl_recall": args.kl_recall_frac} for j in jobs]
    tokens = Path(args.tokens)
    teacher, tok = load_teacher("smollm2-135m", device=device)
    evals = {spec: torch.from_numpy(np.load(tokens / f"eval-{spec.replace(':', '_')}.npy").astype(np.int64))
             [: args.eval_windows] for spec in EVAL}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.worker == 0:
        row = {"method": "teacher", "ppl": {s: window_ppl(teacher, e, progress=False) for s, e in evals.items()}}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    start = time.perf_counter()
    for job in jobs:
        if args.deadline_min and time.perf_counter() - start > 60 * args.deadline_min:
            print("deadline: not started", json.dumps(job), flush=True)
            continue
        t0 = time.perf_counter()
        print(f"start {job_name(job, args.kl_steps, args.kl_steps_all)} at {t0 - start:.0f} s", flush=True)
        try:
            row = run_job(job, teacher, tokens, evals, device, args.steps, args.kl_steps,
                          Path(args.save) if args.save else None, tok, args.kl_steps_all, args.kl_patience)
        except Exception as e:  # one failed job must not lose the others' results
            row = {**job, "error": f"{type(e).__name__}: {e}"}
        row["wall_s"] = time.perf_counter() - t0
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row)[:300], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("--out", default=".dev/sweep")
    r = sub.add_parser("run")
    r.add_argument("--tokens", default=".dev/sweep")
    r.add_argument("--jobs", default="methods", help=f"comma list of: {', '.join(job_sets())}")
    r.add_argument("--worker", type=int, default=0)
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--device", default="cuda")
    r.add_argument("--steps", type=int, default=300, help="Phase 2 steps per layer")
    r.add_argument("--kl-steps", type=int, default=100, help="KL stage steps (methods with a KL stage)")
    r.add_argument("--kl-steps-all", type=int, default=None,
                   help="KL stage steps for every job, over a job's own (its name says the steps run)")
    r.add_argument("--kl-patience", type=int, default=4,
                   help="KLConfig.patience: held-out checks (every 5 steps) without a new best that stop the KL stage "
                        "(and never before a tenth of its steps: KLConfig.patience_frac)")
    r.add_argument("--kl-recall-frac", type=float, default=0.0,
                   help="KLConfig.recall_frac for every job: this share of the KL stage's windows ends with a copy of "
                        "an earlier 256-token span of itself (job names get -recallN)")
    r.add_argument("--out", required=True)
    r.add_argument("--save", default=None, help="save each converted hybrid to SAVE/<job name>")
    r.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS, help="first N evaluation windows per domain")
    for key, what in (("method", "inits (the registry's names)"), ("align", "Phase-2 fits (local: as the init has it; "
                      "sequential, residual)"), ("keep", "keeps"), ("budget", "budgets"), ("calib", "calibration texts")):
        r.add_argument(f"--{key}s", default="", help=f"only jobs with these {what} (comma list)")
    r.add_argument("--keep-file", action="append", default=[],
                   help="NAME=FILE: a keep set (a comma list of layers in FILE) for the long-window-4k jobs")
    r.add_argument("--small-first", action="store_true", help="smallest budgets first")
    r.add_argument("--deadline-min", type=float, default=0, help="start no job after this many minutes")
    args = p.parse_args()
    tokens_step(args) if args.step == "tokens" else run_step(args)


if __name__ == "__main__":
    main()
