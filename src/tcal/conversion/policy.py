"""Keep specs: which layers stay softmax attention, as an explicit list or a policy (plain data, no torch).

    0,4,8         explicit list
    uniform:K     K layers evenly spaced, layer 0 always kept
    ar:K          attention removal (scored by tcal.conversion.select)
    ga:K          one-attention students (scored by tcal.conversion.select)
    niah:K        attention removal scored by retrieval (scored by tcal.conversion.select)
K may be a fraction of the layers: uniform:25%.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from tcal.utils.errors import TcalError

POLICIES = ("uniform", "ar", "ga", "niah")


@dataclass
class Policy:
    kind: str  # "list" or one of POLICIES
    k: int
    layers: list[int] | None = None  # for "list"


def parse_keep(spec: str) -> list[int] | str:
    """'0,4,8' -> [0, 4, 8]; anything else (a policy such as 'uniform:8') is passed through."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if parts and all(p.lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    return spec


def parse_policy(spec, num_layers: int) -> Policy:
    """'0,4,8' | [0, 4, 8] | 'uniform:8' | 'ar:25%' -> Policy."""
    if isinstance(spec, (list, tuple)):
        return Policy("list", len(spec), [layer_index(i) for i in spec])
    spec = str(spec).strip()
    keep = parse_keep(spec)
    if isinstance(keep, list):
        return Policy("list", len(keep), keep)
    kind, sep, count = spec.partition(":")
    if not sep or kind not in POLICIES:
        raise TcalError(
            f"unknown keep policy {spec!r}; use a list like 0,4,8 or one of "
            f"{', '.join(p + ':K' for p in POLICIES)} (K a count or a percentage like 25%)"
        )
    try:
        k = round(num_layers * float(count[:-1]) / 100) if count.endswith("%") else int(count)
    except ValueError:
        raise TcalError(f"keep policy {spec!r}: K must be a whole number or a percentage, got {count!r}") from None
    if k < 1:
        raise TcalError(f"keep policy {spec!r} keeps {k} layers; keep at least 1 attention layer")
    if k >= num_layers:
        raise TcalError(f"keep policy {spec!r} keeps {k} of {num_layers} layers: nothing would be converted; "
                        f"K must be below {num_layers}")
    return Policy(kind, k)


def layer_index(i) -> int:
    """An integer layer index (int, numpy or torch integer); 0.5, '4' or True are refused rather
    than silently rounded or parsed."""
    if isinstance(i, bool):
        raise TcalError(f"keep must list integer layer indices, got {i!r}")
    try:
        return operator.index(i)
    except TypeError:
        raise TcalError(f"keep must list integer layer indices, got {i!r}") from None


def uniform_layers(k: int, num_layers: int) -> list[int]:
    """k layers spread evenly over num_layers, always including layer 0 (every L/k-th)."""
    return sorted({math.floor(i * num_layers / k) for i in range(k)})


def top_k(scores: list[float], k: int, largest: bool) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i] if largest else scores[i], i))
    return sorted(order[:k])
