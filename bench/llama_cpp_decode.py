"""llama.cpp decode speed of several GGUFs at long contexts, interleaved so that a slow spell of a shared machine
falls on every model alike.

All models stay loaded. At each context (in order) each model's cache is prefilled to it with one random prompt
(ids past the special tokens; f16 KV cache, batch 1, as ``tcal bench``'s llama.cpp rows); then ``--blocks`` rounds
each decode ``--steps`` single tokens per model in turn. A block's time is the median of its steps; a model's
time at the context is the median of its blocks, and its speed-up over the first model the median of the
per-round ratios. The cache grows by blocks x steps tokens per context (about 2 % at 8K with the defaults).

    python bench/llama_cpp_decode.py teacher=t.gguf hybrid=h.gguf --contexts 8192,16384 --blocks 5 --steps 32 \\
        --threads 2 --out runs/decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="NAME=PATH.gguf; the first is the reference of the speed-ups")
    ap.add_argument("--contexts", default="8192,16384")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import numpy as np

    from tcal.engines.llamacpp import load
    from tcal.engines.llamacpp_speed import decode_ms

    contexts = sorted(int(c) for c in args.contexts.split(","))
    room = contexts[-1] + args.blocks * args.steps * len(contexts) + 8
    names, llms = [], []
    for spec in args.models:
        name, _, path = spec.partition("=")
        names.append(name)
        llms.append(load(path, room, threads=args.threads, kv_cache="f16"))
    rng = np.random.default_rng(0)
    vocab = min(llm.n_vocab() for llm in llms)
    prompt = rng.integers(min(256, vocab // 2), vocab, contexts[-1]).tolist()
    steps = rng.integers(min(256, vocab // 2), vocab, args.steps).tolist()
    done = 0
    rows = []
    for c in contexts:
        prefill = {}
        for name, llm in zip(names, llms):
            t0 = time.perf_counter()
            llm.eval(prompt[done:c])
            prefill[name] = time.perf_counter() - t0
        done = c
        blocks = {n: [] for n in names}
        for _ in range(args.blocks):
            for name, llm in zip(names, llms):
                blocks[name].append(decode_ms(llm, steps))
        ref = blocks[names[0]]
        for name in names:
            ratios = [r / b for r, b in zip(ref, blocks[name])]
            rows.append({"model": name, "context": c, "decode_ms": statistics.median(blocks[name]),
                         "block_ms": blocks[name], "speedup_vs_first": statistics.median(ratios),
                         "speedup_per_block": ratios, "prefill_segment_s": prefill[name], "threads": args.threads})
            print(f"{name} @ {c}: {rows[-1]['decode_ms']:.2f} ms / token, {rows[-1]['speedup_vs_first']:.2f}x "
                  f"{names[0]} (blocks {', '.join(f'{b:.1f}' for b in blocks[name])})", flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    for llm in llms:
        llm.close()


if __name__ == "__main__":
    main()
