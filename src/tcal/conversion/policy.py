"""Keep specs: which layers stay softmax attention, as an explicit list or a policy (plain data, no torch).

    0,4,8         explicit list
    uniform:K     K layers evenly spaced, layer 0 always kept
    interval:K    attention last in every K layers: layer i is kept when (i + 1) % K == 0 (Qwen3.5's own placement,
                  the only one SGLang runs); K is the period, a whole number of at least 2
    ar:K          attention removal (scored by tcal.conversion.select)
    ga:K          one-attention students (scored by tcal.conversion.select)
    niah:K        attention removal scored by retrieval (scored by tcal.conversion.select)
    answer:K      attention removal scored by an instruct teacher's answers to code tasks (tcal.conversion.select)
    auto          uniform:50%, scoped to the sliding-window layers on a teacher that mixes them with global ones
K may be a fraction of the layers: uniform:25%.
A policy may be scoped to one attention type with @sliding or @full (for teachers that mix sliding-window and
global layers, e.g. Gemma 3): it converts only layers of that type, K counts among them, and every layer of
the other type stays attention: uniform:50%@sliding keeps half of the sliding-window layers and every global one.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

from tcal.utils.errors import TcalError

POLICIES = ("uniform", "interval", "ar", "ga", "niah", "answer")
AUTO = "auto"
INTERVAL = "interval"
KEEP_HELP = ("layers kept as softmax attention: a list like 0,4,8, or a policy " +
             ", ".join(f"{p}:K" for p in POLICIES) + " (K a count or a percentage like 50%; for interval the "
             "period: layer i is kept when (i + 1) % K == 0, the placement SGLang runs), scoped to one layer "
             "type with @sliding or @full; auto = uniform:50%, or uniform:50%@sliding on a teacher with "
             "sliding-window and global layers (Gemma 3)")
# @scope -> the layer type (transformers' config.layer_types) a scoped policy converts
SCOPES = {"sliding": "sliding_attention", "local": "sliding_attention", "full": "full_attention",
          "global": "full_attention"}


@dataclass
class Policy:
    kind: str  # "list" or one of POLICIES
    k: int  # the number of layers kept; for "interval", the period
    layers: list[int] | None = None  # for "list"
    scope: str | None = None  # a layer type of SCOPES: only layers of it are converted, K counts among them


def auto_policy(layer_types: list[str] | None) -> str:
    """The policy ``auto`` stands for on a teacher with these ``layer_types``: half of the layers kept, and on a
    teacher that mixes sliding-window and global layers (Gemma 3) only sliding-window ones converted, because
    converting the global layers costs quality and retrieval (docs/results.md, *Gemma 3 270M*)."""
    types = set(layer_types or [])
    return "uniform:50%@sliding" if {"sliding_attention", "full_attention"} <= types else "uniform:50%"


def resolve_auto(spec, layer_types: list[str] | None):
    """``spec`` with ``auto`` replaced by :func:`auto_policy` of the teacher's layer types; any other spec as is."""
    return auto_policy(layer_types) if isinstance(spec, str) and spec.strip() == AUTO else spec


def policy_scope(spec) -> str | None:
    """The layer type a policy spec is scoped to ('uniform:50%@sliding' -> 'sliding_attention'), or None."""
    if isinstance(spec, (list, tuple)):
        return None
    _, at, scope = str(spec).strip().partition("@")
    if not at:
        return None
    if scope.strip() not in SCOPES:
        raise TcalError(f"keep policy {spec!r}: unknown layer type {scope!r} after @; use @sliding or @full")
    return SCOPES[scope.strip()]


def scope_layers(scope: str | None, layer_types: list[str] | None, num_layers: int) -> list[int]:
    """The layers a policy scoped to ``scope`` may convert (every layer when unscoped); a teacher without
    ``layer_types`` has only full-attention layers."""
    if scope is None:
        return list(range(num_layers))
    types = list(layer_types) if layer_types else ["full_attention"] * num_layers
    layers = [i for i, t in enumerate(types) if t == scope]
    if not layers:
        have = sorted(set(types))
        raise TcalError(f"the teacher has no {scope} layers (its layers are {', '.join(have)}); drop the @ scope")
    return layers


def _whole(text: str) -> bool:
    """ASCII digits only: str.isdigit also takes '²' and '①', which int() refuses."""
    return bool(re.fullmatch(r"[0-9]+", text))


def parse_keep(spec: str, name: str = "keep") -> list[int] | str:
    """'0,4,8' -> [0, 4, 8]; anything else (a policy such as 'uniform:8') is passed through.

    A spec with a comma is a list, and every entry of it must be a layer index, once: '1,,2', '1,2,', '0,a'
    and '1,1' are errors, not [1, 2], [1, 2], a policy named '0,a' or [1, 1]. ``name`` names the argument in
    the error (``--layers`` for tcal stats)."""
    parts = [p.strip() for p in spec.split(",")]
    if "@" in spec or (len(parts) == 1 and not _whole(parts[0].lstrip("-"))):
        return spec  # a policy, scoped or not (or a bad one: parse_policy names what is wrong)
    if "" in parts:
        raise TcalError(f"{name} {spec!r} has an empty entry; give layer indices separated by single commas, "
                        "like 0,4,8")
    bad = [p for p in parts if not _whole(p.lstrip("-"))]
    if bad:
        raise TcalError(f"{name} {spec!r}: {bad[0]!r} is not a layer index; give whole numbers like 0,4,8 "
                        "(or one policy such as uniform:8, without commas)")
    layers = [int(p) for p in parts]
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise TcalError(f"{name} {spec!r} names layer {repeated[0]} more than once; list each layer once")
    return layers


