"""Speed of a causal LM (a teacher or a tcal hybrid): prefill and decode by context length, batched
decode throughput, end-to-end generation, and the fast path's numerics. Every function returns a dict
of plain numbers; nothing here prints or writes files.

Rows (:data:`ROWS`: the rows of :data:`tcal.engines.rows.BENCH_ROWS` that the ``tcal`` engine runs), each
measured by one function:

    teacher-eager, hybrid-eager   HF forward with its DynamicCache, what ``generate()`` does by default
                                  (:func:`measure_eager`)
    teacher-compiled              HF ``generate()`` with a StaticCache: transformers compiles the decode
                                  step (torch.compile mode="reduce-overhead"); no prefill number
                                  (:func:`measure_compiled`)
    teacher-fast, hybrid-fast     :class:`tcal.models.fast.FastDecoder`: static cache, CUDA-graph decode
                                  step (:func:`measure_fast`)
    generate                      end-to-end new tokens/s of HF ``generate()`` and of
                                  ``FastDecoder.generate`` on the same prompt (:func:`measure_generate`)

Prefill: one forward over a random prompt of the whole context (batch 1), the median of ``reps`` after a
warm-up. Decode: ``decode_tokens`` greedy steps after the prefill and a few untimed ones, milliseconds per
token. Batched decode (:func:`measure_batched`, :func:`max_batch`) fills the cache with random keys,
values and states instead of a B x context prefill: a step's cost does not depend on their values.
Weight values do not matter either, so a random-weight model at a real model's shapes
(:mod:`tcal.models.shapes`) measures what the trained model would.
"""
from __future__ import annotations

import copy
import functools
import gc
import statistics
import time
from collections.abc import Callable

import torch

from tcal.engines.rows import rows_of
from tcal.models.fast import FastDecoder, StaticHybridCache, _fp32_bmm_ok
from tcal.utils import compat
from tcal.utils.errors import TcalError
from tcal.utils.runtime import model_device

ROWS = rows_of("tcal")
PEAK_BANDWIDTH = 4.3e12  # bytes/s: HBM3e peak of an H200-class GPU, an assumption, not a measurement
GiB = 2**30


# -- timing and memory primitives -------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def random_ids(vocab: int, batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    """(batch, length) token ids, the same for every model of one vocabulary and seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


def cache_bytes(cache) -> int:
    """Bytes held by a StaticHybridCache or a transformers cache (keys, values, conv and recurrent states)."""
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


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied embeddings once): what one decode step must read."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_read_floor_ms(model, bandwidth: float = PEAK_BANDWIDTH) -> float:
    """Milliseconds per decode step to read every weight once at ``bandwidth`` bytes/s (batch 1: no
    step can be faster; the default bandwidth is an assumed peak, see :data:`PEAK_BANDWIDTH`)."""
    return weight_bytes(model) / bandwidth * 1e3


def environment(device) -> dict:
    """Versions and device name, for a result to say what it was measured with."""
    import transformers

    device = torch.device(device)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": "cpu",
           "cuda": torch.version.cuda}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["device_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / GiB
    return env


# -- rows ---------------------------------------------------------------------------------------------

def _decode(model, tok, cache):
    out = model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})
    return out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def measure_eager(model, ctx: int, decode_tokens: int = 128, reps: int = 3, *, seed: int = 0) -> dict:
    """HF forward + DynamicCache: prefill of ``ctx`` tokens, then ``decode_tokens`` greedy steps."""
    device = model_device(model)
    ids = random_ids(model.config.vocab_size, 1, ctx, device, seed)
    times = []
    for i in range(reps + 1):
        _reset_peak(device)
        _sync(device)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        _sync(device)
        if i:  # the first run is the warm-up
            times.append(time.perf_counter() - t0)
    prefill_mem = _peak_gb(device)
    cache = getattr(out, compat.CACHE_KWARG)
    cbytes = cache_bytes(cache)
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(8):  # the first calls at a new shape pay one-time set-up costs
        tok = _decode(model, tok, cache)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        tok = _decode(model, tok, cache)
    _sync(device)
    decode_s = time.perf_counter() - t0
    p = statistics.median(times)
    return {"prefill_s": p, "prefill_tok_s": ctx / p, "prefill_peak_gb": prefill_mem, "cache_mb": cbytes / 2**20,
            "decode_ms": 1e3 * decode_s / decode_tokens, "decode_tok_s": decode_tokens / decode_s}


