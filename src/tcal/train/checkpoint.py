"""Where a run keeps its progress and how models go to and from disk.

``OUT.partial/`` holds a run in progress: ``checkpoint/`` = the model (safetensors) + ``resume/``
(optimizer, RNG and loop state). A finished run is ``OUT/`` with its ``report.json``.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from tcal.data.teachers import load_model_dir, load_teacher
from tcal.models.modeling_hybrid import HybridForCausalLM
from tcal.utils.partial import partial_dir

__all__ = ["checkpoint_dir", "finished_report", "has_checkpoint", "legacy_run", "load_model",
           "load_model_and_tokenizer", "partial_dir", "save_model"]


def save_model(model, directory: Path) -> None:
    if isinstance(model, HybridForCausalLM):
        model.save_pretrained(directory, atomic=False)
    else:
        model.save_pretrained(directory)


def load_model(directory, dtype=torch.float32):
    return load_model_dir(directory, dtype, require_tokenizer=False)[0]


def load_model_and_tokenizer(spec: str, *, dtype=torch.float32, device="cpu"):
    """A model directory (tokenizer optional) or any :func:`tcal.teachers.load_teacher` spec."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        model, tok = load_model_dir(path, dtype, require_tokenizer=False)
        return model.to(device).eval(), tok
    return load_teacher(spec, dtype=dtype, device=device)


def checkpoint_dir(partial: Path) -> Path | None:
    ck = partial / "checkpoint"
    if (ck / "resume" / "state.json").is_file():
        return ck
    # killed between the two renames of atomic_dir: the previous checkpoint is still there
    for old in sorted(partial.glob(".checkpoint.old-*")):
        if (old / "resume" / "state.json").is_file():
            return old
    return None


def has_checkpoint(out) -> bool:
    p = partial_dir(out)
    return p.is_dir() and checkpoint_dir(p) is not None


# what a distillation run writes into its partial folder (a recover run's too): adopted from a run of a tcal that
# did not mark the folder, where it holds a checkpoint
RUN_FILES = ("checkpoint", ".checkpoint.old-*", "best", "curve.csv", "timing.csv", "teacher_scores.json",
             "report.partial.json")


def legacy_run(partial: Path) -> tuple[list[str], dict | None] | None:
    """(the files a run wrote, its settings) of an unmarked partial folder that holds a checkpoint, else None."""
    from tcal.utils.atomic import tree_files

    ck = checkpoint_dir(partial)
    if ck is None:
        return None
    try:
        settings = json.loads((ck / "resume" / "state.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = []
    for pattern in RUN_FILES:
        for p in sorted(partial.glob(pattern)):
            rel = p.relative_to(partial).as_posix()
            files += [f"{rel}/{f}" for f in tree_files(p, skip=())] if p.is_dir() else [rel]
    return files, settings


def finished_report(out) -> dict | None:
    f = Path(out) / "report.json"
    if f.is_file():
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):
            return None
    return None


def start_partial(out, resume: bool, settings: dict | None = None, free=None):
    """The run's unfinished work (:func:`tcal.utils.partial.open_work`): ``OUT.partial`` resumed where it holds a
    checkpoint (with ``resume``, and the same ``settings`` but ``free`` ones), started over where it holds none,
    refused where tcal did not write it."""
    from tcal.train.options import RESUME_FREE, changed_settings
    from tcal.utils.partial import open_work

    free = RESUME_FREE if free is None else free
    return open_work(out, "distill", settings=settings, resume=resume, progress=lambda w: has_checkpoint(out),
                     changed=lambda saved, now: changed_settings(saved, now, free=free), legacy=legacy_run)


@contextlib.contextmanager
def removed_unless_resumable(out, work, enabled: bool = True):
    """A run that fails before its first checkpoint leaves no partial directory behind: there is
    nothing to resume, and it must not block the next run. ``enabled``: whether this process owns
    the output (rank 0 under torchrun)."""
    try:
        yield
    except BaseException:
        if enabled and not has_checkpoint(out):
            work.discard()
        raise


def publish_run(out, student, tokenizer, files: dict, *, best: bool = False, work=None) -> None:
    """Write a finished run's directory ``out`` in one rename: the trained model and tokenizer, the checkpoint the
    development answers picked (``best``: OUT/best, from the partial folder) and the command's ``files`` ({name:
    text, a JSON-able dict, or a function that writes the file at a path}); then discard its unfinished work
    (``work``: its :class:`~tcal.utils.partial.Work`)."""
    from tcal.utils.atomic import atomic_dir, write_json
    from tcal.utils.partial import Work

    out = Path(out)
    work = work if work is not None else Work(partial_dir(out), "distill")
    with atomic_dir(out) as tmp:
        save_model(student, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if best and (work.path / "best").is_dir():
            (tmp / "best").mkdir()
            work.take("best", tmp / "best")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "best")
        for name, content in files.items():
            if callable(content):
                content(tmp / name)
            elif isinstance(content, str):
                (tmp / name).write_text(content)
            else:
                write_json(tmp / name, content)
    work.discard()
