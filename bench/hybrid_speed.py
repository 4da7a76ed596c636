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

Prefill: one forward over the whole context (B=1), median of --reps after a warm-up (FastDecoder:
a captured prefill graph up to 4,096 tokens, eager above). Decode: --decode-tokens greedy steps after
the prefill, ms per token. Batched decode (--batch-sizes, at --batch-context): the cache is filled with
random keys/values/states instead of a B x context prefill (the step's cost does not depend on them),
tokens/s = B / step time. --check compares hybrid-fast with hybrid-eager (prefill logits and 64
teacher-forced decode steps, greedy agreement) at the first context.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import tcal
from shapes import SHAPES, random_model  # bench/shapes.py
from tcal.conversion.select import select_layers
from tcal.models.fast import FastDecoder
from tcal.utils import compat
from tcal.utils.runtime import resolve_device, resolve_dtype

ROWS = ("teacher-eager", "teacher-compiled", "hybrid-eager", "teacher-fast", "hybrid-fast")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_gb(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
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
    """HF forward + DynamicCache."""
    ids = torch.randint(0, vocab, (1, ctx), device=device)
    times = []
    for i in range(reps + 1):
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        sync(device)
        if i:  # first run is the warm-up
            times.append(time.perf_counter() - t0)
    prefill_mem = peak_gb(device)
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
    p = statistics.median(times)
    return {"prefill_s": p, "prefill_tok_s": ctx / p, "prefill_peak_gb": prefill_mem, "cache_mb": cbytes / 2**20,
            "decode_ms": 1e3 * decode_s / decode_tokens, "decode_tok_s": decode_tokens / decode_s}


@torch.no_grad()
def measure_compiled(model, ctx, decode_tokens, device, vocab, max_cache_len):
    """HF generate() with a StaticCache of a fixed size (one compile serves every context): per-token decode
    time = (time for 1 + N new tokens - time for 1 new token) / N."""
    from transformers import StaticCache

    ids = torch.randint(0, vocab, (1, ctx), device=device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def run(n):
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             **{"past_key_values": cache})
        sync(device)
        assert out.shape[1] == ctx + n, out.shape
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run(decode_tokens + 1)  # compiles (the first time) and records the CUDA graphs
    warm = time.perf_counter() - t0
    one = statistics.median(run(1) for _ in range(2))
    many = statistics.median(run(decode_tokens + 1) for _ in range(2))
    ms = 1e3 * (many - one) / decode_tokens
    return {"decode_ms": ms, "decode_tok_s": 1e3 / ms, "first_call_s": warm, "max_cache_len": max_cache_len}


@torch.no_grad()
def measure_fast(model, ctx, decode_tokens, reps, device, vocab, **fast_kw):
    """FastDecoder: prefill (graph up to 4,096 tokens) and graph-replayed decode steps."""
    reset_peak(device)
    t0 = time.perf_counter()
    fast = FastDecoder(model, max_len=ctx + decode_tokens + 16, batch_size=1, **fast_kw)
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, vocab, (1, ctx), device=device)
    times = []
    for i in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        logits = fast.prefill(ids)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    prefill_mem = peak_gb(device)
    fast.cache.tok.copy_(logits.argmax(-1, keepdim=True))
    decode_s = timed_steps(fast, decode_tokens, warmup=8, device=device)
    p = statistics.median(times)
    row = {"prefill_s": p, "prefill_tok_s": ctx / p, "prefill_peak_gb": prefill_mem,
           "cache_mb": fast.cache.nbytes() / 2**20, "decode_ms": 1e3 * decode_s / decode_tokens,
           "decode_tok_s": decode_tokens / decode_s, "build_s": build_s, "graphs": fast._decode_graph is not None,
           "prefill_graph": bool(fast._prefill)}
    del fast
    free(device)
    return row


def timed_steps(fast, n: int, *, warmup: int, device) -> float:
    """Seconds for ``n`` FastDecoder decode steps after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fast._step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fast._step()
    sync(device)
    return time.perf_counter() - t0


@torch.no_grad()
def measure_batched(model, ctx, batch, decode_tokens, device, **fast_kw):
    """Decode throughput at batch ``batch`` with ``ctx`` tokens already in the cache (random contents)."""
    reset_peak(device)
    fast = FastDecoder(model, max_len=ctx + decode_tokens + 16, batch_size=batch, **fast_kw)
    c = fast.cache
    for t in (*c.keys.values(), *c.values.values()):
        t.normal_()
    for t in c.state.values():
        t.normal_(0, 0.02)
    c.valid[:, :ctx] = True
    c.pos.fill_(ctx)
    c.length = ctx
    c.tok.random_(0, 1000)
    dt = timed_steps(fast, decode_tokens, warmup=4, device=device) / decode_tokens
    row = {"batch": batch, "context": ctx, "step_ms": dt * 1e3, "decode_tok_s": batch / dt,
           "cache_gb": c.nbytes() / 2**30, "peak_gb": peak_gb(device)}
    del fast, c
    free(device)
    return row


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _eager_forced(model, ids, toks):
    """Eager logits (fp32) of the prefill's last position and of each teacher-forced token in ``toks``."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, compat.CACHE_KWARG)
    logits = [out.logits[:, -1].float()]
    for t in toks:
        out = model(t, use_cache=True, **{compat.CACHE_KWARG: cache})
        logits.append(out.logits[:, -1].float())
    return logits


@torch.no_grad()
def check(model, ctx, steps, device, vocab):
    """FastDecoder vs the eager model: the prefill's logits and ``steps`` decode steps, all fed the eager
    bf16 path's greedy tokens, each compared with an fp32 copy of the model run eagerly on the same tokens
    (so the fast path's error is read next to the eager bf16 path's own error); plus free-running greedy."""
    import copy

    from tcal.models.fast import _fp32_bmm_ok

    ids = torch.randint(0, vocab, (1, ctx), device=device)
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, compat.CACHE_KWARG)
    eager = [out.logits[:, -1].float()]
    toks = []
    for _ in range(steps):
        toks.append(eager[-1].argmax(-1, keepdim=True))
        out = model(toks[-1], use_cache=True, **{compat.CACHE_KWARG: cache})
        eager.append(out.logits[:, -1].float())
    ref_model = copy.deepcopy(model).float()
    ref = _eager_forced(ref_model, ids, toks)
    del ref_model
    free(device)

    def summary(got):
        errs = [rel(g, e) for g, e in zip(got, ref)]
        vs_eager = [rel(g, e) for g, e in zip(got, eager)]
        agree = sum(int(g.argmax() == e.argmax()) for g, e in zip(got, ref))
        return {"prefill_vs_fp32": errs[0], "decode_vs_fp32_median": statistics.median(errs[1:]),
                "decode_vs_fp32_max": max(errs[1:]), "decode_vs_eager_bf16_median": statistics.median(vs_eager[1:]),
                "argmax_agree_with_fp32": f"{agree}/{len(errs)}"}

    res = {"context": ctx, "steps": steps, "fp32_bmm": _fp32_bmm_ok(), "eager_bf16": summary(eager)}
    variants = {"static+graph": dict(pack=False, fused=False, compile=False),
                "+packed+fla-fused": dict(pack=True, fused=True, compile=False),
                "+compiled norms (default)": dict(pack=True, fused=True, compile=True)}
    for name, kw in variants.items():
        fast = FastDecoder(model, max_len=ctx + steps + 1, batch_size=1, **kw)
        got = [fast.prefill(ids).float()] + [fast.step(t).float() for t in toks]
        res[name] = {**summary(got), "graphs": fast._decode_graph is not None,
                     "compiled_glue": bool(getattr(fast, "_use_glue", False))}
        free_run = fast.generate(ids, max_new_tokens=steps + 1)[0, ctx:]
        want = torch.cat([t[0] for t in toks] + [eager[-1].argmax(-1)])
        same = (free_run == want).int()
        res[name]["free_running_first_diff_vs_eager"] = None if bool(same.all()) else int(same.argmin())
        del fast
        free(device)
        print(name, json.dumps(res[name]), flush=True)
    return res


