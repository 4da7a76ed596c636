"""The evaluation tasks: one module (or package, its library beside it) per kind of task, each holding its
:class:`~tcal.evaluate.task.Task` subclass as ``TASK``; the package finds them when it is imported, and
:func:`register` adds one from anywhere else. The tasks' flags are theirs too: each task declares the flags it reads
(:class:`~tcal.evaluate.task.Option`), and a command whose config derives from :class:`TaskArgs` (``tcal eval``:
:class:`EvalTaskArgs`) takes every registered task's flags, read from the registry when its command line is made, so
a task registered before the command runs has its flags whatever the order of the imports. A command turns its flags
into its tasks in one call (:func:`tcal.evaluate.plan.plan`); underneath::

    from tcal.evaluate import tasks
    built = tasks.build(parse_tasks("humaneval:20,single@1024"), tasks.options(cfg))  # one Task per kind, in order
    tasks.check_code_execution(built, cfg.allow_code_execution)                      # the one gate

Torch-free: the task modules import what they score with inside their methods.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Sequence
from typing import ClassVar

from tcal.evaluate.task import (
    CODE_EXECUTION_HELP,
    EXAMPLE,
    SETTINGS,
    TASKS_HELP,
    Option,
    Task,
    TaskOptions,
    TaskSpec,
    check_code_execution,
)
from tcal.utils.command_config import arg
from tcal.utils.errors import TcalError
from tcal.utils.flags import Reader

__all__ = ["TASKS", "EvalTaskArgs", "Task", "TaskArgs", "build", "check_code_execution", "find", "flags", "listing",
           "names", "options", "readers", "register", "task_args"]


def _discover() -> dict[str, type[Task]]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        task = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TASK", None)
        if isinstance(task, type) and issubclass(task, Task):
            found[task.name] = task
    return found


# name -> Task class
TASKS: dict[str, type[Task]] = {}


def _check_options(task: type[Task], known: dict[str, Option]) -> None:
    """Every option of ``task`` is a flag it declares or one of the command's settings, and a flag it shares with
    another task has the same default, type, choices and scope."""
    for o in task.options:
        if isinstance(o, Option):
            if o.name in SETTINGS or o.name in ("tasks", "allow_code_execution"):
                raise TcalError(f"task {task.name} declares --{o.name.replace('_', '-')}, which is a command setting; "
                                f"name it in options as {o.name!r}")
            other = known.get(o.name)
            if other is not None and (other.default, other.type, other.choices, other.eval_only) != (
                    o.default, o.type, o.choices, o.eval_only):
                raise TcalError(f"task {task.name} declares --{o.name.replace('_', '-')} unlike the tasks that "
                                "declare it already (default, type, choices or scope): declare it as they do")
        elif o not in SETTINGS:
            raise TcalError(f"task {task.name} reads {o!r}, which is no command setting ({', '.join(SETTINGS)}): "
                            "declare it as an Option")


def register(task: type[Task]) -> type[Task]:
    """Add a task kind (a :class:`Task` subclass) under its name; a name or alias is registered once. Its flags are
    every command's from then on (a command reads the registry when it makes its command line and its config)."""
    if not (isinstance(task, type) and issubclass(task, Task) and task.name):
        raise TcalError(f"{task!r} is not a Task subclass with a name")
    taken = [n for n in (task.name, *task.aliases) for t in TASKS.values() if t is not task and t.accepts(n)]
    if taken:
        raise TcalError(f"task name {taken[0]!r} is taken; register {task.__name__} under another name")
    _check_options(task, {o.name: o for t in TASKS.values() if t is not task for o in t.flags()})
    TASKS[task.name] = task
    return task


for _task in _discover().values():
    register(_task)


def find(name: str) -> type[Task] | None:
    return next((t for t in TASKS.values() if t.accepts(name)), None)


def names() -> str:
    """Every task name, for messages and --help."""
    return ", ".join(TASKS)


