"""Distillation throughput and peak memory of `tcal.distill` at a real model's shape.

Random weights (speed does not depend on the values): a teacher built from a public config shape
(tcal.models.shapes), the hybrid converted from it with init copy, and random token ids.
Runs the real training loop (`tcal.train.trainer.distill`: chunked KL, AdamW, autocast) for --steps
steps and reports steady-state training tokens/s (steps after --warmup) and peak CUDA memory:

    python bench/distill_speed.py --shape smollm2-135m --keep 0,4,8,12,16,20,24,28 \
        --seq-len 1024 --batch-size 32 --steps 8

Use it before a long GPU run to size the token budget against the time you have.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tcal
from tcal.conversion.select import select_layers
from tcal.models.shapes import SHAPES, random_model
from tcal.ops import dispatch as ops_dispatch
from tcal.ops.dispatch import resolve_backend
from tcal.train.options import TrainOptions
from tcal.train.trainer import distill


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--keep", default="0,4,8,12,16,20,24,28", help="attention layers: a list or uniform:K")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--kl-chunk", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the steady-state rate")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="torch.compile the chunked GDN training path (tcal distill --compile)")
    ap.add_argument("--layers", type=int, default=0, help="override the number of layers (CPU smoke runs)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    teacher = random_model(args.shape, num_layers=args.layers)
    config = teacher.config
    n = config.num_hidden_layers
    keep = [i for i in select_layers(teacher, args.keep).layers if i < n]  # --layers may cut the list
    student = tcal.convert(teacher, keep=keep, init="copy")

    tps = args.batch_size * args.seq_len
    rng = np.random.default_rng(0)
    train = rng.integers(0, config.vocab_size, size=tps * (args.steps + 1), dtype=np.int64)
    eval_ids = torch.from_numpy(rng.integers(0, config.vocab_size, size=(1, 64)))
    stamps: list[float] = []

    def on_step(step, tokens):
        stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainOptions(seq_len=args.seq_len, batch_size=args.batch_size, micro_batch=args.micro_batch,
                           kl_chunk=args.kl_chunk, gradient_checkpointing=args.gradient_checkpointing,
                           compile=args.compile, eval_every=10 ** 15, eval_early=0, save_every=10 ** 15,
                           device=args.device, progress=False, warmup=0)
        report, _ = distill(student, teacher, cfg, tokens=tps * args.steps, train_tokens=train, eval_ids=eval_ids,
                            partial=Path(tmp) / "run.partial", teacher_ppl=1.0, callback=on_step)
    gaps = np.diff(stamps[args.warmup:]) if len(stamps) > args.warmup + 1 else np.diff(stamps)
    step_s = statistics.median(gaps.tolist()) if len(gaps) else float("nan")
    result = {
        "shape": args.shape, "layers": n, "attention_layers": keep, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "micro_batch": args.micro_batch or args.batch_size,
        "gradient_checkpointing": args.gradient_checkpointing, "device": report["device"],
        "precision": report["precision"], "gdn_compile": report["gdn_compile"], "trainable_params": report["trainable_params"],
        "step_s_median": step_s, "tokens_per_s": tps / step_s,
        "tokens_per_s_all_steps": report["train_tokens_per_s"], "peak_memory": report["peak_memory"],
        # the trainer's own split, as every recovery reports it: the first step (compiling) apart from the rest
        "first_step_s": (report.get("train_speed") or {}).get("first_step_s", [None])[0],
        "steady_tokens_per_s": (report.get("train_speed") or {}).get("steady_tokens_per_s"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # the path the GDN layers trained through, and whether a compile of the chunked path fell back to eager
        "gdn_backend": resolve_backend("auto", torch.device(report["device"]), args.seq_len, needs_grad=True),
        "gdn_compile_failed": ops_dispatch._COMPILE["failed"],
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "fla": _version("fla")},
    }
    b = report["peak_memory"].get("bytes")
    mem = f"{b / 2 ** 30:.1f} GiB ({report['peak_memory']['kind']})" if b else "n/a"
    print(f"{args.shape}: {len(keep)}/{n} attention, {args.batch_size}x{args.seq_len} tokens/step, "
          f"{report['precision']} on {report['device']}, GDN path {result['gdn_backend']}, compile "
          f"{report['gdn_compile']}{' (failed: eager)' if result['gdn_compile_failed'] else ''}")
    print(f"  step {step_s * 1000:.0f} ms (median after {args.warmup} warm-up steps) -> "
          f"{tps / step_s:,.0f} training tokens/s; peak memory {mem}")
    print(f"  first step {result['first_step_s']:.1f} s (compiling); after it {result['steady_tokens_per_s'] or 0:,.0f} "
          "training tokens/s (the trainer's steady rate, as tcal recover reports it)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
