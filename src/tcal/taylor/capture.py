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

from tcal.utils.errors import TcalError
from tcal.utils.runtime import model_device


def decoder_layers(teacher) -> Sequence:
    try:
        return teacher.model.layers
    except AttributeError:
        raise TcalError("the teacher has no model.layers; tcal supports Llama/Qwen2/Qwen3/Mistral decoders") from None


def check_layers(teacher, layers: Sequence[int] | None) -> list[int]:
    n = len(decoder_layers(teacher))
    if layers is None:
        return list(range(n))
    layers = sorted({int(i) for i in layers})
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise TcalError(f"layer {bad[0]} out of range: the teacher has {n} layers (0..{n - 1})")
    return layers


def head_geometry(teacher, layer: int) -> tuple[int, int]:
    attn = decoder_layers(teacher)[layer].self_attn
    cfg = teacher.config
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return attn.o_proj.in_features // head_dim, head_dim


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
    before W_o (None unless asked for); out: (N, T, hidden) attention output after W_o.
    """

    x: torch.Tensor
    out: torch.Tensor
    ctx: torch.Tensor | None = None

    def select(self, rows: slice | tuple | torch.Tensor) -> LayerIO:
        return LayerIO(self.x[rows], self.out[rows], None if self.ctx is None else self.ctx[rows])

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
) -> dict[int, LayerIO]:
    """One teacher pass over ``input_ids`` (N, T) that keeps every requested layer's x / ctx / out.

    Uses the teacher's own attention implementation (no probabilities needed). Tensors are
    stored in ``dtype`` on ``device`` (default: the teacher's device).
    """
    layers = check_layers(teacher, layers)
    decoder = decoder_layers(teacher)
    device = model_device(teacher) if device is None else torch.device(device)
    parts: dict[int, dict[str, list]] = {i: {"x": [], "out": [], "ctx": []} for i in layers}
    handles = []
    keep = lambda t: t.detach().to(device=device, dtype=dtype)  # noqa: E731
    for i in layers:
        blk, store = decoder[i], parts[i]
        H, d = head_geometry(teacher, i)
        handles.append(blk.input_layernorm.register_forward_hook(lambda _m, _a, out, s=store: s["x"].append(keep(out))))
        handles.append(blk.self_attn.register_forward_hook(
            lambda _m, _a, out, s=store: s["out"].append(keep(out[0] if isinstance(out, tuple) else out))
        ))
        if with_ctx:
            handles.append(blk.self_attn.o_proj.register_forward_pre_hook(
                lambda _m, args, s=store, H=H, d=d: s["ctx"].append(keep(args[0].reshape(*args[0].shape[:2], H, d)))
            ))
    was_training = teacher.training
    teacher.eval()
    try:
        with hooks(handles):
            for ids in batches(input_ids, batch_size, progress, "teacher pass"):
                teacher(input_ids=ids.to(model_device(teacher)), use_cache=False)
    finally:
        teacher.train(was_training)
    return {
        i: LayerIO(
            x=torch.cat(p["x"]), out=torch.cat(p["out"]), ctx=torch.cat(p["ctx"]) if with_ctx else None
        )
        for i, p in parts.items()
    }


