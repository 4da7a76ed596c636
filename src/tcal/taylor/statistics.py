"""Teacher statistics for Taylor-Calibrate (docs/method.md), streamed one layer at a time.

The teacher runs with eager attention (so each attention module returns its probabilities
``p`` of shape (B, H, T, T) as its second output); forward hooks on the requested layers reduce
``p`` to per-head sums inside the hook, so no more than one layer's T x T probabilities exist
at any moment. A forward-pre-hook on ``o_proj`` sees the per-head attention output ``c``
(before W_o); the attention module's own output is the output after W_o.

Pure functions on a probability tensor (``attention_distance``, ``attention_entropy``,
``concentration_minmax``, ``concentration_absolute``) are what the hooks use, so they are
what the unit tests check.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from tcal.taylor.capture import (
    batches,
    check_layers,
    decoder_layers,
    eager_attention,
    head_geometry,
    hooks,
    output_projection,
)
from tcal.utils.errors import TcalError
from tcal.utils.runtime import model_device

STATS_FILE = "teacher_stats.json"
STATS_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Pure functions on attention probabilities
# ---------------------------------------------------------------------------------------------
#
# ``p`` is (..., H, Tq, Tk), rows summing to 1, causal: query row i sits at absolute position
# t = (Tk - Tq) + i (Tk == Tq without a cache) and can see keys s <= t. Entries above the
# diagonal are ignored even when they are not exactly 0.


def _causal_geometry(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t - s) as float (Tq, Tk) and the causal mask (Tq, Tk) for a probability tensor."""
    tq, tk = p.shape[-2], p.shape[-1]
    t = torch.arange(tk - tq, tk, device=p.device).unsqueeze(1)
    s = torch.arange(tk, device=p.device).unsqueeze(0)
    lag = (t - s).to(torch.float32)
    return lag, lag >= 0


def row_distance(p: torch.Tensor) -> torch.Tensor:
    """Per row: sum_s p_{t,s} * max(t - s, 0.5). Shape (..., H, Tq).

    The 0.5 floor makes attention on the token itself count as half a token of distance, so a
    head that only ever looks at itself gets d = 0.5 rather than 0 (and a finite decay rate).
    """
    lag, causal = _causal_geometry(p)
    weight = torch.where(causal, lag.clamp_min(0.5), torch.zeros_like(lag))
    return (p.float() * weight).sum(-1)


def row_entropy(p: torch.Tensor) -> torch.Tensor:
    """Per row: -sum_s p log p over the causal keys (0 log 0 = 0). Shape (..., H, Tq)."""
    _, causal = _causal_geometry(p)
    pf = p.float() * causal
    return -torch.special.xlogy(pf, pf).sum(-1)


def sum_per_head(x: torch.Tensor) -> torch.Tensor:
    """(..., H, n) -> (H,): sum over every dimension but the head one (second to last)."""
    return x.transpose(-2, 0).reshape(x.shape[-2], -1).sum(-1)


def _mean_per_head(rows: torch.Tensor) -> torch.Tensor:
    """(..., H, T) -> (H,): mean over every dimension but the head one."""
    return rows.transpose(-2, 0).reshape(rows.shape[-2], -1).mean(-1) if rows.dim() > 2 else rows.mean(-1)


def attention_distance(p: torch.Tensor) -> torch.Tensor:
    """d_h = mean_t sum_s p_{t,s} max(t - s, 0.5): per-head mean attention distance, (H,)."""
    return _mean_per_head(row_distance(p))