def parse_policy(spec, num_layers: int | None) -> Policy:
    """'0,4,8' | [0, 4, 8] | 'uniform:8' | 'ar:25%' -> Policy.

    ``num_layers=None`` checks what needs no model (the syntax, a count of at least 1, a percentage
    below 100), as commands do before the teacher loads; a percentage's ``k`` is then 0.
    """
    if isinstance(spec, (list, tuple)):
        return Policy("list", len(spec), [layer_index(i) for i in spec])
    spec = str(spec).strip()
    if spec == AUTO:
        if num_layers is not None:
            raise TcalError("keep policy 'auto' depends on the teacher's layer types: resolve it with "
                            "resolve_auto(spec, config.layer_types) first")
        return Policy("uniform", 0)
    scope = policy_scope(spec)
    if scope is not None:
        spec, _, where = (p.strip() for p in spec.partition("@"))
        if spec == AUTO:
            raise TcalError(f"keep policy {AUTO} picks the teacher's own layers and takes no @ scope; give --keep "
                            f"{AUTO} alone, or a policy such as uniform:25%@{where}")
        if isinstance(parse_keep(spec), list):
            raise TcalError(f"an explicit layer list takes no @ scope ({spec}@...); list the layers to keep")
    keep = parse_keep(spec)
    if isinstance(keep, list):
        return Policy("list", len(keep), keep)
    kind, sep, count = spec.partition(":")
    if kind == AUTO:
        raise TcalError(f"keep policy {AUTO} takes no count ({spec}): it picks the teacher's own layers; give --keep "
                        f"{AUTO} alone, or a policy with a count such as uniform:{count or 'K'}")
    if not sep or kind not in POLICIES:
        raise TcalError(
            f"unknown keep policy {spec!r}; use a list like 0,4,8, {AUTO}, or one of "
            f"{', '.join(p + ':K' for p in POLICIES)} (K a count or a percentage like 25%)"
        )
    if kind == INTERVAL:
        return _interval_policy(spec, count, scope, num_layers)
    try:
        percent = float(count[:-1]) if count.endswith("%") else None
        k = int(count) if percent is None else 0
        if percent is not None and not math.isfinite(percent):
            raise ValueError(count)
    except ValueError:
        raise TcalError(f"keep policy {spec!r}: K must be a whole number or a percentage, got {count!r}") from None
    if percent is not None:
        # 100 % or more converts nothing in any model: said in the user's terms, not in a layer count
        if percent >= 100:
            raise TcalError(f"keep policy {spec!r} asks for {count} of the layers; a percentage must be below 100% "
                            f"(100% converts nothing), e.g. {kind}:25%")
        if num_layers is None:
            if percent <= 0:
                raise TcalError(f"keep policy {spec!r} keeps {count} of the layers; keep at least 1 attention layer")
            return Policy(kind, 0, scope=scope)
        k = round(num_layers * percent / 100)
    if k < 1:
        raise TcalError(f"keep policy {spec!r} keeps {k} layers; keep at least 1 attention layer")
    if num_layers is not None and k >= num_layers:
        among = "" if scope is None else f" {scope}"
        raise TcalError(f"keep policy {spec!r} keeps {k} of {num_layers}{among} layers: nothing would be converted; "
                        f"K must be below {num_layers}")
    return Policy(kind, k, scope=scope)


def _interval_policy(spec: str, count: str, scope: str | None, num_layers: int | None) -> Policy:
    """interval:K -> Policy("interval", K): a whole period of at least 2 that keeps at least one layer."""
    if scope is not None:
        raise TcalError(f"keep policy {spec!r}: interval:K places attention by layer index (layer i is kept when "
                        "(i + 1) % K == 0); it takes no @ scope")
    if not _whole(count):
        raise TcalError(f"keep policy {spec!r}: K is the period of the placement, a whole number like interval:4 "
                        f"(attention in every 4th layer), got {count!r}")
    k = int(count)
    if k < 2:
        raise TcalError(f"keep policy {spec!r} keeps every layer: nothing would be converted; K must be at least 2")
    if num_layers is not None and k > num_layers:
        raise TcalError(f"keep policy {spec!r} keeps no layer of {num_layers}: K must be at most {num_layers} "
                        f"(interval:{num_layers} keeps the last layer only)")
    return Policy(INTERVAL, k)


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


def global_layers_note(layer_types: list[str] | None, keep: list[int]) -> str | None:
    """A warning when ``keep`` converts every global (full-attention) layer of a teacher that mixes them with
    sliding-window layers (Gemma 3): the hybrid is then left without any attention past the window, and its
    retrieval over longer contexts rests on the GDN layers alone (docs/results.md, *Gemma 3*)."""
    types = list(layer_types or [])
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full or len(full) == len(types) or set(full) & set(keep):
        return None
    return (f"the keep list converts every global-attention layer ({', '.join(map(str, full))}): no attention layer "
            "is left that sees past the sliding window, so retrieval over longer contexts rests on the GDN layers (on "
            "Gemma 3 270M at the CPU budget, uniform:50% found no passkey at 512-4K tokens where uniform:50%@sliding "
            "found 0.20-0.40, and scored 1.14-1.25x the teacher's PPL against 1.04-1.13x at the large budget); to keep "
            "them, convert with a policy scoped to the sliding-window layers, e.g. --keep uniform:50%@sliding")
