"""Hybrid vs teacher: prefill and decode speed and memory by context length.

Random weights at a real model's shapes (speed does not depend on the values):

    python bench/hybrid_speed.py --shape qwen2.5-1.5b --keep uniform:25% --contexts 2048,8192,32768 \
        --rows teacher-eager,teacher-compiled,hybrid-eager,teacher-fast,hybrid-fast --batch-sizes 1,8,32

Rows:
    teacher-eager      HF forward with its DynamicCache (what ``generate()`` does by default)
    teacher-compiled   HF ``generate()`` with a StaticCache: transformers compiles the decode step
                       (torch.compile mode="reduce-overhead"); prefill is the eager one
    hybrid-eager       the tcal hybrid's HF forward with a DynamicCache
    teacher-fast       tcal.models.fast.FastDecoder on the teacher (static cache, CUDA-graph step)
    hybrid-fast        FastDecoder on the hybrid (+ packed GDN projections, fla's fused step)
    generate           end-to-end HF generate() vs FastDecoder.generate on the hybrid

Prefill: one forward over the whole context (B=1), median of --reps after a warm-up (FastDecoder:
a captured prefill graph up to 4,096 tokens, eager above). Decode: --decode-tokens greedy steps after
the prefill, ms per token. Batched decode (--batch-sizes, at --batch-context): the cache is filled with
random keys/values/states instead of a B x context prefill (the step's cost does not depend on them),
tokens/s = B / step time. --check compares hybrid-fast with hybrid-eager (prefill logits and 64
teacher-forced decode steps, greedy agreement) at the first context.

The measurements are tcal.evaluate.speed's (``tcal bench`` is the command-line front end with tables and
a plot); this script keeps the flags and the JSON of the device runs (scripts/device_fast.sh).
"""
from __future__ import annotations

import argparse
import json

import torch