def _sink_parts(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (distance mass on keys s >= 1, non-sink mass 1 - p_{t,0}, sink mass p_{t,0}), rows t >= 1 only."""
    lag, causal = _causal_geometry(p)
    weight = torch.where(causal, lag.clamp_min(0.5), torch.zeros_like(lag))
    weight[:, 0] = 0.0
    pf = p.float() * causal
    tq, tk = p.shape[-2], p.shape[-1]
    rows = torch.arange(tk - tq, tk, device=p.device) >= 1
    num = (pf * weight).sum(-1)[..., rows]
    sink = pf[..., 0][..., rows]
    return num, pf[..., 1:].sum(-1)[..., rows], sink


def attention_distance_nosink(p: torch.Tensor) -> torch.Tensor:
    """d_h with the first key (the attention sink) taken out, (H,).

    sum_{t>=1} sum_{s>=1} p_{t,s} max(t - s, 0.5) / sum_{t>=1} sum_{s>=1} p_{t,s}: the distance of the
    attention that is not parked on token 0, rows weighted by how much of it they have. Heads
    that put most of their mass on the sink otherwise look like long-memory heads (their d_h
    grows like t/2) although what they read is one fixed token. 0.5 when no such mass exists.
    """
    num, mass, _ = _sink_parts(p)
    return _nosink_ratio(sum_per_head(num), sum_per_head(mass))


def _nosink_ratio(num: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Per-head distance sums / non-sink mass sums; 0.5 where a head has no non-sink mass."""
    return torch.where(mass > 0, num / mass.clamp_min(1e-30), torch.full_like(num, 0.5))


def attention_sink_mass(p: torch.Tensor) -> torch.Tensor:
    """Per head: mean over rows t >= 1 of p_{t,0}, the attention parked on the first token, (H,)."""
    _, _, sink = _sink_parts(p)
    if sink.shape[-1] == 0:
        return torch.zeros(p.shape[-3], device=p.device)
    return _mean_per_head(sink)


def attention_entropy(p: torch.Tensor) -> torch.Tensor:
    """H_h = mean_t (-sum_s p_{t,s} log p_{t,s}): per-head mean row entropy (nats), (H,)."""
    return _mean_per_head(row_entropy(p))


def _row_log_support(p: torch.Tensor) -> torch.Tensor:
    """log(t + 1) per query row (Tq,): the entropy of uniform attention over the causal prefix."""
    tq, tk = p.shape[-2], p.shape[-1]
    return torch.log(torch.arange(tk - tq, tk, device=p.device, dtype=torch.float32) + 1.0)


def attention_entropy_normalised(p: torch.Tensor) -> torch.Tensor:
    """Per head: mean over rows t >= 1 of H_t / log(t + 1), in [0, 1]; (H,).

    Row t = 0 sees a single key, so its attention is one-hot whatever the head does and its
    normalised entropy is 0/0: it carries no information about the head and is left out of the
    mean (not counted as "concentrated"). With no row t >= 1 at all (T = 1) the result is 0.
    """
    support = _row_log_support(p)
    keep = support > 0
    if not bool(keep.any()):
        return torch.zeros(p.shape[-3], device=p.device)
    rows = row_entropy(p)[..., keep] / support[keep]
    return _mean_per_head(rows)


def concentration_minmax(entropy: torch.Tensor, floor: float = 1e-3) -> torch.Tensor:
    """Reference concentration: c_h = 1 - (H_h - min H) / max(max H - min H, floor), in [0, 1].

    Relative to the other heads of the same layer: the sharpest head gets 1, the most diffuse 0,
    whatever their absolute entropies.
    """
    entropy = torch.as_tensor(entropy, dtype=torch.float32)
    lo, hi = entropy.min(), entropy.max()
    return 1.0 - (entropy - lo) / torch.clamp(hi - lo, min=floor)


def concentration_absolute(p: torch.Tensor) -> torch.Tensor:
    """Absolute concentration: c_h = 1 - mean_{t >= 1} H_t / log(t + 1), in [0, 1]; (H,).

    1 = every row one-hot, 0 = every row uniform over its causal prefix. Comparable across
    layers and models (row t = 0 is left out, see :func:`attention_entropy_normalised`).
    """
    return 1.0 - attention_entropy_normalised(p)


# ---------------------------------------------------------------------------------------------
# Data classes
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerStats:
    """Per-head statistics of one teacher attention layer over the calibration tokens."""

    layer: int
    num_heads: int
    head_dim: int
    tokens: int  # query rows per head (sequences x positions)
    distance: list[float]  # d_h, tokens
    entropy: list[float]  # H_h, nats
    entropy_normalised: list[float]  # mean_{t>=1} H_t / log(t+1)
    concentration_minmax: list[float]  # reference c_h (relative to the layer's heads)
    concentration_absolute: list[float]  # 1 - entropy_normalised
    ctx_rms: list[float]  # RMS of the teacher's per-head output c_h (pre-W_o), per head
    ctx_vec_rms: float  # mean over tokens and heads of each d-vector's RMS (the reference's teacher_rms)
    out_rms: float  # RMS of the attention output after W_o
    x_rms: float  # RMS of the layer input (output of input_layernorm)
    distance_nosink: list[float] | None = None  # d_h without the attention on token 0 (the sink)
    sink_mass: list[float] | None = None  # mean attention on token 0 (rows t >= 1)

    def distances(self, kind: str = "raw") -> list[float]:
        if kind == "raw":
            return self.distance
        if kind == "nosink":
            if self.distance_nosink is None:
                raise TcalError("these statistics have no sink-free distance; collect them again with this tcal")
            return self.distance_nosink
        raise TcalError(f"unknown distance {kind!r}; choose 'raw' or 'nosink'")

    def concentration(self, kind: str = "minmax") -> list[float]:
        if kind == "minmax":
            return self.concentration_minmax
        if kind == "absolute":
            return self.concentration_absolute
        raise TcalError(f"unknown concentration {kind!r}; choose 'minmax' or 'absolute'")


@dataclass
class TeacherStats(Mapping):
    """Statistics of every requested layer: a read-only mapping layer index -> :class:`LayerStats`."""

    layers: dict[int, LayerStats]
    meta: dict = field(default_factory=dict)  # sequences, seq_len, teacher model_type, ...

    def __getitem__(self, layer: int) -> LayerStats:
        return self.layers[int(layer)]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.layers))

    def __len__(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict:
        return {
            "version": STATS_VERSION,
            "meta": self.meta,
            "layers": {str(i): asdict(self.layers[i]) for i in sorted(self.layers)},
        }

    @classmethod
    def from_dict(cls, data: dict) -> TeacherStats:
        if data.get("version") != STATS_VERSION:
            raise TcalError(f"teacher statistics version {data.get('version')!r} not understood (want {STATS_VERSION})")
        names = {f.name for f in fields(LayerStats)}
        layers = {int(k): LayerStats(**{n: v for n, v in d.items() if n in names}) for k, d in data["layers"].items()}
        return cls(layers=layers, meta=dict(data.get("meta", {})))


def save_stats(stats: TeacherStats, path: str | os.PathLike) -> str:
    """Write the statistics as JSON; ``path`` is a file or a directory (then ``teacher_stats.json`` in it).

    Every statistic is a per-head or per-layer number, so JSON holds all of it (no tensors).
    """
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(os.sep):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, STATS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(stats.to_dict(), f, indent=1)
    os.replace(tmp, path)
    return path


def load_stats(path: str | os.PathLike) -> TeacherStats:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, STATS_FILE)
    if not os.path.exists(path):
        raise TcalError(f"no teacher statistics at {path}; run `tcal stats` first")
    with open(path) as f:
        return TeacherStats.from_dict(json.load(f))


