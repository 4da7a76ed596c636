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


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help strings
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        base = _scalar_type(kind)
        parser.add_argument(flag, dest=f.name, type=base if base in (int, float, str) else str, default=default,
                            choices=f.metadata.get("choices"),
                            help=f"{help_text} (default: {str(default).replace('%', '%%')})")


def from_args(cls, ns: argparse.Namespace, **overrides):
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


# ---------------------------------------------------------------------------------------------
# Field groups shared by the commands (each defined once; a command that needs another default
# redefines the field and says why in its help)
# ---------------------------------------------------------------------------------------------

TEACHER_HELP = "teacher: built-in name (smollm2-135m), local HF directory, .gguf file or hub id"


@dataclasses.dataclass
class TeacherArgs:
    teacher: str = arg("smollm2-135m", TEACHER_HELP)


@dataclasses.dataclass
class DeviceArgs:
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")


@dataclasses.dataclass
class OutArgs:
    overwrite: bool = arg(False, "replace a finished output of the same command in --out (only tcal's own files "
                                 "are replaced; any other file there is kept)")


@dataclasses.dataclass
class CalibArgs:
    calib: str = arg("wiki:calib", "calibration corpus (Taylor-Calibrate inits only); disjoint from --eval")
    calib_window: int = arg(256, "calibration sequence length in tokens (reference: 256)")
    calib_windows: int = arg(4, "calibration sequences, the first N windows (reference: 4); Phase 2 holds out "
                                "the last quarter to pick its best state")
    align_steps: int = arg(300, "Phase 2 AdamW steps per layer (reference: 300)")

    def check_calib(self) -> None:
        if self.calib_window < 2:
            raise TcalError(f"--calib-window must be at least 2 tokens, got {self.calib_window}")
        if self.calib_windows < 2:
            raise TcalError(f"--calib-windows must be at least 2 (Phase 2 holds out the last quarter), "
                            f"got {self.calib_windows}")
        if self.align_steps < 0:
            raise TcalError(f"--align-steps must be >= 0, got {self.align_steps}")


@dataclasses.dataclass
class EvalArgs:
    eval: str = arg("wiki:eval", "held-out evaluation corpus (never used for calibration or training)")
    eval_window: int = arg(512, "evaluation window length in tokens")
    eval_windows: int = arg(64, "evaluation windows: the first N, non-overlapping (64 x 512 is the full protocol)")

    def check_eval(self) -> None:
        if self.eval_window < 2:
            raise TcalError(f"--eval-window must be at least 2 tokens, got {self.eval_window}")
        if self.eval_windows < 1:
            raise TcalError(f"--eval-windows must be at least 1, got {self.eval_windows}")


@dataclasses.dataclass
class GDNArgs:
    use_short_conv: bool = arg(False, "causal depthwise short conv (width 4) before q/k/v activations")
    output_gate: bool = arg(True, "SiLU output gate (W_g) on the per-head RMSNorm")
