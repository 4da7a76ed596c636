"""Prefill and decode speed of a GGUF in llama.cpp (``llama-cpp-python``): the ``*-llama.cpp`` rows of ``tcal bench``.

One pass per repetition grows a single random prompt through the requested contexts: prefill up to the first
context (timed), ``decode_tokens`` single-token steps (timed), prefill on to the next context, and so on. The
prefill time at a context is the time of every prefill segment so far, which is the time llama.cpp takes for
a prompt of that length (it prefills in batches of ``n_batch`` either way); the few decode tokens between
segments lengthen the cache by ``decode_tokens`` per context, against contexts of thousands. A decode step's
time is the median of its ``decode_tokens`` single steps (a busy neighbour on a shared machine shows up as a
few slow steps, not as a slower model). The KV cache is llama.cpp's default (f16), as a server runs it.
"""
from __future__ import annotations

import os
import statistics
import time

from tcal.engines.llamacpp import load


def decode_ms(llm, tokens) -> float:
    """Median milliseconds of one decode step of ``llm`` (a llama_cpp.Llama) over ``tokens``, fed one at a time."""
    per_token = []
    for tok in tokens:
        t0 = time.perf_counter()
        llm.eval([tok])
        per_token.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(per_token)


def gguf_rows(name: str, path, contexts: list[int], *, decode_tokens: int, reps: int, vocab_size: int,
              threads: int | None = None, gpu_layers: int = 0, seed: int = 0) -> list[dict]:
    """One row per context: {"model", "context", "prefill_tok_s", "decode_ms", ...}, medians over ``reps`` passes
    (after a warm-up at the first context)."""
    import numpy as np

    threads = threads or os.cpu_count() or 1
    contexts = sorted(contexts)
    n_ctx = contexts[-1] + decode_tokens * len(contexts) + 8
    rng = np.random.default_rng(seed)
    prompt = rng.integers(min(256, vocab_size // 2), vocab_size, contexts[-1]).tolist()  # past the special tokens
    steps = rng.integers(min(256, vocab_size // 2), vocab_size, decode_tokens).tolist()
    llm = load(path, n_ctx, purpose="a llama.cpp row of tcal bench", threads=threads, gpu_layers=gpu_layers, kv_cache="f16")
    try:
        llm.eval(prompt[: min(contexts[0], 512)])  # warm-up: weights paged in, kernels picked
        llm.eval(steps[:4])
        prefill = {c: [] for c in contexts}
        decode = {c: [] for c in contexts}
        for _ in range(reps):
            llm.reset()
            spent, done = 0.0, 0
            for c in contexts:
                t0 = time.perf_counter()
                llm.eval(prompt[done:c])
                spent += time.perf_counter() - t0
                done = c
                prefill[c].append(c / spent)
                decode[c].append(decode_ms(llm, steps))
    finally:
        llm.close()
    return [{"model": name, "context": c, "prefill_tok_s": statistics.median(prefill[c]),
             "decode_ms": statistics.median(decode[c]), "threads": threads, "gpu_layers": gpu_layers,
             "reps": reps, "engine": "llama.cpp"} for c in contexts]


def kv_bound(teacher_ms: dict[int, float], kept_share: float) -> dict[int, float]:
    """The decode speed-up over the teacher that keeping ``kept_share`` of the KV cache allows at each context:
    the teacher's step at the smallest context stands for what does not grow with the context (weights, MLPs,
    mixers), and the hybrid reads ``kept_share`` of the rest. teacher_ms: {context: decode ms per token}."""
    c0 = min(teacher_ms)
    flat = teacher_ms[c0]
    return {c: t / (flat + kept_share * (t - flat)) for c, t in teacher_ms.items()}


def flat_part(hybrid_ms: dict[int, float], teacher_ms: dict[int, float], kept_share: float) -> dict[int, float]:
    """The hybrid's decode step minus its attention layers' share of the teacher's growth since the smallest
    context: what its GDN layers, MLPs and weights cost. Constant in the context where the GDN step is."""
    c0 = min(teacher_ms)
    return {c: hybrid_ms[c] - kept_share * (teacher_ms[c] - teacher_ms[c0]) for c in hybrid_ms if c in teacher_ms}
