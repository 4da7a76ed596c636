"""Hybrid vs teacher: prefill and decode throughput and memory by context length.

Random weights at a real model's shapes (speed does not depend on the values):

    python bench/hybrid_speed.py --shape qwen2.5-1.5b --keep uniform:25% --contexts 1024,4096,16384

Prefill: one forward over the whole context (B=1), median of --reps after a warm-up.
Decode: --decode-tokens greedy steps after a prefill of the given length, tokens/s.
Memory: peak CUDA memory of each phase, and the size of the cache after prefill.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tcal
from shapes import SHAPES, random_model  # bench/shapes.py
from tcal.conversion.select import select_layers
from tcal.utils import compat
from tcal.utils.runtime import resolve_device, resolve_dtype


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        for name in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, name, None) or {}).values():
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def measure(model, ctx, decode_tokens, reps, device, vocab):
    ids = torch.randint(0, vocab, (1, ctx), device=device)
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        sync(device)
        if i:  # first run is the warm-up
            times.append(time.perf_counter() - t0)
    prefill_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    cache = getattr(out, compat.CACHE_KWARG)
    cbytes = cache_bytes(cache)
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(8):  # decode warm-up: first calls at a new shape pay one-time setup costs
        out = model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})
        tok = out.logits[:, -1:].argmax(-1)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        out = model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})
        tok = out.logits[:, -1:].argmax(-1)
    sync(device)
    decode_s = time.perf_counter() - t0
    return {
        "prefill_s": statistics.median(times), "prefill_tok_s": ctx / statistics.median(times),
        "prefill_peak_gb": prefill_mem, "cache_mb": cbytes / 2**20,
        "decode_tok_s": decode_tokens / decode_s,
    }


@torch.no_grad()
def profile(model, ctx, device, vocab, top=12) -> dict:
    """One prefill and one decode step under torch.profiler: wall time vs GPU kernel time.

    Kernel time well below wall time means the forward is bound by the host (Python and kernel
    launches), not by the GPU; the top host-side ops say where that time goes.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ids = torch.randint(0, vocab, (1, ctx), device=device)
    out = model(ids, use_cache=True, logits_to_keep=1)  # warm-up at this shape
    cache, tok = getattr(out, compat.CACHE_KWARG), out.logits[:, -1:].argmax(-1)
    model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})
    res = {}
    for phase in ("prefill", "decode"):
        if phase == "prefill":
            step = lambda: model(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
        else:
            step = lambda: model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})  # noqa: E731
        sync(device)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            sync(device)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        res[phase] = {"wall_ms": wall * 1e3, "gpu_kernel_ms": kernel_us / 1e3, "kernel_launches": launches}
        print(f"--- {phase} ctx={ctx}: wall {wall * 1e3:.1f} ms (profiled), GPU kernels {kernel_us / 1e3:.1f} ms, "
              f"{launches} launches")
        print(events.table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60))
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--keep", default="uniform:25%", help="layers kept as attention (list or policy uniform:K)")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--json")
    p.add_argument("--cudnn-sdpa", action="store_true",
                   help="allow PyTorch's cuDNN SDPA backend (off by default: on torch 2.11 + H200 it rebuilds a "
                        "cuDNN graph for every decode step, ~1.6 ms per attention call, which swamps decode)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one prefill and one decode step per model at the first context")
    args = p.parse_args(argv)
    device, dtype = torch.device(resolve_device(args.device)), resolve_dtype(args.dtype)
    if device.type == "cuda" and not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)  # flash / memory-efficient SDPA for teacher and hybrid alike
    teacher = random_model(args.shape, dtype=dtype, device=device, attn_implementation="sdpa")
    cfg = teacher.config
    keep = select_layers(teacher, args.keep).layers
    hybrid = tcal.convert(teacher, keep=keep, init="copy").eval()
    rows = []
    if args.profile:
        ctx = int(args.contexts.split(",")[0])
        prof = {name: profile(m, ctx, device, cfg.vocab_size) for name, m in (("teacher", teacher), ("hybrid", hybrid))}
        rows.append({"profile": prof, "context": ctx})
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for name, model in (("teacher", teacher), ("hybrid", hybrid)):
            try:
                r = measure(model, ctx, args.decode_tokens, args.reps, device, cfg.vocab_size)
            except torch.OutOfMemoryError:
                r = {"error": "out of memory"}
                torch.cuda.empty_cache()
            rows.append({"model": name, "context": ctx, **r})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.shape} ({args.dtype}, {device}), hybrid keeps attention at {keep} "
          f"({len(keep)}/{cfg.num_hidden_layers})")
    print(f"{'context':>8} {'model':8} {'prefill tok/s':>14} {'peak GB':>8} {'cache MB':>9} {'decode tok/s':>13}")
    for r in rows:
        if "profile" in r:
            continue
        if "error" in r:
            print(f"{r['context']:>8} {r['model']:8} {r['error']}")
            continue
        mem = f"{r['prefill_peak_gb']:.2f}" if r["prefill_peak_gb"] is not None else "-"
        print(f"{r['context']:>8} {r['model']:8} {r['prefill_tok_s']:>14,.0f} {mem:>8} {r['cache_mb']:>9.1f} "
              f"{r['decode_tok_s']:>13.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "keep": keep, "cudnn_sdpa": args.cudnn_sdpa, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