class _StatsAccumulator:
    """Per-head running sums for one layer, fed by the hooks."""

    def __init__(self, num_heads: int, head_dim: int):
        self.H, self.d = num_heads, head_dim
        z = lambda: torch.zeros(num_heads, dtype=torch.float64)  # noqa: E731
        self.dist, self.ent, self.ent_norm = z(), z(), z()
        self.ns_num, self.ns_mass, self.sink = z(), z(), z()
        self.sink_rows = 0
        self.ctx_sq = z()
        self.rows = 0  # rows per head
        self.norm_rows = 0  # rows with t >= 1 per head
        self.ctx_tokens = 0
        self.ctx_vec_rms = 0.0
        self.out_sq, self.out_n = 0.0, 0
        self.x_sq, self.x_n = 0.0, 0
        self.saw_probs = False

    def add_probs(self, p: torch.Tensor) -> None:  # (B, H, Tq, Tk)
        self.saw_probs = True
        rows = p.shape[0] * p.shape[2]
        self.dist += row_distance(p).sum((0, 2)).double().cpu()
        ent = row_entropy(p)  # (B, H, Tq)
        self.ent += ent.sum((0, 2)).double().cpu()
        support = _row_log_support(p)
        keep = support > 0
        if bool(keep.any()):
            self.ent_norm += (ent[..., keep] / support[keep]).sum((0, 2)).double().cpu()
            self.norm_rows += p.shape[0] * int(keep.sum())
        num, mass, sink = _sink_parts(p)
        self.ns_num += num.sum((0, 2)).double().cpu()
        self.ns_mass += mass.sum((0, 2)).double().cpu()
        self.sink += sink.sum((0, 2)).double().cpu()
        self.sink_rows += p.shape[0] * sink.shape[-1]
        self.rows += rows

    def add_ctx(self, c: torch.Tensor) -> None:  # (B, T, H * d)
        c = c.float().reshape(*c.shape[:2], self.H, self.d)
        self.ctx_sq += c.pow(2).sum((0, 1, 3)).double().cpu()
        self.ctx_vec_rms += float(c.pow(2).mean(-1).sqrt().sum())
        self.ctx_tokens += c.shape[0] * c.shape[1]

    def add_out(self, y: torch.Tensor) -> None:
        self.out_sq += float(y.float().pow(2).sum())
        self.out_n += y.numel()

    def add_x(self, x: torch.Tensor) -> None:
        self.x_sq += float(x.float().pow(2).sum())
        self.x_n += x.numel()

    def finish(self, layer: int) -> LayerStats:
        if not self.saw_probs:
            raise TcalError(
                f"layer {layer}'s attention returned no probabilities; this teacher's attention module does not "
                "follow the transformers eager-attention convention"
            )
        rows = max(self.rows, 1)
        dist = (self.dist / rows).float()
        ent = (self.ent / rows).float()
        ent_norm = (self.ent_norm / self.norm_rows).float() if self.norm_rows else torch.zeros(self.H)
        to_list = lambda t: [float(v) for v in t]  # noqa: E731
        return LayerStats(
            layer=layer,
            num_heads=self.H,
            head_dim=self.d,
            tokens=self.rows,
            distance=to_list(dist),
            entropy=to_list(ent),
            entropy_normalised=to_list(ent_norm),
            concentration_minmax=to_list(concentration_minmax(ent)),
            concentration_absolute=to_list(1.0 - ent_norm),
            ctx_rms=to_list((self.ctx_sq / max(self.ctx_tokens * self.d, 1)).sqrt()),
            ctx_vec_rms=self.ctx_vec_rms / max(self.ctx_tokens * self.H, 1),
            out_rms=math.sqrt(self.out_sq / max(self.out_n, 1)),
            x_rms=math.sqrt(self.x_sq / max(self.x_n, 1)),
            distance_nosink=to_list(_nosink_ratio(self.ns_num, self.ns_mass)),
            sink_mass=to_list(self.sink / max(self.sink_rows, 1)),
        )


