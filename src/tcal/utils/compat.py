"""The thin layer between tcal and the moving parts of transformers 5.x.

Known moves inside 5.x that this file absorbs:
- the cache keyword: ``past_key_values`` (<= 5.2x) became ``cache`` (deprecated alias until 5.40);
  the same rename in model outputs;
- linear-attention cache slots: ``DynamicCache(config=...)`` builds a ``LinearAttentionLayer`` for
  every ``layer_types`` entry ``"linear_attention"`` (5.17 and later); we read and write its
  ``conv_states`` / ``recurrent_states`` slots so beam reordering and ``reset`` keep working;
- mask sizes asked for at a linear-attention layer: up to 5.17 at least, transformers' mask builders ask the cache
  about the first layer that is not sliding-window, which in a hybrid may hold linear-attention state (Gemma 3 with
  a converted layer before its first global one; any teacher whose layer 0 is converted), and the cache raises
  instead of answering (5.25 asks about the first full-attention layer). Such a query is answered from the first
  full-attention layer (else the first attention layer): :func:`install_cache_redirect`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel

from tcal.utils.errors import TcalError

CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
_CACHE_NAMES = ("cache", "past_key_values")


def cache_from_kwargs(kwargs: dict):
    for name in _CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def make_cache(config) -> DynamicCache:
    return DynamicCache(config=config)


def _attention_layer(cache, layer_idx: int) -> int | None:
    """The layer to answer for ``layer_idx`` when it holds linear-attention state, else None."""
    from transformers.cache_utils import CacheLayerMixin

    layers = getattr(cache, "layers", None)
    if not layers or not 0 <= layer_idx < len(layers) or isinstance(layers[layer_idx], CacheLayerMixin):
        return None
    attention = [i for i, layer in enumerate(layers) if isinstance(layer, CacheLayerMixin)]
    full = [i for i in attention if not getattr(layers[i], "is_sliding", False)]
    return (full or attention or [None])[0]


def _redirect(method):
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        layer_idx = bound.arguments.get("layer_idx", 0)
        if isinstance(layer_idx, int) and layer_idx:
            other = _attention_layer(self, layer_idx)
            if other is not None:
                bound.arguments["layer_idx"] = other
        return method(*bound.args, **bound.kwargs)

    wrapper._tcal_redirect = True
    return wrapper


def install_cache_redirect() -> None:
    """Wrap ``DynamicCache.get_seq_length`` and ``get_mask_sizes`` once (idempotent)."""
    for name in ("get_seq_length", "get_mask_sizes"):
        method = getattr(DynamicCache, name, None)
        if method is not None and not getattr(method, "_tcal_redirect", False):
            setattr(DynamicCache, name, _redirect(method))


def _linear_slot(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers) or not hasattr(layers[layer_idx], "recurrent_states"):
        raise TcalError(
            f"the cache has no linear-attention slot for GDN layer {layer_idx}; "
            "build it with transformers.DynamicCache(config=model.config) or let the model create it"
        )
    return layers[layer_idx]


def get_gdn_state(cache, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    slot = _linear_slot(cache, layer_idx)
    if not slot.has_previous_state[0]:
        return None, None
    return slot.conv_states[0], slot.recurrent_states[0]


def set_gdn_state(cache, layer_idx: int, conv_state: torch.Tensor | None, state: torch.Tensor) -> None:
    slot = _linear_slot(cache, layer_idx)
    if slot.device is None:
        slot.device, slot.dtype = state.device, state.dtype
    slot.recurrent_states[0] = state
    slot.is_recurrent_states_initialized[0] = True
    if conv_state is not None:
        slot.conv_states[0] = conv_state
        slot.is_conv_states_initialized[0] = True
    slot.has_previous_state[0] = True


# -- attention kernels for tcal's static cache (tcal.models.fast) -------------------------------------
# The teacher's attention modules look their kernel up by name in transformers' AttentionInterface
# (``config._attn_implementation``) on every call. tcal registers one more name and switches the
# modules' config to it only while it runs (or captures) a forward on its own cache, so the teacher's
# attention code runs unmodified and every other call keeps the model's own kernel.


def register_attention(name: str, fn) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


def sdpa_attention():
    """transformers' own SDPA attention function (what an ``attn_implementation="sdpa"`` model calls)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@contextlib.contextmanager
def attention_implementation(configs, name: str):
    """Within the block, every config in ``configs`` names attention kernel ``name``."""
    configs = list({id(c): c for c in configs}.values())
    previous = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = name
        yield
    finally:
        for c, p in zip(configs, previous):
            c._attn_implementation = p
