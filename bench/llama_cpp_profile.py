"""Where a llama.cpp decode step goes: decode time and ``perf`` samples of the decode steps alone, per GGUF and
context.

Each GGUF prefills one random prompt through the contexts in order (ids past the special tokens, f16 KV cache,
batch 1, as ``tcal bench``'s llama.cpp rows), and at each context runs ``--steps`` single-token decode steps: their
median time, and (``--perf``) ``perf record`` attached to this process for those steps alone, reported by shared
object and symbol. Decode times are only meaningful with nothing else on the cores. Needs llama-cpp-python, and
``perf`` (linux-tools) for ``--perf``.

    python bench/llama_cpp_profile.py teacher=t.gguf hybrid=h.gguf --contexts 8192,16384 --steps 128 \\
        --threads 2 --perf --out runs/profile
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


def _decode(llm, tokens) -> list[float]:
    ms = []
    for tok in tokens:
        t0 = time.perf_counter()
        llm.eval([tok])
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def _perf_report(data: Path) -> str:
    return subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "dso,symbol", "--percent-limit",
                           "0.3"], capture_output=True, text=True).stdout


def profile(name: str, path: str, contexts: list[int], steps: int, threads: int, out: Path, perf: bool,
            seed: int = 0) -> list[dict]:
    import numpy as np

    from tcal.engines.llamacpp import load

    llm = load(path, contexts[-1] + steps * len(contexts) + 8, threads=threads, kv_cache="f16")  # llama.cpp's default
    rng = np.random.default_rng(seed)
    vocab = llm.n_vocab()
    prompt = rng.integers(min(256, vocab // 2), vocab, contexts[-1]).tolist()
    tokens = rng.integers(min(256, vocab // 2), vocab, steps).tolist()
    llm.eval(tokens[:8])  # warm-up: weights paged in
    llm.reset()
    rows, done = [], 0
    for c in contexts:
        t0 = time.perf_counter()
        llm.eval(prompt[done:c])
        prefill_s = time.perf_counter() - t0
        done = c
        rec = None
        if perf:
            data = out / f"{name}-{c}.perf.data"
            rec = subprocess.Popen(["perf", "record", "-F", "999", "-o", str(data), "-p", str(os.getpid())],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # perf attached
        ms = _decode(llm, tokens)
        if rec is not None:
            rec.send_signal(signal.SIGINT)
            rec.wait()
            (out / f"{name}-{c}.perf.txt").write_text(_perf_report(data))
            data.unlink()
        rows.append({"model": name, "path": path, "context": c, "steps": steps, "threads": threads,
                     "decode_ms_median": statistics.median(ms), "decode_ms_mean": statistics.fmean(ms),
                     "prefill_segment_s": prefill_s})
        print(f"{name} @ {c}: decode {rows[-1]['decode_ms_median']:.2f} ms / token (median of {steps})", flush=True)
    llm.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="NAME=PATH.gguf")
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--perf", action="store_true", help="perf record the decode steps")
    ap.add_argument("--out", required=True, help="directory for profile.json and the perf reports")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    rows = []
    for spec in args.models:
        name, _, path = spec.partition("=")
        rows += profile(name, path, contexts, args.steps, args.threads, out, args.perf)
        (out / "profile.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
