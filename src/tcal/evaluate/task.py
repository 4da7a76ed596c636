"""What an evaluation task is to tcal: the spelling ``--tasks`` takes, the settings a task reads, and the
:class:`Task` interface every kind of evaluation implements (perplexity, retrieval, HumanEval, the harness, the
development answers' KL: :mod:`tcal.evaluate.tasks`).

One spelling for every command that evaluates (``tcal eval``, ``ablate``, ``distill``, ``recover``)::

    --tasks humaneval:20,single@1024,4096,tcal_cloze:200

Items are comma-separated; each is a task NAME, ``:N`` (how many of its items: problems, prompts per length,
samples, windows) and ``@L`` (a context length); a bare number after an item is one more length of it
(``single@1024,4096``). Torch-free: the command line reads it to build its flags.
"""
from __future__ import annotations

import re
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from tcal.utils.errors import TcalError, TcalWarning

_ITEM = re.compile(r"(?P<name>[A-Za-z][\w.\-/]*)(?P<mods>(?:[:@]\d+)*)")
EXAMPLE = "humaneval:20,single@1024,4096"


@dataclass(frozen=True)
class TaskSpec:
    """One item of ``--tasks``: a task name, how many of its items (None: the task's default) and the context
    lengths it runs at (empty: the task's default, or none)."""

    name: str
    count: int | None = None
    lengths: tuple[int, ...] = ()

    def __str__(self) -> str:
        return (self.name + (f":{self.count}" if self.count is not None else "")
                + ("@" + ",".join(str(n) for n in self.lengths) if self.lengths else ""))


def parse_tasks(text: str, flag: str = "--tasks") -> list[TaskSpec]:
    """``--tasks`` as specs, in the order given (empty text: none)."""
    specs: list[TaskSpec] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item.isdigit():  # one more context length of the item before
            if not specs or not specs[-1].lengths:
                raise TcalError(f"{flag} {text!r}: {item} follows no task with a context length; a bare number is "
                                f"one more length of the task before it, as in {EXAMPLE}")
            last = specs.pop()
            specs.append(TaskSpec(last.name, last.count, (*last.lengths, int(item))))
            continue
        m = _ITEM.fullmatch(item)
        if m is None:
            raise TcalError(f"{flag} {text!r}: {item!r} is not NAME, NAME:N or NAME@LENGTH; e.g. {flag} {EXAMPLE}")
        mods = re.findall(r"([:@])(\d+)", m["mods"])
        kinds = [k for k, _ in mods]
        if len(kinds) != len(set(kinds)):
            raise TcalError(f"{flag} {text!r}: {item!r} gives :N or @LENGTH twice; more lengths follow after commas, "
                            f"as in {EXAMPLE}")
        values = {k: int(v) for k, v in mods}
        if any(v < 1 for v in values.values()):
            raise TcalError(f"{flag} {text!r}: {item!r}: a count and a context length are at least 1")
        specs.append(TaskSpec(m["name"], values.get(":"), (values["@"],) if "@" in values else ()))
    if text.strip() and not specs:
        raise TcalError(f"{flag} {text!r} names no task; e.g. {flag} {EXAMPLE} (tcal eval --tasks list lists them)")
    return specs


def join_tasks(specs: Sequence[TaskSpec]) -> str:
    """The ``--tasks`` text of ``specs`` (what a deprecated spelling stands for)."""
    return ",".join(str(s) for s in specs)


@dataclass(frozen=True)
class Option:
    """A flag a task reads, declared by the task itself in :attr:`Task.options`: ``--NAME`` in every command that
    evaluates (``eval_only``: in ``tcal eval`` alone, a setting of how it runs the task that a curve point or an
    ablation row never reads), its help the words of each task that declares it. Tasks that share a flag
    (``--seed``, ``--batch-size``) each declare it, with the same default."""

    name: str  # the config field: --name-with-dashes
    default: object
    help: str  # what it is to the task that declares it
    kind: type | None = None  # int, float, str or bool; None: the default's type
    choices: tuple[str, ...] | None = None
    eval_only: bool = False

    @property
    def type(self) -> type:
        return self.kind or type(self.default)


