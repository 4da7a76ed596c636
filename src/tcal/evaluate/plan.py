"""A command's tasks from its flags, in one function for every command that evaluates (:func:`plan`): ``--tasks``
and the old spellings each command still takes (declared as data, :class:`OldFlag`, and folded by :func:`fold`), the
tasks built with those a command with a teacher scores unasked (:meth:`~tcal.evaluate.task.Task.implied`), the one
code-execution gate, the refusal of flags no part of the run reads and the checks before any model loads; and the
held-out perplexity of ``--eval`` (:func:`held_out`), which every command but ``tcal eval`` scores, planned the same
way::

    tasks = plan(cfg, ABLATE, given=given, readers=init_readers(inits), where="tcal ablate --inits copy")
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tcal.evaluate import tasks as T
from tcal.evaluate.task import Task, TaskSpec, deprecated, parse_tasks
from tcal.utils.errors import TcalError
from tcal.utils.flags import Reader, flag_name, refuse_unread, unread_error

NAMES, ADDS, SIZES, RENAMES = "names", "adds", "sizes", "renames"


@dataclass(frozen=True)
class OldFlag:
    """A deprecated spelling of ``--tasks`` (a config field of its command) and what it stands for (``does``):

    - ``names``: its value names tasks, comma-separated (``spell``: how ``--tasks`` spells a name);
    - ``adds``: a value adds one spec of ``task``: a count (``part="count"``, 0 is off), context lengths
      (``part="lengths"``, a comma list) or nothing more (a switch); ``count_from``: the field whose value is the
      added spec's count (given away from its default, it needs this flag);
    - ``sizes``: its value sets the count or the context lengths (``part``) of every spec of ``task`` that does not
      state it; a run without ``task`` refuses it;
    - ``renames``: it is the old name of the task flag ``task``.
    """

    field: str
    does: str
    task: str = ""
    part: str = ""
    count_from: str = ""
    spell: Callable[[str], str] | None = None


@dataclass(frozen=True)
class Command:
    """What a command that evaluates says about its tasks."""

    name: str  # how messages name it ("tcal ablate"); "" for tcal eval, whose runs its tasks name
    whole: bool = False  # tcal eval: its tasks run whole evaluations; else they score curve points or ablation rows
    teacher: bool = False  # it has a teacher: the tasks that compare with one run, and join where implied
    default: tuple[TaskSpec, ...] = ()  # the tasks of a run that names none
    old: tuple[OldFlag, ...] = ()
    settings: tuple[str, ...] = ()  # its own flags only tasks read (tcal eval's --data, --dtype): refused where none does

    def run_words(self, names: Sequence[str]) -> str:
        """How a flag's message names a run of this command scoring the tasks ``names``."""
        names = ", ".join(dict.fromkeys(names))
        if not self.name:
            return names
        return f"{self.name} " + (f"scoring {names}" if names else "with no task")


def _default(cfg, field: str):
    return getattr(type(cfg)(), field)


def _count(flag: str, value, off: bool = False) -> int:
    if not isinstance(value, int) or value < 1:
        raise TcalError(f"{flag} must be at least 1{' (0 = off)' if off else ''}, got {value}")
    return value


def _lengths(flag: str, value) -> tuple[int, ...]:
    try:
        lengths = tuple(int(n) for n in str(value).split(",") if n.strip())
    except ValueError:
        raise TcalError(f"{flag} must be whole numbers of tokens like 512,1024, got {value!r}") from None
    if not lengths:
        raise TcalError(f"{flag} is empty; give context lengths in tokens, e.g. {flag} 512,1024")
    if min(lengths) < 1:
        raise TcalError(f"{flag} must be at least 1, got {value}")
    return lengths