@torch.no_grad()
def collect_stats(
    teacher,
    input_ids: torch.Tensor,
    layers: Sequence[int] | None = None,
    batch_size: int = 4,
    progress: bool = True,
) -> TeacherStats:
    """Teacher attention statistics of ``layers`` (default: all) over ``input_ids`` (N, T).

    Runs the teacher in batches of ``batch_size`` sequences with eager attention; each hooked
    layer reduces its (B, H, T, T) probabilities to per-head sums on the spot.
    """
    layers = check_layers(teacher, layers)
    decoder = decoder_layers(teacher)
    acc = {i: _StatsAccumulator(*head_geometry(teacher, i)) for i in layers}
    handles = []
    for i in layers:
        blk, a = decoder[i], acc[i]

        def on_attn(_mod, _args, out, a=a):
            if isinstance(out, tuple) and len(out) > 1 and torch.is_tensor(out[1]):
                a.add_probs(out[1])
            a.add_out(out[0] if isinstance(out, tuple) else out)

        def on_ctx(_mod, args, a=a):
            a.add_ctx(args[0])

        handles.append(blk.self_attn.register_forward_hook(on_attn))
        handles.append(output_projection(teacher, i).register_forward_pre_hook(on_ctx))
        handles.append(blk.input_layernorm.register_forward_hook(lambda _m, _a, out, a=a: a.add_x(out)))
    device = model_device(teacher)
    was_training = teacher.training
    teacher.eval()
    try:
        with hooks(handles), eager_attention(teacher):
            for ids in batches(input_ids, batch_size, progress, "teacher stats"):
                teacher(input_ids=ids.to(device), use_cache=False)
    finally:
        teacher.train(was_training)
    meta = {
        "sequences": int(input_ids.shape[0]),
        "seq_len": int(input_ids.shape[1]),
        "model_type": getattr(teacher.config, "model_type", None),
        "num_layers": len(decoder),
    }
    return TeacherStats(layers={i: acc[i].finish(i) for i in layers}, meta=meta)


def summarise(stats: Mapping[int, LayerStats]) -> str:
    """A per-layer table: distance range, entropy, concentration, RMS figures."""
    head = (
        f"{'layer':>5} {'heads':>5} {'tokens':>7} {'d min':>7} {'d med':>7} {'d max':>7} {'H mean':>7} "
        f"{'c_abs':>6} {'sink':>5} {'d0 med':>7} {'ctx rms':>8} {'out rms':>8} {'x rms':>7}"
    )
    lines = [head, "-" * len(head)]
    for i in sorted(stats):
        s = stats[i]
        d = torch.tensor(s.distance)
        lines.append(
            f"{i:>5} {s.num_heads:>5} {s.tokens:>7} {d.min():>7.1f} {d.median():>7.1f} {d.max():>7.1f} "
            f"{sum(s.entropy) / len(s.entropy):>7.2f} {sum(s.concentration_absolute) / s.num_heads:>6.2f} "
            f"{sum(s.sink_mass or [float('nan')]) / s.num_heads:>5.2f} "
            f"{torch.tensor(s.distance_nosink or [float('nan')]).median():>7.1f} "
            f"{s.ctx_vec_rms:>8.4f} {s.out_rms:>8.4f} {s.x_rms:>7.3f}"
        )
    return "\n".join(lines)


