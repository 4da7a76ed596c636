"""`tcal eval`: held-out perplexity of a saved hybrid or any teacher, or its long-context retrieval.

``--task ppl`` (default) prints the perplexity and its protocol. ``--task niah`` (every retrieval
task) or a comma list of tasks (``single,multikey``) scores RULER-style retrieval at each of
``--lengths`` and writes ``--out``: niah.json (every sample), niah.md (task x length table),
niah.png (depth x length heat map per task). Finished (task, length) cells are kept in
``OUT.partial/`` so an interrupted run continues where it stopped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tcal.utils.config import DeviceArgs, OutArgs, arg

RETRIEVAL_TASKS = ("single", "single-words", "single-uuids", "single-noise", "multikey", "multivalue",
                   "multiquery", "vt", "cwe")  # tcal.evaluate.niah.TASKS, listed here for --help without torch


@dataclass
class EvalConfig(DeviceArgs, OutArgs):
    model: str = arg("smollm2-135m", "a saved tcal hybrid directory, or any teacher spec")
    task: str = arg("ppl", "ppl (held-out perplexity), niah (every retrieval task) or a comma list of "
                           "retrieval tasks: " + ", ".join(RETRIEVAL_TASKS))
    data: str = arg("wiki:eval", "perplexity: corpus spec or file path")
    window: int = arg(512, "perplexity: tokens per window")
    windows: int = arg(64, "perplexity: number of windows (the first N, non-overlapping)")
    lengths: str = arg("512,1024,2048,4096", "retrieval: context lengths in tokens, comma-separated")
    samples: int = arg(8, "retrieval: prompts per task and length (needle depths spread over 0..1)")
    seed: int = arg(0, "retrieval: seed of every random choice in the prompts")
    haystack: str = arg("sotu:eval", "retrieval: real text the needles hide in (used for nothing else)")
    batch_size: int = arg(4, "retrieval: prompts generated together")
    out: str = arg("runs/eval", "retrieval: output directory (written atomically)")
    progress: bool = arg(True, "progress bars")
    dtype: str = arg("float32", "float32 or bfloat16")


def retrieval_tasks(spec: str) -> list[str]:
    from tcal.utils.errors import TcalError

    names = list(RETRIEVAL_TASKS) if spec.strip() == "niah" else [t.strip() for t in spec.split(",") if t.strip()]
    bad = [t for t in names if t not in RETRIEVAL_TASKS]
    if bad or not names:
        raise TcalError(f"unknown --task {bad[0] if bad else spec!r}; use ppl, niah or tasks from: "
                        f"{', '.join(RETRIEVAL_TASKS)}")
    return names


def run(cfg: EvalConfig) -> dict:
    import json

    from tcal.data.teachers import load_teacher
    from tcal.evaluate import perplexity_report
    from tcal.utils.runtime import resolve_device, resolve_dtype

    if cfg.task != "ppl":
        return run_retrieval(cfg)
    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    rep = perplexity_report(model, tokenizer, cfg.data, window=cfg.window, windows=cfg.windows)
    print(json.dumps(rep, indent=2, default=str))
    print(f"{cfg.model}: PPL {rep['ppl']:.3f} on {cfg.data} ({cfg.windows} x {cfg.window} tokens)")
    return rep


def run_retrieval(cfg: EvalConfig) -> dict:
    import json
    import time

    from tcal.data.corpora import as_corpus
    from tcal.data.teachers import load_teacher
    from tcal.evaluate.niah import check_lengths, niah_details
    from tcal.report.plots import plot_niah
    from tcal.train.checkpoint import partial_dir
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_device, resolve_dtype

    tasks = retrieval_tasks(cfg.task)
    out = check_out(cfg.out, "eval", cfg.overwrite)
    try:
        lengths = [int(n) for n in cfg.lengths.split(",") if n.strip()]
    except ValueError:
        raise TcalError(f"--lengths must be whole numbers of tokens like 512,1024, got {cfg.lengths!r}") from None
    if cfg.samples < 1:
        raise TcalError(f"--samples must be at least 1, got {cfg.samples}")
    if cfg.batch_size < 1:
        raise TcalError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    as_corpus(cfg.haystack)
    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    if tokenizer is None:
        raise TcalError(f"{cfg.model} has no tokenizer; retrieval reads and writes text: save one with the model")
    lengths = check_lengths(model, lengths)
    settings = {k: getattr(cfg, k) for k in ("model", "lengths", "samples", "seed", "haystack")}
    partial = partial_dir(out)
    state_file = partial / "niah.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if state.get("settings") != settings:
        state = {"settings": settings, "cells": {}}
    partial.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        for n in lengths:
            key = f"{task}@{n}"
            if key in state["cells"]:
                continue
            t0 = time.perf_counter()
            rows = niah_details(model, tokenizer, task=task, length=n, samples=cfg.samples, seed=cfg.seed,
                                haystack=cfg.haystack, batch_size=cfg.batch_size, progress=cfg.progress)
            state["cells"][key] = {"task": task, "length": n, "accuracy": sum(r["score"] for r in rows) / len(rows),
                                   "seconds": time.perf_counter() - t0, "samples": rows}
            write_json(state_file, state)
            print(f"{task} @ {n} tokens: {state['cells'][key]['accuracy']:.2f} "
                  f"({state['cells'][key]['seconds']:.0f} s)", flush=True)
    cells = [state["cells"][f"{t}@{n}"] for t in tasks for n in lengths]
    table = niah_markdown(cfg, tasks, lengths, cells)
    with atomic_dir(out) as tmp:
        write_json(tmp / "niah.json", {"settings": settings, "tasks": tasks, "lengths": lengths, "cells": cells})
        (tmp / "niah.md").write_text(table)
        plot_niah(cells, tmp / "niah.png", title=cfg.model)
        write_json(tmp / "tcal_config.json", {"stage": "eval", **dataclasses.asdict(cfg)})
    import shutil

    shutil.rmtree(partial, ignore_errors=True)
    print(table)
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return {"tasks": tasks, "lengths": lengths, "cells": cells}


def niah_markdown(cfg: EvalConfig, tasks, lengths, cells) -> str:
    acc = {(c["task"], c["length"]): c["accuracy"] for c in cells}
    secs = sum(c["seconds"] for c in cells)
    lines = [f"# Retrieval: {cfg.model}", "",
             f"- {cfg.samples} prompts per task and length, needle depths spread over 0..1, seed {cfg.seed}; "
             f"greedy decoding; score = fraction of expected answers found in the output (RULER string_match_all)",
             f"- haystack (real-text tasks): `{cfg.haystack}`, used for no calibration or training",
             f"- wall time {secs:.0f} s", "",
             "| task | " + " | ".join(f"{n:,}" for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    lines += [f"| {t} | " + " | ".join(f"{acc[(t, n)]:.2f}" for n in lengths) + " |" for t in tasks]
    return "\n".join(lines) + "\n"
