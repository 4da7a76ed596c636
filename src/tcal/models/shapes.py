"""Public config values of real models, for runs that need a model's shape but not its weights
(speed and memory do not depend on the values): ``random_model("qwen2.5-1.5b")``."""
from __future__ import annotations

import copy

# Gemma 3: five sliding-window layers (512 tokens, RoPE base 10K) to one global layer (base 1M), 4 query heads on
# one KV head of dim 256
_GEMMA3 = dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, head_dim=256,
               vocab_size=262144, max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               tie_word_embeddings=True)
SHAPES = {
    # the built-in qwen2.5-coder-0.5b's shape; its GGUF carries its own output matrix (untied)
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, head_dim=128,
                         max_position_embeddings=131072, rope_theta=5e5, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=1e5, tie_word_embeddings=True),
    "gemma3-270m": dict(_GEMMA3, hidden_size=640, intermediate_size=2048, num_hidden_layers=18),
    "gemma3-1b": dict(_GEMMA3, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26),
}


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