@torch.no_grad()
def profile(model, ctx, device, vocab, top=12) -> dict:
    """One prefill and one decode step under torch.profiler: wall time vs GPU kernel time."""
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
    p.add_argument("--rows", default="teacher-eager,hybrid-eager", help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch-sizes", default="", help="batched decode throughput at --batch-context (fast rows)")
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
        result["check"] = check(hybrid, contexts[0], 64, device, cfg.vocab_size)
        print("check", json.dumps(result["check"]), flush=True)
        dump()
    if args.profile:
        ctx = contexts[0]
        result["profile"] = {name: profile(m, ctx, device, cfg.vocab_size)
                             for name, m in (("teacher", teacher), ("hybrid", hybrid))}
    fast_kw = {"pack": not args.no_pack}
    max_cache = max(contexts) + args.decode_tokens + 16
    for ctx in contexts:
        for name in rows_wanted:
            model = teacher if name.startswith("teacher") else hybrid
            try:
                if name.endswith("eager"):
                    r = measure(model, ctx, args.decode_tokens, args.reps, device, cfg.vocab_size)
                elif name == "teacher-compiled":
                    size = max_cache if args.compiled_cache == "fixed" else ctx + args.decode_tokens + 16
                    r = measure_compiled(model, ctx, args.decode_tokens, device, cfg.vocab_size, size)
                else:
                    r = measure_fast(model, ctx, args.decode_tokens, args.reps, device, cfg.vocab_size,
                                     **(fast_kw if name == "hybrid-fast" else {}))
            except torch.OutOfMemoryError:
                r = {"error": "out of memory"}
            except Exception as e:  # one failing row must not lose the others
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
            free(device)
            result["rows"].append({"model": name, "context": ctx, **r})
            print(json.dumps(result["rows"][-1]), flush=True)
            dump()
    for b in [int(x) for x in args.batch_sizes.split(",") if x]:
        for name in [r for r in rows_wanted if r.endswith("fast")]:
            model = teacher if name.startswith("teacher") else hybrid
            try:
                r = measure_batched(model, args.batch_context, b, 32, device,
                                    **(fast_kw if name == "hybrid-fast" else {}))
            except torch.OutOfMemoryError:
                r = {"batch": b, "context": args.batch_context, "error": "out of memory"}
            free(device)
            result["batched"].append({"model": name, **r})
            print(json.dumps(result["batched"][-1]), flush=True)
            dump()
    floor_ms = sum(p.numel() * p.element_size() for p in teacher.parameters()) / 4.3e12 * 1e3
    print(f"\n{args.shape} ({args.dtype}, {device}), hybrid keeps attention at {keep} "
          f"({len(keep)}/{cfg.num_hidden_layers}); weight-read floor {floor_ms:.2f} ms/token at 4.3 TB/s")
    print(f"{'context':>8} {'row':17} {'prefill tok/s':>14} {'peak GB':>8} {'cache MB':>9} {'decode ms/tok':>14}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['context']:>8} {r['model']:17} {r['error']}")
            continue
        pre = f"{r['prefill_tok_s']:>14,.0f}" if "prefill_tok_s" in r else f"{'-':>14}"
        mem = f"{r['prefill_peak_gb']:.2f}" if r.get("prefill_peak_gb") is not None else "-"
        cmb = f"{r['cache_mb']:.1f}" if "cache_mb" in r else "-"
        print(f"{r['context']:>8} {r['model']:17} {pre} {mem:>8} {cmb:>9} {r['decode_ms']:>14.2f}")
    for r in result["batched"]:
        if "error" in r:
            print(f"batched {r['model']:12} B={r['batch']:<3} ctx={r['context']} {r['error']}")
        else:
            print(f"batched {r['model']:12} B={r['batch']:<3} ctx={r['context']} step {r['step_ms']:.2f} ms "
                  f"= {r['decode_tok_s']:,.0f} tok/s, cache {r['cache_gb']:.1f} GB")
    dump()


if __name__ == "__main__":
    main()
