"""Typed stage configs <-> argparse flags, one dataclass per stage.

Each dataclass field becomes ``--field-name``; the field's ``metadata["help"]`` is its help text.
The resolved config is written into every output directory (``tcal_config.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from tcal.utils.errors import TcalError


def arg(default, help: str, **extra):
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def _scalar_type(kind):
    """``int | None`` -> int."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if args else kind


def _add_flag(parser: argparse.ArgumentParser, name: str, kind, f: dataclasses.Field) -> None:
    flag = "--" + name.replace("_", "-")
    help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help strings
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if kind is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return
    base = _scalar_type(kind)
    parser.add_argument(flag, dest=name, type=base if base in (int, float, str) else str, default=default,
                        choices=f.metadata.get("choices"),
                        help=f"{help_text} (default: {str(default).replace('%', '%%')})")


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """``cls``'s fields as flags (but those in ``skip`` and those whose metadata says ``flag=False``), then the flags
    its ``extra_args()`` names where it has one: {name: (type, field)}, read when the parser is made (the task flags
    of :class:`tcal.evaluate.tasks.TaskArgs`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in skip and f.metadata.get("flag", True):
            _add_flag(parser, f.name, hints[f.name], f)
    for name, (kind, f) in (cls.extra_args() if hasattr(cls, "extra_args") else {}).items():
        _add_flag(parser, name, kind, f)


def from_args(cls, ns: argparse.Namespace, **overrides):
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
              if f.metadata.get("flag", True) and hasattr(ns, f.name)}
    if hasattr(cls, "extra_values"):
        values.update(cls.extra_values({k: v for k, v in vars(ns).items()}))
    values.update(overrides)
    return cls(**values)


# ---------------------------------------------------------------------------------------------
# Field groups shared by the commands (each defined once; a command that needs another default
# redefines the field and says why in its help)
# ---------------------------------------------------------------------------------------------

# The teacher every command takes unless told otherwise: a built-in of tcal.data.teacher_table (here, below it, so
# that every command's flags read it without the table)
DEFAULT_TEACHER = "smollm2-135m"
TEACHER_HELP = f"teacher: built-in name ({DEFAULT_TEACHER}), local HF directory, .gguf file or hub id"


@dataclasses.dataclass
class TeacherArgs:
    teacher: str = arg(DEFAULT_TEACHER, TEACHER_HELP)


@dataclasses.dataclass
class DeviceArgs:
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")


@dataclasses.dataclass
class OutArgs:
    overwrite: bool = arg(False, "replace a finished output of the same command in --out (only tcal's own files "
                                 "are replaced; any other file there is kept)")


# The calibration text of every calibrated init unless --calib says otherwise: Wikipedia and Shakespeare in equal
# shares. It generalises better than wiki:calib alone to text neither calibrates on, for a little on wiki:eval
# (docs/results.md, *Calibration text*); neither part is in the default training pool, and both are disjoint from every
# :eval split. The calibration flags themselves, with the named budgets they pick, are tcal.taylor.budget.CalibArgs.
DEFAULT_CALIB = "wiki:calib+shakespeare:calib"


@dataclasses.dataclass
class EvalArgs:
    eval: str = arg("auto", "held-out evaluation corpus (never used for calibration or training); auto: the "
                            "teacher's home domain, wiki:eval, or code:eval for the code teachers")
    eval_window: int = arg(512, "evaluation window length in tokens")
    eval_windows: int = arg(64, "evaluation windows: the first N, non-overlapping (64 x 512 is the full protocol)")

    def eval_list(self) -> list[str]:
        """``--eval a,b,c`` -> [a, b, c]: every table reports each of these held-out domains."""
        specs = [s.strip() for s in self.eval.split(",")] if "," in self.eval and "\n" not in self.eval else [self.eval]
        return specs

    def check_eval(self) -> None:
        specs = self.eval_list()
        if any(not s for s in specs) or len(set(specs)) != len(specs):
            raise TcalError(f"--eval {self.eval!r} has an empty or repeated domain; e.g. --eval wiki:eval,sotu:eval")
        if self.eval_window < 2:
            raise TcalError(f"--eval-window must be at least 2 tokens, got {self.eval_window}")
        if self.eval_windows is not None and self.eval_windows < 1:
            raise TcalError(f"--eval-windows must be at least 1, got {self.eval_windows}")


@dataclasses.dataclass
class GDNArgs:
    use_short_conv: bool = arg(False, "causal depthwise short conv (width 4) before q/k/v activations")
    output_gate: bool = arg(True, "SiLU output gate (W_g) on the per-head RMSNorm")
