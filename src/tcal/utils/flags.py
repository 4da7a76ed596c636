"""Flags a run does not read are refused, never ignored: one rule and one wording for every command.

Which settings a part of a run reads is declared once, by that part: an evaluation task by its options
(:attr:`tcal.evaluate.task.Task.options`), an init by its stages (:func:`tcal.conversion.inits.init_readers`), a
setting that only matters beside another by the reader declared with the flags (``--mix-frac`` beside
``--mix-data``: :func:`tcal.train.options.train_readers`). A command gathers those readers, each knowing whether this
run has it, and :func:`refuse_unread` stops at the first flag given away from its default that no reader of this
run reads::

    --kl-steps is read by the inits with a KL stage (taylor) only, and this run is --init copy: drop --kl-steps
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tcal.utils.errors import TcalError


@dataclass(frozen=True)
class Reader:
    """A part of a run that reads ``flags`` (config field names): ``name`` says who in a message, ``active`` whether
    this run has it."""

    name: str
    flags: tuple[str, ...]
    active: bool


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def unread(given, readers: Sequence[Reader], defaults=None) -> list[str]:
    """The fields of ``given`` set away from their defaults (``defaults``: the config class's) that some reader
    declares and no active reader reads, in the readers' order."""
    defaults = type(given)() if defaults is None else defaults
    active = {f for r in readers if r.active for f in r.flags}
    declared = dict.fromkeys(f for r in readers for f in r.flags)
    return [f for f in declared if f not in active and hasattr(given, f)
            and getattr(given, f) != getattr(defaults, f)]


def refuse_unread(given, readers: Sequence[Reader], run: str, defaults=None) -> None:
    """A one-line error for the first flag of ``given`` (the config as the user gave it, before any ``auto`` is
    resolved) that this ``run`` does not read (see the module docstring)."""
    for field in unread(given, readers, defaults):
        raise unread_error(flag_name(field), " or ".join(dict.fromkeys(r.name for r in readers if field in r.flags)),
                           run)


def unread_error(flag: str, readers: str, run: str) -> TcalError:
    """The one wording of a flag this run does not read."""
    return TcalError(f"{flag} is read by {readers} only, and this run is {run}: drop {flag}")


def as_given(cfg):
    """A copy of ``cfg`` as the user gave it: what :func:`refuse_unread` compares with the defaults once the command
    has resolved its ``auto`` settings."""
    return dataclasses.replace(cfg)


SEED_LIMIT = 2**64  # torch's and numpy's seeds are unsigned 64-bit numbers


def check_seed(seed: int, flag: str = "--seed") -> None:
    """A one-line error for a seed no random generator takes (negative, or past 64 bits)."""
    if not 0 <= seed < SEED_LIMIT:
        raise TcalError(f"{flag} must be between 0 and 2**64 - 1, got {seed}")
