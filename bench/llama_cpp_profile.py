"""Where a llama.cpp decode step goes: ``perf`` samples of the decode steps alone, at one context, per GGUF.

Each GGUF prefills a random prompt to ``--context`` (as ``tcal bench``'s llama.cpp rows do: ids past the special
tokens, f16 KV cache, batch 1), then ``perf record`` attaches to this process for ``--steps`` single-token decode
steps, and ``perf report`` groups the samples by shared object and symbol. The median step time is printed too
(only meaningful with nothing else on the cores). Needs ``perf`` (linux-tools) and llama-cpp-python.

    python bench/llama_cpp_profile.py teacher=t.gguf hybrid=h.gguf --context 8192 --steps 200 --threads 2 \\
        --out runs/profile-8k
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path


def profile(name: str, path: str, context: int, steps: int, threads: int, out: Path, seed: int = 0) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=path, n_ctx=context + steps + 8, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, type_k=1, type_v=1, verbose=False)  # 1: f16
    rng = np.random.default_rng(seed)
    vocab = llm.n_vocab()
    llm.eval(rng.integers(min(256, vocab // 2), vocab, context).tolist())
    tokens = rng.integers(min(256, vocab // 2), vocab, steps).tolist()
    data = out / f"{name}.perf.data"
    perf = subprocess.Popen(["perf", "record", "-F", "999", "-o", str(data), "-p", str(os.getpid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attached
    ms = []
    for tok in tokens:
        t0 = time.perf_counter()
        llm.eval([tok])
        ms.append((time.perf_counter() - t0) * 1e3)
    perf.send_signal(signal.SIGINT)
    perf.wait()
    llm.close()
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "dso,symbol", "--percent-limit",
                             "0.5"], capture_output=True, text=True).stdout
    (out / f"{name}.perf.txt").write_text(report)
    return {"model": name, "path": path, "context": context, "steps": steps, "threads": threads,
            "decode_ms_median": statistics.median(ms), "decode_ms_mean": statistics.fmean(ms)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="NAME=PATH.gguf")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", required=True, help="directory for the perf data, reports and profile.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.models:
        name, _, path = spec.partition("=")
        rows.append(profile(name, path, args.context, args.steps, args.threads, out))
        print(f"{name}: {rows[-1]['decode_ms_median']:.2f} ms / token at {args.context} (median of {args.steps})",
              flush=True)
    (out / "profile.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