def _greedy_config(model, new_tokens: int):
    """The model's generation config made greedy, exactly ``new_tokens`` long (a copy: the model's own
    config is left as it was)."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None  # never stop early: every run generates the same number of tokens
    cfg.pad_token_id = 0
    cfg.do_sample, cfg.max_new_tokens, cfg.min_new_tokens = False, new_tokens, None
    cfg.temperature = cfg.top_p = cfg.top_k = None  # a sampling model's defaults only warn when greedy
    return cfg


@torch.no_grad()
def measure_compiled(model, ctx: int, decode_tokens: int = 128, max_cache_len: int | None = None, *,
                     seed: int = 0) -> dict:
    """HF generate() with a StaticCache of ``max_cache_len`` slots (default: just enough; one size for
    every context means one compile). Per-token decode time = (time for 1 + N new tokens - time for 1
    new token) / N, which takes the prefill out."""
    from transformers import StaticCache

    device = model_device(model)
    max_cache_len = max_cache_len or ctx + decode_tokens + 16
    ids = random_ids(model.config.vocab_size, 1, ctx, device, seed)

    def run(n):
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(model, n),
                             **{compat.CACHE_KWARG: cache})
        _sync(device)
        if out.shape[1] != ctx + n:
            raise RuntimeError(f"generate returned {out.shape[1] - ctx} new tokens, not {n}")
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    run(decode_tokens + 1)  # compiles (the first time) and records the CUDA graphs
    warm = time.perf_counter() - t0
    one = statistics.median(run(1) for _ in range(2))
    many = statistics.median(run(decode_tokens + 1) for _ in range(2))
    ms = 1e3 * (many - one) / decode_tokens
    return {"decode_ms": ms, "decode_tok_s": 1e3 / ms, "first_call_s": warm, "max_cache_len": max_cache_len}


def _timed_steps(fast: FastDecoder, n: int, *, warmup: int) -> float:
    """Seconds for ``n`` FastDecoder decode steps after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fast._step()
    _sync(fast.device)
    t0 = time.perf_counter()
    for _ in range(n):
        fast._step()
    _sync(fast.device)
    return time.perf_counter() - t0


@torch.no_grad()
def measure_fast(model, ctx: int, decode_tokens: int = 128, reps: int = 3, *, seed: int = 0, **fast_kw) -> dict:
    """FastDecoder: prefill (a captured graph up to ``prefill_graph_max`` tokens, eager above) and
    graph-replayed decode steps. ``fast_kw`` go to FastDecoder (``pack``, ``fused``, ...)."""
    device = model_device(model)
    _reset_peak(device)
    t0 = time.perf_counter()
    fast = FastDecoder(model, max_len=ctx + decode_tokens + 16, batch_size=1, **fast_kw)
    build_s = time.perf_counter() - t0
    ids = random_ids(model.config.vocab_size, 1, ctx, device, seed)
    times = []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        logits = fast.prefill(ids)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    prefill_mem = _peak_gb(device)
    fast.cache.tok.copy_(logits.argmax(-1, keepdim=True))
    decode_s = _timed_steps(fast, decode_tokens, warmup=8)
    p = statistics.median(times)
    row = {"prefill_s": p, "prefill_tok_s": ctx / p, "prefill_peak_gb": prefill_mem,
           "cache_mb": fast.cache.nbytes() / 2**20, "decode_ms": 1e3 * decode_s / decode_tokens,
           "decode_tok_s": decode_tokens / decode_s, "build_s": build_s, "graphs": fast._decode_graph is not None,
           "prefill_graph": bool(fast._prefill)}
    del fast
    _free(device)
    return row