# What every command that evaluates hands its tasks besides their flags, with the value a task sees where the command
# has no such setting: the model it scores as the user named it (tcal eval MODEL), the command's --data (ppl's text,
# answer_kl's instruct set), where and in which dtype the model runs, whether to draw progress bars.
SETTINGS = {"model": "", "data": "", "dtype": "float32", "device": "", "progress": False}


class TaskOptions(types.SimpleNamespace):
    """What a task reads (``task.opts``): the command's :data:`SETTINGS` and the value of every task flag, each
    flag's default where the command has none (:func:`tcal.evaluate.tasks.options` builds it)."""


PROMPT_STYLES = ("auto", "chat", "completion")  # tcal.evaluate.tasks.humaneval.problems.STYLES
SANDBOX_MODES = ("auto", "strict")  # tcal.evaluate.sandbox.MODES
CODE_EXECUTION_HELP = (
    "let the tasks that run code (humaneval) run the model's code (or the --completions) on this machine (required "
    "for them). Where the kernel allows it, each program runs in kernel namespaces of its own (its own processes "
    "only, no network, the filesystem read-only but its empty temporary directory), without your environment "
    "variables or any capability, under time, memory, file-size and process limits; elsewhere with process guards "
    "only (--sandbox says which; the report and the first line say which ran). On Linux x86-64 and arm64 the kernel "
    "also refuses its calls that signal other processes, run other programs, delete files or open sockets; "
    "everything it starts is killed afterwards, and a problem passes only once its check() has returned. It can "
    "still read the files your user can read (docs/evaluation.md says exactly what holds in each mode)")
TASKS_HELP = ("tasks to score, comma-separated: NAME[:N][@LENGTH,...], N = how many of its items (problems, prompts "
              f"per length, samples, windows), LENGTH = a context length in tokens; e.g. {EXAMPLE}. `tcal eval "
              "--tasks list` lists every task")


def deprecated(flags: Sequence[str], specs: Sequence[TaskSpec]) -> None:
    """One warning line for the old task flags a run used, with the ``--tasks`` they stand for."""
    if flags:
        verb = "is" if len(flags) == 1 else "are"
        warnings.warn(f"{' '.join(flags)} {verb} deprecated; this run is --tasks {join_tasks(specs)}", TcalWarning,
                      stacklevel=3)


class Progress:
    """What ``tcal eval`` hands :meth:`Task.run`: the work an interrupted run kept, and a way to keep more.

    ``resume(settings)`` returns the task's state (the kept entries where the settings match, else none);
    ``save(message)`` keeps the state as it is now and tells the user ``message``; ``tell(message)`` only tells
    it; ``load_s``: the seconds the command took to load the model."""

    load_s: float = 0.0

    def resume(self, settings: dict) -> dict:
        return {"settings": settings}

    def save(self, message: str) -> None:
        pass

    def tell(self, message: str) -> None:
        pass


