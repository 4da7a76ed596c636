"""Public config values of real models, for runs that need a model's shape but not its weights
(speed and memory do not depend on the values): ``random_model("qwen2.5-1.5b")``. Each family module holds its own
(``Family.shapes``, :mod:`tcal.families`); this module builds the models."""
from __future__ import annotations

import copy

from tcal import families

# name -> config fields with model_type, every family's shapes
SHAPES = {name: {"model_type": fam.model_type, **fields}
          for fam in families.FAMILIES.values() for name, fields in fam.shapes.items()}


def random_model(name: str, *, dtype=None, device="cpu", num_layers: int = 0, attn_implementation: str | None = None):
    """A causal LM at the shape ``name`` with random weights, built on ``device``, in eval mode.

    ``num_layers`` overrides the depth (CPU smoke runs); ``attn_implementation``: e.g. "sdpa".
    """
    return model_from_config(shape_config(name, num_layers=num_layers), dtype=dtype, device=device,
                             attn_implementation=attn_implementation)


def shape_config(name: str, *, num_layers: int = 0):
    """The transformers config of the shape ``name`` (``num_layers`` overrides the depth)."""
    from transformers import AutoConfig

    shape = copy.deepcopy(SHAPES[name])  # a config may keep (and change) the nested rope dicts
    if num_layers:
        shape["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(shape.pop("model_type"), **shape)


def model_from_config(config, *, dtype=None, device="cpu", attn_implementation: str | None = None):
    """Random weights for ``config``, built directly on ``device`` (no CPU copy of a large model first)."""
    import torch
    from transformers import AutoModelForCausalLM

    if attn_implementation:
        config._attn_implementation = attn_implementation
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32).eval()
