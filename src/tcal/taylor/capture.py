"""Teacher passes with hooks: the activations Phase 1 and Phase 2 need, and eager attention for
the statistics.

:func:`capture_teacher_io` is one forward of the teacher (its own attention implementation)
that keeps, per requested layer, the layer input x (output of ``input_layernorm``), the per-head
attention output c (pre-W_o) and the attention output after W_o.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tcal import families
from tcal.utils.errors import TcalError
from tcal.utils.runtime import model_device


def decoder_layers(teacher) -> Sequence:
    try:
        return teacher.model.layers
    except AttributeError:
        raise TcalError(f"the teacher has no model.layers; tcal converts {families.supported()} decoders") from None


def check_layers(teacher, layers: Sequence[int] | None) -> list[int]:
    n = len(decoder_layers(teacher))
    if layers is None:
        return list(range(n))
    layers = sorted({int(i) for i in layers})
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise TcalError(f"layer {bad[0]} out of range: the teacher has {n} layers (0..{n - 1})")
    return layers


def output_projection(teacher, layer: int):
    """The teacher's attention output projection at ``layer``: its input is the per-head context (B, T, H d)."""
    return families.of(teacher.config).output_projection(decoder_layers(teacher)[layer].self_attn)


def head_geometry(teacher, layer: int) -> tuple[int, int]:
    attn = decoder_layers(teacher)[layer].self_attn
    cfg = teacher.config
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return output_projection(teacher, layer).in_features // head_dim, head_dim


def _configs(model) -> list:
    seen, out = set(), []
    for m in [model, *model.modules()]:
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


@contextlib.contextmanager
def eager_attention(model):
    """Temporarily run ``model`` with eager attention (which returns its probabilities)."""
    configs = _configs(model)
    saved = [cfg._attn_implementation for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation = "eager"
        yield model
    finally:
        for cfg, impl in zip(configs, saved):
            cfg._attn_implementation = impl


@contextlib.contextmanager
def hooks(handles: list):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def batches(input_ids: torch.Tensor, batch_size: int, progress: bool, desc: str):
    if input_ids.dim() != 2:
        raise TcalError(f"input_ids must be (sequences, tokens), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise TcalError("no calibration tokens: input_ids is empty")
    starts = range(0, input_ids.shape[0], max(1, int(batch_size)))
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=desc, unit="batch", leave=False)
    for s in starts:
        yield input_ids[s : s + batch_size]


@dataclass
class LayerIO:
    """Teacher-forced tensors of one layer over the calibration tokens (on ``device``).

    x: (N, T, hidden) the layer's normed input; ctx: (N, T, H, d) per-head attention output
    before W_o (None unless asked for); out: (N, T, hidden) attention output after W_o;
    resid: (N, T, hidden) the residual stream entering the layer, before its norm (None unless
    asked for; the residual-stream target of sequential alignment needs it).
    """

    x: torch.Tensor
    out: torch.Tensor
    ctx: torch.Tensor | None = None
    resid: torch.Tensor | None = None

    def select(self, rows: slice | tuple | torch.Tensor) -> LayerIO:
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return LayerIO(self.x[rows], self.out[rows], pick(self.ctx), pick(self.resid))

    @property
    def num_sequences(self) -> int:
        return self.x.shape[0]


@torch.no_grad()
def capture_teacher_io(
    teacher,
    input_ids: torch.Tensor,
    layers: Sequence[int],
    batch_size: int = 4,
    with_ctx: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    with_resid: bool = False,
) -> dict[int, LayerIO]:
    """One teacher pass over ``input_ids`` (N, T) that keeps every requested layer's x / ctx / out
    (and, ``with_resid``, the residual stream entering the layer).

    Uses the teacher's own attention implementation (no probabilities needed). Tensors are
    stored in ``dtype`` on ``device`` (default: the teacher's device). The pass stops after the
    last requested layer's attention: nothing above it is needed.
    """
    layers = check_layers(teacher, layers)
    decoder = decoder_layers(teacher)
    device = model_device(teacher) if device is None else torch.device(device)
    parts: dict[int, dict[str, list]] = {i: {"x": [], "out": [], "ctx": [], "resid": []} for i in layers}
    handles = []
    keep = lambda t: t.detach().to(device=device, dtype=dtype)  # noqa: E731

    def on_attn(_m, _a, out, s, last):
        s["out"].append(keep(out[0] if isinstance(out, tuple) else out))
        if last:
            raise _Stop

    def on_norm(_m, args, out, s):
        s["x"].append(keep(out))
        if with_resid:
            s["resid"].append(keep(args[0]))

    for i in layers:
        blk, store = decoder[i], parts[i]
        H, d = head_geometry(teacher, i)
        handles.append(blk.input_layernorm.register_forward_hook(lambda m, a, out, s=store: on_norm(m, a, out, s)))
        handles.append(blk.self_attn.register_forward_hook(
            lambda m, a, out, s=store, last=i == layers[-1]: on_attn(m, a, out, s, last)))
        if with_ctx:
            handles.append(output_projection(teacher, i).register_forward_pre_hook(
                lambda _m, args, s=store, H=H, d=d: s["ctx"].append(keep(args[0].reshape(*args[0].shape[:2], H, d)))
            ))
    _run(teacher, input_ids, handles, batch_size, progress, "teacher pass")
    cat = lambda p, k, on: torch.cat(p[k]) if on else None  # noqa: E731
    return {
        i: LayerIO(x=torch.cat(p["x"]), out=torch.cat(p["out"]), ctx=cat(p, "ctx", with_ctx),
                   resid=cat(p, "resid", with_resid))
        for i, p in parts.items()
    }


class _Stop(Exception):
    """Raised by a hook once everything asked for is captured: the rest of the forward is skipped."""


def _run(model, input_ids, handles, batch_size, progress, desc) -> None:
    was_training = model.training
    model.eval()
    try:
        with hooks(handles):
            for ids in batches(input_ids, batch_size, progress, desc):
                try:
                    model(input_ids=ids.to(model_device(model)), use_cache=False)
                except _Stop:
                    pass
    finally:
        model.train(was_training)


@torch.no_grad()
def capture_layer_input(
    model,
    input_ids: torch.Tensor,
    layer: int,
    batch_size: int = 4,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual stream entering ``layer``, its normed input x), each (N, T, hidden), from a pass of
    ``model`` (a teacher or a partly converted hybrid) that stops at that layer's norm.

    Sequential alignment reads the hybrid's own inputs with this: layer l is fitted on what the
    layers below it, already converted, hand it, not on the teacher's hidden states.
    """
    layer = check_layers(model, [layer])[0]
    device = model_device(model) if device is None else torch.device(device)
    resid, xs = [], []

    def on_norm(_m, args, out):
        resid.append(args[0].detach().to(device=device, dtype=dtype))
        xs.append(out.detach().to(device=device, dtype=dtype))
        raise _Stop

    handle = decoder_layers(model)[layer].input_layernorm.register_forward_hook(on_norm)
    _run(model, input_ids, [handle], batch_size, progress, f"inputs of layer {layer}")
    return torch.cat(resid), torch.cat(xs)