class Task:
    """One kind of evaluation, built by a command from every ``--tasks`` spec of its kind.

    The life of a task, each step before the next:

    1. ``Task(specs, options)``: nothing is read yet; :meth:`check` then checks every argument and reads the
       task's inputs (a problems file, a corpus) before any model loads.
    2. :meth:`prepare` with the model, its tokenizer and, where there is one, the teacher: prompts are built, the
       model's limits checked.
    3. Generate or score: :meth:`probes` (one scorer per column: a training curve point, an ablation row;
       :meth:`measure` runs them all) or :meth:`run` (``tcal eval``: the whole evaluation, resumable).
    4. :meth:`report`: ``tcal eval``'s files (the command writes them).

    A new task is a subclass in one module of :mod:`tcal.evaluate.tasks` (``TASK = MyTask``), or registered with
    :func:`tcal.evaluate.tasks.register`; the defaults below make ``name``, ``summary``, :meth:`prepare` and
    :meth:`probes` enough for every command (docs/extending.md, *Adding an evaluation task*).
    """

    name: ClassVar[str] = ""  # what --tasks calls it
    aliases: ClassVar[tuple[str, ...]] = ()  # other names it answers to
    summary: ClassVar[str] = ""  # one line for --help and --tasks list
    usage: ClassVar[str] = ""  # how --tasks list spells it, where that is not NAME[:N][@L]
    title: ClassVar[str] = ""  # how messages and reports name it (default: name)
    counts: ClassVar[str] = ""  # what :N counts ("problems", "prompts per length"); "" = it takes no :N
    takes_lengths: ClassVar[bool] = False  # whether it takes @LENGTH
    # the flags it reads: an Option declares a flag of its own (the command line builds it from the declaration), a
    # name one of the command's SETTINGS (model, data, dtype, device, progress)
    options: ClassVar[tuple[str | Option, ...]] = ()
    runs_code: ClassVar[bool] = False  # runs what a model wrote: only behind --allow-code-execution
    curve: ClassVar[bool] = True  # scores a model at a training curve point or an ablation row
    text: ClassVar[bool] = True  # reads and writes text: needs the model's tokenizer
    needs_teacher: ClassVar[bool] = False  # compares the model with its teacher (the commands that have one)
    # its one column picks a distillation's best checkpoint (OUT/best): the point of the lowest score. Only a task
    # on held-out data may: an evaluation's own problems must not choose the model they then score.
    picks_best: ClassVar[bool] = False
    prints: ClassVar[bool] = False  # tcal eval prints its report, and writes it only where --out is given

    def __init__(self, specs: Sequence[TaskSpec], options: TaskOptions):
        self.specs = list(specs)
        self.opts = options  # tcal.evaluate.tasks.options
        for s in self.specs:
            if s.count is not None and not self.counts:
                raise TcalError(f"{self.name} takes no count: drop :{s.count} from {s}")
            if s.lengths and not self.takes_lengths:
                raise TcalError(f"{self.name} takes no context length: drop @{','.join(map(str, s.lengths))} "
                                f"from {s}")

    @classmethod
    def accepts(cls, name: str) -> bool:
        return name == cls.name or name in cls.aliases

    @classmethod
    def flags(cls) -> tuple[Option, ...]:
        """The flags it declares."""
        return tuple(o for o in cls.options if isinstance(o, Option))

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every flag and setting it reads, by config field (``allow_code_execution`` where it runs code)."""
        names = tuple(o.name if isinstance(o, Option) else o for o in cls.options)
        return (*names, "allow_code_execution") if cls.runs_code else names

    @classmethod
    def implied(cls, opts: TaskOptions) -> bool:
        """Whether a command with a teacher scores it without being asked (``answer_kl`` where ``--data`` holds
        development tasks); read only for tasks that need a teacher."""
        return False

    @property
    def label(self) -> str:
        """How reports name it."""
        return self.title or self.name

    @property
    def run_name(self) -> str:
        """How a message names this run of it."""
        return self.name

    @property
    def reads(self) -> tuple[str, ...]:
        """The flags this run of the task reads: its options, and the model (MODEL, its dtype and device)."""
        return (*self.option_names(), "model", "dtype", "device")

    @property
    def uses_model(self) -> bool:
        """Whether it scores the command's model (tcal eval loads one only for tasks that do)."""
        return True

    def code(self) -> str:
        """What it runs when :attr:`runs_code` ("the code the model writes")."""
        return "the code the model writes"

    def texts(self) -> list[str]:
        """The evaluation text it reads, which no training or calibration data may hold."""
        return []

    # -- 1. before any model loads --------------------------------------------------------------------------------

    def check(self) -> None:
        """Every argument and input, before any model loads; a one-line TcalError for the first bad one."""

    # -- 2. with the model ----------------------------------------------------------------------------------------

    def prepare(self, model, tokenizer, teacher=None) -> None:
        """Build what scoring needs (prompts from the tokenizer), check the model's limits."""

    # -- 3. generate or score -------------------------------------------------------------------------------------

    def probes(self) -> Mapping[str, Callable[[object], float]]:
        """One scorer per column (``single@1024``, ``humaneval``): model -> number, the same prompts each call."""
        raise TcalError(f"{self.name} does not score a model at a training curve point or an ablation row; run it "
                        "with tcal eval")

    def columns(self) -> list[str]:
        return list(self.probes())

    def measure(self, model) -> dict:
        """Every column's score of ``model`` as a JSON-able record (:meth:`values` reads the scores back)."""
        t0 = time.perf_counter()
        scores = {n: p(model) for n, p in self.probes().items()}
        return {"scores": scores, "seconds": time.perf_counter() - t0}

    def values(self, record: dict) -> dict[str, float]:
        return record["scores"]

    def heading(self, column: str) -> str:
        """A column's heading in a report's table."""
        return column

    def describe(self) -> str:
        """What its columns measure, for the reports of a curve or an ablation (after :meth:`prepare`)."""
        return f"{self.label} ({join_tasks(self.specs)}): {self.summary}"

    def targets(self) -> dict[str, str]:
        """Columns whose recovery ``tcal recover`` tabulates as shares of the teacher's score: {column: label}."""
        return {}

    # -- tcal eval ------------------------------------------------------------------------------------------------

    def check_eval(self) -> None:
        """What ``tcal eval``'s one report needs beyond :meth:`check` (before any model loads)."""

    @property
    def state(self) -> tuple[str, str, type | tuple[type, ...]] | None:
        """(file, key, entry type) of its kept work in OUT.partial; None: it keeps none."""
        return f"{self.name}.json", "scores", (int, float)

    def settings(self) -> dict:
        """What a resumed ``tcal eval`` must match to reuse kept work (and its report records)."""
        return {"model": self.opts.model, "tasks": join_tasks(self.specs), "dtype": self.opts.dtype}

    def known_settings(self) -> dict:
        """Those of the settings its kept work records that are known before the model loads (after :meth:`check`):
        ``tcal eval`` refuses kept work of other settings before loading anything."""
        return self.settings()

    def run(self, model, tokenizer, progress: Progress) -> dict:
        """The whole evaluation for ``tcal eval``, keeping each finished piece through ``progress``."""
        probes = self.probes()
        state = progress.resume(self.settings())
        state.setdefault("scores", {})
        for name, probe in probes.items():
            if name not in state["scores"]:
                state["scores"][name] = probe(model)
                progress.save(f"{name}: {state['scores'][name]:.4g}")
        return {"settings": state["settings"], "scores": {n: state["scores"][n] for n in probes}}

    def report(self, result: dict, title: str) -> dict[str, object]:
        """``tcal eval``'s files: {name: text, a JSON-able dict, or a function that writes the file at a path}."""
        lines = [f"# {self.label}: {title}", "", f"- {self.describe()}", "", "| column | score |", "|---|---:|"]
        lines += [f"| {n} | {v:.4f} |" for n, v in result["scores"].items()]
        return {f"{self.name}.json": result, f"{self.name}.md": "\n".join(lines) + "\n"}

    def headline(self, result: dict, files: dict) -> str:
        """What ``tcal eval`` prints once the task is done."""
        return str(files.get(f"{self.name}.md", ""))


def check_code_execution(tasks: Sequence[Task], allowed: bool) -> None:
    """The one gate in front of running what a model wrote: every task that runs code needs
    ``--allow-code-execution`` (the sandbox refuses too: :func:`tcal.evaluate.sandbox.require_allowed`)."""
    from tcal.evaluate.sandbox import require_allowed

    for t in tasks:
        if t.runs_code:
            require_allowed(allowed, t.name, t.code())