def fold(cfg, command: Command) -> tuple[list[TaskSpec], list[str], dict]:
    """(specs, the old flags used, the task flags they set): ``--tasks`` with ``command``'s old spellings folded in,
    the specs they name or add after those of ``--tasks`` in the order the flags are declared, then the command's
    default where none is named; then the sizes and the old names of task flags."""
    specs, used, renamed = parse_tasks(cfg.tasks), [], {}
    for o in (o for o in command.old if o.does in (NAMES, ADDS)):
        value, flag = getattr(cfg, o.field), flag_name(o.field)
        if o.does == NAMES and str(value).strip():
            used.append(flag)
            specs += [TaskSpec(o.spell(n) if o.spell else n) for n in (n.strip() for n in value.split(",")) if n]
        elif o.does == ADDS and value not in (None, "", 0, False):
            used.append(flag)
            count = _count(flag, value, off=True) if o.part == "count" else None
            if o.count_from:
                given = getattr(cfg, o.count_from)
                count = _count(flag_name(o.count_from), given)
                used += [flag_name(o.count_from)] if given != _default(cfg, o.count_from) else []
            specs.append(TaskSpec(o.task, count, _lengths(flag, value) if o.part == "lengths" else ()))
        elif o.does == ADDS and o.count_from and getattr(cfg, o.count_from) != _default(cfg, o.count_from):
            raise unread_error(flag_name(o.count_from), flag, command.run_words([s.name for s in specs]))
    specs = specs or list(command.default)
    for o in (o for o in command.old if o.does in (SIZES, RENAMES)):
        value, flag = getattr(cfg, o.field), flag_name(o.field)
        if o.does == SIZES and value is not None:
            used.append(flag)
            value = _lengths(flag, value) if o.part == "lengths" else _count(flag, value)
            kind = T.TASKS.get(o.task) or T.find(o.task)
            if not any(kind.accepts(s.name) for s in specs):
                raise unread_error(flag, o.task, command.run_words([s.name for s in specs]))
            specs = [dataclasses.replace(s, **{o.part: value}) if kind.accepts(s.name) and not getattr(s, o.part)
                     else s for s in specs]
        elif o.does == RENAMES and value != _default(cfg, o.field):
            used.append(flag)
            now = getattr(cfg, o.task)
            if now not in (_default(cfg, o.task), value):
                raise TcalError(f"{flag} ({value}) is the old name of {flag_name(o.task)} ({now}): give it once, as "
                                f"{flag_name(o.task)}")
            renamed[o.task] = value
    return specs, used, renamed


def plan(cfg, command: Command, *, given=None, readers: Iterable[Reader] | Callable[[list[Task]], Iterable[Reader]] = (),
         where: str = "", check: bool = True, **settings) -> list[Task]:
    """The tasks of a run of ``command`` with the flags ``cfg``, each step before the next:

    1. ``--tasks`` with the old spellings folded in (:func:`fold`; a one-line warning names what they stand for);
    2. one task per kind, built with the tasks the command scores unasked, ``settings`` handed to them besides
       their flags (:data:`~tcal.evaluate.task.SETTINGS`);
    3. the one code-execution gate;
    4. a flag of ``given`` (``cfg`` as the user gave it, before the command resolved its ``auto`` settings; default
       ``cfg``) that no part of this run reads is refused (:mod:`tcal.utils.flags`): the command's own ``readers``
       (its inits, its training flags; a function of the built tasks where they depend on them), then the tasks';
       ``where``: the command as this run spells it in the message (``tcal ablate --inits copy``);
    5. each task's arguments and inputs (:meth:`~tcal.evaluate.task.Task.check`), unless ``check`` is False
       (``tcal eval`` reads them once its output directory is checked).
    """
    specs, used, renamed = fold(cfg, command)
    deprecated(used, specs)
    options = T.options(cfg, **settings, **renamed)
    if command.teacher:
        specs += [TaskSpec(k.name) for k in T.TASKS.values()
                  if k.needs_teacher and not any(k.accepts(s.name) for s in specs) and k.implied(options)]
    built = T.build(specs, options, where=command.name, curve=not command.whole)
    for t in built:
        if t.needs_teacher and not command.teacher:
            raise TcalError(f"{t.name} compares a model with its teacher, and {command.name or 'tcal eval'} reads one "
                            "model: it scores in tcal distill and tcal recover")
    T.check_code_execution(built, cfg.allow_code_execution)
    own = list(readers(built) if callable(readers) else readers)
    tasks = T.readers(built, (*T.task_flags(cfg), *command.settings), teacher=command.teacher)
    refuse_unread(cfg if given is None else given, [*own, *tasks], run_words(command, built, where))
    if check:
        for t in built:
            t.check()
    return built


def run_words(command: Command, built: Sequence[Task], where: str = "") -> str:
    """How a flag's message names this run of ``command`` (``where``: the command as this run spells it, e.g.
    ``tcal ablate --inits copy``)."""
    return dataclasses.replace(command, name=where or command.name).run_words([t.run_name for t in built])


# the held-out perplexity every command but tcal eval scores: the ppl task alone, planned like any command's tasks
HELD_OUT = Command("--eval", whole=True)


def held_out(domains: Sequence[str], window: int, windows: int, *, progress: bool = False):
    """The held-out perplexity of a command's ``--eval`` (its ``domains``), ``--eval-window`` and
    ``--eval-windows``: the ``ppl`` task, ``ppl:WINDOWS@WINDOW`` on each domain (:mod:`tcal.evaluate.tasks.ppl`), not
    checked yet (its :meth:`~tcal.evaluate.task.Task.check` reads every domain)."""
    cfg = T.TaskArgs(tasks=str(TaskSpec("ppl", windows, (window,))))
    return plan(cfg, HELD_OUT, check=False, data=list(domains), progress=progress)[0]


__all__ = ["ADDS", "HELD_OUT", "NAMES", "RENAMES", "SIZES", "Command", "OldFlag", "fold", "held_out", "plan",
           "run_words"]