def flags(for_eval: bool) -> dict[str, Option]:
    """The task flags of ``tcal eval`` (``for_eval``: every task's) or of the commands that score curve points and
    ablation rows (the curve tasks' flags but those only tcal eval takes), by name, each with the help of every task
    that declares it."""
    found: dict[str, list[tuple[str, Option]]] = {}
    for t in TASKS.values():
        if not (for_eval or t.curve):
            continue
        for o in t.flags():
            if for_eval or not o.eval_only:
                found.setdefault(o.name, []).append((t.name, o))
    return {name: dataclasses.replace(decl[0][1], help="; ".join(f"{t}: {o.help}" for t, o in decl))
            for name, decl in found.items()}


@dataclasses.dataclass
class TaskArgs:
    """The task flags of a command that scores curve points or ablation rows (``tcal ablate``, ``distill``,
    ``recover``): ``--tasks``, ``--allow-code-execution`` and the flags its tasks declare (:func:`flags`), which
    are no dataclass fields: the command line adds them from the registry as it is now (:meth:`extra_args`), their
    given values stay in ``task_flags`` and read as attributes (``cfg.haystack``), each task flag's default where
    it was not given. :func:`settings` writes them as fields."""

    for_eval: ClassVar[bool] = False
    tasks: str = arg("", TASKS_HELP)
    allow_code_execution: bool = arg(False, CODE_EXECUTION_HELP)
    task_flags: dict = dataclasses.field(default_factory=dict, metadata={"flag": False})

    def __getattr__(self, name: str):
        if name != "task_flags" and not name.startswith("__"):
            declared = flags(type(self).for_eval)
            if name in declared:
                return self.__dict__.get("task_flags", {}).get(name, declared[name].default)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def extra_args(cls) -> dict[str, tuple[type, dataclasses.Field]]:
        """The task flags the command line adds to the config's fields (:mod:`tcal.utils.command_config`): every
        registered task's of this command's scope but those the command declares itself."""
        own = {f.name for f in dataclasses.fields(cls)}
        out = {}
        for o in flags(cls.for_eval).values():
            if o.name not in own:
                out[o.name] = (o.type if o.default is not None else o.type | None,
                               arg(o.default, o.help, **({"choices": o.choices} if o.choices else {})))
        return out

    @classmethod
    def extra_values(cls, values: dict) -> dict:
        """The config's keyword arguments for the task flags' ``values`` (by name): those given away from their
        defaults."""
        extra = cls.extra_args()
        return {"task_flags": {k: v for k, v in values.items() if k in extra and v != extra[k][1].default}}


@dataclasses.dataclass
class EvalTaskArgs(TaskArgs):
    """``tcal eval``'s task flags: every task's, those of how a whole evaluation runs too."""

    for_eval: ClassVar[bool] = True


def task_args(for_eval: bool) -> type:
    """The task flags of a command as a dataclass its config derives from (:class:`TaskArgs`, :class:`EvalTaskArgs`
    for ``tcal eval``)."""
    return EvalTaskArgs if for_eval else TaskArgs


def task_flags(cfg) -> tuple[str, ...]:
    """The task flags of ``cfg``'s command: ``--allow-code-execution`` and those its tasks declare."""
    if not isinstance(cfg, TaskArgs):
        return ()
    return ("allow_code_execution", *flags(type(cfg).for_eval))


def settings(cfg) -> dict:
    """``cfg`` as a record (``tcal_config.json``, a resumed run's settings): its fields, a task flag each, given or
    not, in the place of ``task_flags``."""
    record = dataclasses.asdict(cfg)
    if isinstance(cfg, TaskArgs):
        record.pop("task_flags")
        record.update({name: getattr(cfg, name) for name in flags(type(cfg).for_eval)})
    return record


def options(cfg=None, **settings) -> TaskOptions:
    """What tasks read: the defaults of every task flag and setting, the values of ``cfg``'s task flags, then the
    command's ``settings`` (:data:`~tcal.evaluate.task.SETTINGS`)."""
    values = {**SETTINGS, **{o.name: o.default for t in TASKS.values() for o in t.flags()}}
    if cfg is not None:
        values.update({name: getattr(cfg, name) for name in task_flags(cfg)})
    unknown = set(settings) - set(values)
    if unknown:
        raise TcalError(f"no task reads {', '.join(sorted(unknown))}")
    return TaskOptions(**{**values, **settings})


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
    return out + [Reader(k.name, tuple(f for f in k.option_names() if f in fields), False) for k in TASKS.values()
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