import tcal
from shapes import SHAPES, random_model  # bench/shapes.py
from tcal.conversion.select import select_layers
from tcal.evaluate import speed
from tcal.evaluate.speed import ROWS
from tcal.utils.runtime import resolve_device, resolve_dtype


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--keep", default="uniform:25%", help="layers kept as attention (list or policy uniform:K)")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--rows", default="teacher-eager,hybrid-eager", help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch-sizes", default="",
                   help="batched decode throughput at --batch-context (fast rows); max = the largest that fits (CUDA)")
    p.add_argument("--batch-context", type=int, default=32768)
    p.add_argument("--check", action="store_true", help="hybrid-fast vs hybrid-eager at the first context")
    p.add_argument("--no-pack", action="store_true", help="hybrid-fast without packed GDN projections")
    p.add_argument("--compiled-cache", choices=("fixed", "context"), default="fixed",
                   help="teacher-compiled: one StaticCache size for every context (one compile; attention then "
                        "spans the largest context at every row) or one sized to each context (a compile each)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--num-layers", type=int, default=0, help="override the depth (CPU smoke runs)")
    p.add_argument("--json")
    p.add_argument("--cudnn-sdpa", action="store_true",
                   help="allow PyTorch's cuDNN SDPA backend (off by default: on torch 2.11 + H200 it rebuilds a "
                        "cuDNN graph for every decode step, ~1.6 ms per attention call, which swamps decode)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one prefill and one decode step per model at the first context")
    args = p.parse_args(argv)
    rows_wanted = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows_wanted if r not in ROWS]
    if bad:
        p.error(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    device, dtype = torch.device(resolve_device(args.device)), resolve_dtype(args.dtype)
    if device.type == "cuda" and not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)  # flash / memory-efficient SDPA for teacher and hybrid alike
    teacher = random_model(args.shape, dtype=dtype, device=device, attn_implementation="sdpa",
                           num_layers=args.num_layers)
    cfg = teacher.config
    keep = select_layers(teacher, args.keep).layers
    hybrid = tcal.convert(teacher, keep=keep, init="copy").eval()
    contexts = [int(c) for c in args.contexts.split(",")]
    result = {"shape": args.shape, "keep": keep, "cudnn_sdpa": args.cudnn_sdpa, "dtype": args.dtype,
              "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "decode_tokens": args.decode_tokens, "rows": [], "batched": [], "check": None}

    def dump():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    if args.check:
        result["check"] = speed.check(hybrid, contexts[0], 64,
                                      progress=lambda name, r: print(name, json.dumps(r), flush=True))
        print("check", json.dumps(result["check"]), flush=True)
        dump()
    if args.profile:
        ctx = contexts[0]
        result["profile"] = {}
        for name, m in (("teacher", teacher), ("hybrid", hybrid)):
            res = speed.profile(m, ctx)
            for phase, r in res.items():
                print(f"--- {phase} ctx={ctx}: wall {r['wall_ms']:.1f} ms (profiled), GPU kernels "
                      f"{r['gpu_kernel_ms']:.1f} ms, {r['kernel_launches']} launches")
                print(r.pop("table"))
            result["profile"][name] = res
    fast_kw = {"pack": not args.no_pack}
    max_cache = max(contexts) + args.decode_tokens + 16
    for ctx in contexts:
        for name in rows_wanted:
            model = teacher if name.startswith("teacher") else hybrid
            size = max_cache if args.compiled_cache == "fixed" else ctx + args.decode_tokens + 16
            row = speed.measure_row(name, model, ctx, decode_tokens=args.decode_tokens, reps=args.reps,
                                    compiled_cache_len=size, fast_kw={} if name.startswith("teacher") else fast_kw)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            dump()
    for b in [x if x == "max" else int(x) for x in args.batch_sizes.split(",") if x]:
        for name in [r for r in rows_wanted if r.endswith("fast")]:
            model = teacher if name.startswith("teacher") else hybrid
            row = speed.batched_row(name, model, args.batch_context, b, 32,
                                    fast_kw=fast_kw if name == "hybrid-fast" else {})
            result["batched"].append(row)
            print(json.dumps(row), flush=True)
            dump()
    floor_ms = speed.weight_read_floor_ms(teacher)
    print(f"\n{args.shape} ({args.dtype}, {device}), hybrid keeps attention at {keep} "
          f"({len(keep)}/{cfg.num_hidden_layers}); weight-read floor {floor_ms:.2f} ms/token at 4.3 TB/s")
    print(f"{'context':>8} {'row':17} {'prefill tok/s':>14} {'peak GB':>8} {'cache MB':>9} {'decode ms/tok':>14}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['context']:>8} {r['model']:17} {r['error']}")
            continue
        if r["model"] == "generate":
            print(f"{r['context']:>8} {r['model']:17} HF generate {r['hf_tok_s']:,.1f} tok/s, FastDecoder.generate "
                  f"{r['fast_tok_s']:,.1f} tok/s ({r['speedup']:.2f}x, same tokens: {r['same_tokens']})")
            continue
        pre = f"{r['prefill_tok_s']:>14,.0f}" if "prefill_tok_s" in r else f"{'-':>14}"
        mem = f"{r['prefill_peak_gb']:.2f}" if r.get("prefill_peak_gb") is not None else "-"
        cmb = f"{r['cache_mb']:.1f}" if "cache_mb" in r else "-"
        print(f"{r['context']:>8} {r['model']:17} {pre} {mem:>8} {cmb:>9} {r['decode_ms']:>14.2f}")
    for r in result["batched"]:
        if "error" in r:
            print(f"batched {r['model']:12} B={str(r['batch']):<3} ctx={r['context']} {r['error']}")
        else:
            print(f"batched {r['model']:12} B={r['batch']:<3} ctx={r['context']} step {r['step_ms']:.2f} ms "
                  f"= {r['decode_tok_s']:,.0f} tok/s, cache {r['cache_gb']:.1f} GB")
    dump()


if __name__ == "__main__":
    main()
