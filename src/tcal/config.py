"""Typed stage configs <-> argparse flags, one dataclass per stage.

Each dataclass field becomes ``--field-name``; the field's ``metadata["help"]`` is its help text.
The resolved config is written into every output directory (``tcal_config.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing


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
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        base = _scalar_type(kind)
        parser.add_argument(flag, dest=f.name, type=base if base in (int, float, str) else str, default=default,
                            choices=f.metadata.get("choices"), help=f"{help_text} (default: {default})")


def from_args(cls, ns: argparse.Namespace, **overrides):
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)
