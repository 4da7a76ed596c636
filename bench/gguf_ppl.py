"""Held-out perplexity of GGUF files in llama.cpp (llama-cpp-python), on tcal's evaluation windows.

Each model reads the same token windows tcal's own PPL reads (``tcal.token_windows``: the first N windows of W
tokens of the corpus, BOS-prefixed where the tokenizer adds one), one window at a time from an empty cache, with
an f32 KV cache so that what is measured is the file's weights; PPL = exp(mean next-token NLL over N (W - 1)
predictions). The models are named NAME=PATH.gguf on the command line; the tokenizer is any model directory with
the vocabulary they share.

    python bench/gguf_ppl.py --tokenizer runs/hybrid --data wiki:eval --windows 16 \\
        teacher-q4_1=teacher.Q4_1.gguf hybrid-f16=runs/export-f16/model-f16.gguf --out runs/gguf-ppl.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np


def window_nll(llm, ids: list[int]) -> float:
    """Sum of -log p(ids[t + 1] | ids[: t + 1]) over the window, from llama.cpp's logits."""
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # (W - 1, V)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum())


def gguf_ppl(path: str, windows, threads: int) -> dict:
    from tcal.engines.llamacpp import load

    W = windows.shape[1]
    llm = load(path, W, n_batch=W, logits_all=True, threads=threads, kv_cache="f32")
    t0 = time.perf_counter()
    nll = sum(window_nll(llm, row.tolist()) for row in windows)
    llm.close()
    n = windows.shape[0] * (W - 1)
    return {"ppl": math.exp(nll / n), "nll": nll / n, "tokens": n, "seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="NAME=PATH.gguf")
    ap.add_argument("--tokenizer", required=True, help="a model directory whose tokenizer cuts the windows")
    ap.add_argument("--data", default="wiki:eval")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON file of the results")
    args = ap.parse_args()

    from tcal.data.teachers import load_tokenizer_dir
    from tcal.data.tokens import token_windows

    tok = load_tokenizer_dir(args.tokenizer)
    windows = token_windows(args.data, tok, window=args.window, n_windows=args.windows).numpy()
    rows = {}
    for spec in args.models:
        name, _, path = spec.partition("=")
        rows[name] = {"path": path, **gguf_ppl(path, windows, args.threads)}
        print(f"{name}: PPL {rows[name]['ppl']:.3f} on {args.data} ({args.windows} x {args.window})", flush=True)
    result = {"data": args.data, "window": args.window, "windows": args.windows, "kv_cache": "f32",
              "threads": args.threads, "models": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
