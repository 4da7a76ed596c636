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

from dataclasses import dataclass

from tcal.evaluate.plan import NAMES, SIZES, Command, OldFlag
from tcal.evaluate.task import TaskSpec
from tcal.evaluate.tasks import task_args
from tcal.evaluate.tasks.lm_eval import spelled
from tcal.utils.command_config import DEFAULT_TEACHER, DeviceArgs, OutArgs, arg
from tcal.utils.partial import MARK

DEFAULT_OUT = "runs/eval"  # where the tasks that always write a report write it


@dataclass
class EvalConfig(task_args(for_eval=True), DeviceArgs, OutArgs):
    model: str = arg(DEFAULT_TEACHER, "a saved tcal hybrid directory, or any teacher spec")
    tasks: str = arg("", "tasks to score, comma-separated: NAME[:N][@LENGTH,...], N = how many of its items "
                         "(problems, prompts per length, samples, windows), LENGTH = a context length in tokens; e.g. "
                         "humaneval:20,single@1024,4096; default ppl. `--tasks list` lists every task")
    data: str = arg("wiki:eval", "ppl: corpus spec or file path")
    out: str = arg("", f"output directory (written atomically); default {DEFAULT_OUT}, and none for ppl alone, which "
                       "then prints its report only")
    progress: bool = arg(True, "progress bars")
    dtype: str = arg("float32", "float32 or bfloat16")
    # the old spellings, each mapped onto --tasks (OLD_FLAGS)
    task: str = arg("", "deprecated, use --tasks: ppl, niah, a comma list of retrieval tasks, humaneval, or list")
    lm_eval: str = arg("", "deprecated, use --tasks tcal_lastword,tcal_cloze or lm-eval/NAME")
    lengths: str | None = arg(None, "deprecated, use --tasks TASK@L1,L2: retrieval context lengths")
    samples: int | None = arg(None, "deprecated, use --tasks TASK:N: retrieval prompts per task and length")
    limit: int | None = arg(None, "deprecated, use --tasks humaneval:N: the first N problems")
    lm_eval_limit: int | None = arg(None, "deprecated, use --tasks NAME:N: harness samples per task")
    window: int | None = arg(None, "deprecated, use --tasks ppl@L: tokens per perplexity window")
    windows: int | None = arg(None, "deprecated, use --tasks ppl:N: perplexity windows")


# the old spellings of --tasks: what each stands for (tcal.evaluate.plan.fold)
OLD_FLAGS = (OldFlag("task", NAMES), OldFlag("lm_eval", NAMES, spell=spelled),
             OldFlag("lengths", SIZES, "niah", "lengths"), OldFlag("samples", SIZES, "niah", "count"),
             OldFlag("limit", SIZES, "humaneval", "count"), OldFlag("lm_eval_limit", SIZES, "lm-eval", "count"),
             OldFlag("window", SIZES, "ppl", "lengths"), OldFlag("windows", SIZES, "ppl", "count"))
EVAL = Command("", whole=True, default=(TaskSpec("ppl"),), old=OLD_FLAGS, settings=("data", "dtype", "device"))


def build_tasks(cfg: EvalConfig):
    """This run's tasks (:func:`tcal.evaluate.plan.plan`), every argument checked before any file is written or model
    loaded but their inputs (those are read by :meth:`Task.check`, after the output directory is checked)."""
    from tcal.evaluate.plan import plan
    from tcal.utils.errors import TcalError
    from tcal.utils.flags import Reader

    def readers(built):  # flags that only matter where a task loads the model or the run writes its report
        return [Reader("the tasks that load the model", ("dtype", "device"), False),
                Reader("a run that writes its report (--out)", ("overwrite",), output(cfg, built) is not None)]

    built = plan(cfg, EVAL, readers=readers, check=False, model=cfg.model, data=cfg.data, dtype=cfg.dtype,
                 progress=cfg.progress)
    if not any("model" in t.reads for t in built) and cfg.model != EvalConfig().model:
        from tcal.evaluate.plan import run_words

        raise TcalError(f"this run ({run_words(EVAL, built)}) scores answers already written: no model is read, so "
                        f"drop MODEL ({cfg.model})")
    if any(t.uses_model for t in built):
        from tcal.utils.runtime import resolve_device

        device = resolve_device(cfg.device)  # one tcal can use, before anything loads
        for t in built:
            t.opts.device = device
    for t in built:
        if len(built) > 1 and not t.uses_model:
            raise TcalError(f"{t.run_name} runs on its own (it reads no model): run it and "
                            f"{', '.join(x.run_name for x in built if x is not t)} separately")
        t.check_eval()
    return built


def output(cfg: EvalConfig, built) -> str | None:
    """Where this run writes its report: --out, else the default for tasks that always write one (None: ppl alone
    prints its report)."""
    if cfg.out:
        return cfg.out
    return DEFAULT_OUT if any(not t.prints for t in built) else None


def run(cfg: EvalConfig):
    """Every task of ``--tasks``: the result of the one task, or {task: result} for several."""
    from tcal.evaluate import kept as K
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
        from tcal.utils.partial import open_work, read_settings

        cfg.out = where
        out = check_out(where, "eval", cfg.overwrite)
        # eval resumes whatever it kept, of the same model files only
        work = open_work(out, "eval", resumes=False, legacy=K.legacy_eval,
                         settings=read_settings({"model": cfg.model}, ("model",)))
        kept = K.kept_states(work, built)
    for t in built:
        t.check()
        if work is not None:
            K.check_known(work, t, kept.get(t.name))  # kept work of other settings: refused before anything loads
    model = tokenizer = None
    load_s = 0.0
    if any(t.uses_model for t in built):
        model, tokenizer, load_s = _load(cfg, built)
    results = {}
    say = lambda message: print(message, flush=True)  # noqa: E731
    for t in built:
        t.prepare(model, tokenizer)
        results[t.name] = t.run(model, tokenizer, K.Kept(work, t, kept.get(t.name), load_s, say) if out else
                                K.Told(say))
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
    from tcal.evaluate.tasks import settings
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
        write_json(tmp / "tcal_config.json", {"stage": "eval", **settings(cfg),
                                              "tasks": join_tasks([s for t in built for s in t.specs])})
    work.discard()  # tcal's own unfinished work, now finished
    for t in built:
        print(t.headline(results[t.name], files[t.name]))
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")


PARTIAL_MARK = MARK  # what makes OUT.partial tcal's own (tcal.utils.partial)
