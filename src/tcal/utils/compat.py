"""The thin layer between tcal and the moving parts of transformers 5.x.

Known moves inside 5.x that this file absorbs:
- the cache keyword: ``past_key_values`` (<= 5.2x) became ``cache`` (deprecated alias until 5.40);
  the same rename in model outputs;
- linear-attention cache slots: ``DynamicCache(config=...)`` builds a ``LinearAttentionLayer`` for
  every ``layer_types`` entry ``"linear_attention"`` (5.17 and later); we read and write its
  ``conv_states`` / ``recurrent_states`` slots so beam reordering and ``reset`` keep working.
"""
from __future__ import annotations

import contextlib
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
