"""The evaluation tasks: one module per kind of task, each holding its :class:`~tcal.evaluate.task.Task` subclass as
``TASK``; the package finds them when it is imported, and :func:`register` adds one from anywhere else. Every
command that evaluates builds its tasks here::

    from tcal.evaluate import tasks
    built = tasks.build(parse_tasks("humaneval:20,single@1024"), options)   # one Task per kind, in order
    tasks.check_code_execution(built, cfg.allow_code_execution)              # the one gate

Torch-free: the task modules import what they score with inside their methods.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence

from tcal.evaluate.task import EXAMPLE, Task, TaskOptions, TaskSpec, check_code_execution
from tcal.utils.errors import TcalError
from tcal.utils.flags import Reader

__all__ = ["TASKS", "Task", "build", "check_code_execution", "find", "listing", "names", "readers", "register"]


def _discover() -> dict[str, type[Task]]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        task = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TASK", None)
        if isinstance(task, type) and issubclass(task, Task):
            found[task.name] = task
    return found


# name -> Task class
TASKS: dict[str, type[Task]] = _discover()


def register(task: type[Task]) -> type[Task]:
    """Add a task kind (a :class:`Task` subclass) under its name; a name or alias is registered once."""
    if not (isinstance(task, type) and issubclass(task, Task) and task.name):
        raise TcalError(f"{task!r} is not a Task subclass with a name")
    taken = [n for n in (task.name, *task.aliases) for t in TASKS.values() if t is not task and t.accepts(n)]
    if taken:
        raise TcalError(f"task name {taken[0]!r} is taken; register {task.__name__} under another name")
    TASKS[task.name] = task
    return task


def find(name: str) -> type[Task] | None:
    return next((t for t in TASKS.values() if t.accepts(name)), None)


def names() -> str:
    """Every task name, for messages and --help."""
    return ", ".join(TASKS)


def build(specs: Sequence[TaskSpec], options: TaskOptions, *, flag: str = "--tasks",
          where: str = "", curve: bool = False) -> list[Task]:
    """One :class:`Task` per kind named in ``specs``, holding every spec of its kind, in the order of their first
    spec. ``curve``: every task must score a model at a curve point or an ablation row (``where`` names the command
    for the message). Arguments are not checked yet (:meth:`Task.check`)."""
    groups: dict[type[Task], list[TaskSpec]] = {}
    for s in specs:
        kind = find(s.name)
        if kind is None and s.name == "list":
            raise TcalError(f"{flag} list lists the tasks, and names none to run: give it alone, as tcal eval --tasks "
                            f"list, or name tasks ({names()})")
        if kind is None:
            raise TcalError(f"unknown task {s.name!r} in {flag}; tasks: {names()} (tcal eval --tasks list says "
                            f"what each does); e.g. {flag} {EXAMPLE}")
        groups.setdefault(kind, []).append(s)
    built = [kind(group, options) for kind, group in groups.items()]
    if curve:
        for t in built:
            if not t.curve:
                raise TcalError(f"{t.name} does not score a model at a curve point or an ablation row, so {where} "
                                "does not run it; run it with tcal eval")
    return built


def readers(built: Sequence[Task], fields, teacher: bool = False) -> list[Reader]:
    """Who reads each of ``fields`` (the command's flags that only tasks read, :mod:`tcal.utils.flags`): every task
    of this run (what this run of it reads) and every kind of task (what it can read); ``teacher``: the command has
    one, so the tasks that compare with it count too."""
    fields = set(fields)
    out = [Reader(t.run_name, tuple(f for f in t.reads if f in fields), True) for t in built]
    return out + [Reader(k.name, tuple(f for f in k.options if f in fields), False) for k in TASKS.values()
                  if teacher or not k.needs_teacher]


def listing() -> str:
    """``tcal eval --tasks list``: every task, what it does and what its :N counts."""
    lines = []
    for t in TASKS.values():
        spelling = t.usage or t.name + (":N" if t.counts else "") + ("@L" if t.takes_lengths else "")
        what = t.summary + (f" (:N = {t.counts})" if t.counts else "")
        lines.append(f"{spelling:<16} {what}" if len(spelling) < 16 else f"{spelling}\n{'':<16} {what}")
        if t.aliases and not t.usage:
            lines.append(f"{'':<16}   also: {', '.join(t.aliases)}")
    return "\n".join(lines)