@torch.no_grad()
def measure_generate(model, ctx: int, new_tokens: int = 128, reps: int = 1, *, seed: int = 0, **fast_kw) -> dict:
    """End-to-end greedy generation of ``new_tokens`` after a random ``ctx``-token prompt: HF
    ``model.generate(do_sample=False)`` against ``FastDecoder.generate``, each timed after a warm-up
    run (the median of ``reps``). Prefill included: this is the number a user of either call sees.
    ``same_tokens``: whether both produced the same greedy tokens (bf16 runs may part ways at a near tie)."""
    device = model_device(model)
    ids = random_ids(model.config.vocab_size, 1, ctx, device, seed)
    mask = torch.ones_like(ids)
    config = _greedy_config(model, new_tokens)
    t0 = time.perf_counter()
    fast = FastDecoder(model, max_len=ctx + new_tokens, batch_size=1, **fast_kw)
    build_s = time.perf_counter() - t0

    def timed(fn):
        out = fn()  # warm-up: kernels, autotuning, graph capture of the prefill
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out[0, ctx:]

    hf_s, hf_out = timed(lambda: model.generate(ids, attention_mask=mask, generation_config=config))
    fast_s, fast_out = timed(functools.partial(fast.generate, ids, new_tokens))
    del fast
    _free(device)
    if hf_out.shape != fast_out.shape:
        raise RuntimeError(f"HF generate returned {hf_out.numel()} new tokens, FastDecoder {fast_out.numel()}")
    same = (hf_out == fast_out).int()
    return {"new_tokens": new_tokens, "hf_s": hf_s, "hf_tok_s": new_tokens / hf_s, "fast_s": fast_s,
            "fast_tok_s": new_tokens / fast_s, "speedup": hf_s / fast_s, "fast_build_s": build_s,
            "same_tokens": bool(same.all()), "first_diff": None if bool(same.all()) else int(same.argmin())}


def error_line(e: Exception) -> str:
    """What a result records of a failure: the exception's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def measure_row(name: str, model, ctx: int, *, decode_tokens: int = 128, reps: int = 3,
                compiled_cache_len: int | None = None, fast_kw: dict | None = None) -> dict:
    """One (row, context) cell: ``{"model": name, "context": ctx, ...}`` with the row's numbers, or with
    ``"error"`` (out of memory, or the exception's first line) so that one failing cell does not lose
    the others. ``model`` is the model the row runs: the teacher for teacher-*, the hybrid otherwise."""
    if name not in ROWS:
        raise TcalError(f"unknown row {name!r}; choose from {', '.join(ROWS)}")
    fast_kw = fast_kw or {}
    device = model_device(model)
    try:
        if name.endswith("eager"):
            r = measure_eager(model, ctx, decode_tokens, reps)
        elif name == "teacher-compiled":
            r = measure_compiled(model, ctx, decode_tokens, compiled_cache_len)
        elif name == "generate":
            r = measure_generate(model, ctx, decode_tokens, reps, **fast_kw)
        else:
            r = measure_fast(model, ctx, decode_tokens, reps, **fast_kw)
    except torch.OutOfMemoryError:
        r = {"error": "out of memory"}
    except Exception as e:  # one failing row must not lose the others
        r = {"error": error_line(e)}
    _free(device)
    return {"model": name, "context": ctx, **r}


# -- batched decode ---------------------------------------------------------------------------------

def _fill_random(cache: StaticHybridCache, ctx: int) -> None:
    """The cache as if ``ctx`` tokens had been prefilled (random contents: the step's cost is the same)."""
    for t in (*cache.keys.values(), *cache.values.values()):
        t.normal_()
    for t in cache.state.values():
        t.normal_(0, 0.02)
    cache.valid[:, :ctx] = True
    cache.pos.fill_(ctx)
    cache.length = ctx
    cache.tok.random_(0, 1000)


@torch.no_grad()
def measure_batched(model, ctx: int, batch: int, decode_tokens: int = 32, **fast_kw) -> dict:
    """Decode throughput at batch ``batch`` with ``ctx`` tokens already in the cache:
    tokens/s = batch / step time."""
    device = model_device(model)
    _reset_peak(device)
    fast = FastDecoder(model, max_len=ctx + decode_tokens + 16, batch_size=batch, **fast_kw)
    c = fast.cache
    _fill_random(c, ctx)
    dt = _timed_steps(fast, decode_tokens, warmup=4) / decode_tokens
    row = {"batch": batch, "context": ctx, "step_ms": dt * 1e3, "decode_tok_s": batch / dt,
           "cache_gb": c.nbytes() / GiB, "peak_gb": _peak_gb(device), "graphs": fast._decode_graph is not None}
    del fast, c
    _free(device)
    return row


def sequence_bytes(model, ctx: int, decode_tokens: int = 32) -> dict:
    """Device bytes one more sequence of a batched decode step costs: its cache slots (a batch-1
    StaticHybridCache of the size :func:`measure_batched` builds), its logits (fp32 next to the model's
    dtype) and the decode attention's fp32 scores and probabilities over every slot of one layer."""
    cache = StaticHybridCache(model, 1, ctx + decode_tokens + 16)
    cache_b, slots = cache.nbytes(), cache.slots
    del cache
    cfg = model.config
    elt = next(model.parameters()).element_size()
    logits_b = cfg.vocab_size * (elt + 4)
    scores_b = cfg.num_attention_heads * slots * (4 + 4 + elt)  # scores, masked copy, probabilities
    return {"cache": cache_b, "logits": logits_b, "attention": scores_b, "total": cache_b + logits_b + scores_b}


def max_batch(model, ctx: int, decode_tokens: int = 32, *, margin: float = 0.06, reserve_gb: float = 2.0,
              tries: int = 6, **fast_kw) -> dict:
    """The largest batch whose decode step fits on the GPU at ``ctx`` tokens, and its throughput.

    B = (free memory x (1 - ``margin``) - ``reserve_gb``) / :func:`sequence_bytes`; the reserve covers
    what does not grow with B (packed weights, compiled kernels, the graph's pool). B is tried; on out of
    memory, or a decode step FastDecoder could not capture (it falls back to eager decoding on any
    failure inside the capture, an out of memory included), it backs off by 10 %, at most ``tries`` times. Returns :func:`measure_batched`'s row plus the estimate and
    every failed attempt; ``"error"`` when nothing fitted.
    """
    device = model_device(model)
    if device.type != "cuda":
        raise TcalError("the largest-batch search reads the GPU's free memory: it needs a model on CUDA")
    per = sequence_bytes(model, ctx, decode_tokens)
    _free(device)  # the allocator's cached blocks (that batch-1 cache too) count as used in mem_get_info
    free_b, _ = torch.cuda.mem_get_info(device)
    budget = free_b * (1 - margin) - reserve_gb * GiB
    estimate = int(budget // per["total"])
    info = {"estimated_batch": estimate, "free_gb": free_b / GiB, "per_sequence_mb": per["total"] / 2**20,
            "attempts": []}
    want_graphs = fast_kw.get("cuda_graphs", True) is not False
    b = estimate
    for _ in range(tries):
        if b < 1:
            break
        try:
            row = measure_batched(model, ctx, b, decode_tokens, **fast_kw)
            if row["graphs"] or not want_graphs:
                return {**row, **info}
            info["attempts"].append({"batch": b, "error": "decode step could not be captured as a CUDA graph"})
        except torch.OutOfMemoryError:
            info["attempts"].append({"batch": b, "error": "out of memory"})
        _free(device)
        b = min(int(b * 0.9), b - 1)
    return {"batch": None, "context": ctx, "error": f"out of memory at every batch tried "
            f"({', '.join(str(a['batch']) for a in info['attempts']) or 'none: not one sequence fits'})", **info}


def batched_row(name: str, model, ctx: int, batch: int | str, decode_tokens: int = 32,
                fast_kw: dict | None = None) -> dict:
    """One batched-decode cell of a fast row: ``{"model": name, "batch": ..., "context": ctx, ...}``;
    ``batch`` a size or ``"max"`` (:func:`max_batch`, which also reports ``"requested": "max"``). Out of
    memory or an exception is recorded as ``"error"``, as in :func:`measure_row`."""
    fast_kw = fast_kw or {}
    device = model_device(model)
    try:
        if batch == "max":
            r = {"requested": "max", **max_batch(model, ctx, decode_tokens, **fast_kw)}
        else:
            r = measure_batched(model, ctx, int(batch), decode_tokens, **fast_kw)
    except torch.OutOfMemoryError:
        r = {"batch": batch, "context": ctx, "error": "out of memory"}
    except Exception as e:
        r = {"batch": batch, "context": ctx, "error": error_line(e)}
    _free(device)
    return {"model": name, **r}


# -- numerics and profile -----------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
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
def check(model, ctx: int, steps: int = 64, *, seed: int = 0,
          progress: Callable[[str, dict], None] | None = None) -> dict:
    """FastDecoder against the eager model: the prefill's logits and ``steps`` decode steps, all fed the
    eager path's greedy tokens, each compared with an fp32 copy of the model run eagerly on the same
    tokens (so the fast path's error reads next to the eager path's own error in the model's dtype); plus
    where free-running greedy generation first departs from the eager tokens. Three FastDecoder variants;
    ``progress(variant, result)`` is called as each finishes."""
    device = model_device(model)
    ids = random_ids(model.config.vocab_size, 1, ctx, device, seed)
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
    _free(device)

    def summary(got):
        errs = [_rel(g, e) for g, e in zip(got, ref)]
        vs_eager = [_rel(g, e) for g, e in zip(got, eager)]
        agree = sum(int(g.argmax() == e.argmax()) for g, e in zip(got, ref))
        decode = errs[1:] or [float("nan")]
        return {"prefill_vs_fp32": errs[0], "decode_vs_fp32_median": statistics.median(decode),
                "decode_vs_fp32_max": max(decode),
                "decode_vs_eager_bf16_median": statistics.median(vs_eager[1:] or [float("nan")]),
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
        _free(device)
        if progress is not None:
            progress(name, res[name])
    return res


@torch.no_grad()
def profile(model, ctx: int, *, top: int = 12, seed: int = 0) -> dict:
    """One prefill and one decode step of the eager model under torch.profiler: wall time against GPU
    kernel time and launches; ``table`` is the profiler's top-``top`` table by CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = model_device(model)
    ids = random_ids(model.config.vocab_size, 1, ctx, device, seed)
    out = model(ids, use_cache=True, logits_to_keep=1)  # warm-up at this shape
    cache, tok = getattr(out, compat.CACHE_KWARG), out.logits[:, -1:].argmax(-1)
    model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    res = {}
    for phase in ("prefill", "decode"):
        if phase == "prefill":
            step = lambda: model(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
        else:
            step = lambda: model(tok, use_cache=True, **{compat.CACHE_KWARG: cache})  # noqa: E731
        _sync(device)
        with torch_profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step()
            _sync(device)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        res[phase] = {"wall_ms": wall * 1e3, "gpu_kernel_ms": kernel_us / 1e3, "kernel_launches": launches,
                      "table": events.table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60)}
    return res
