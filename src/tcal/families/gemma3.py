"""Gemma 3 (text): zero-centred RMSNorms (they multiply by 1 + w; q/k norms carried as 1 + w), four norms per layer,
a GELU MLP, embeddings scaled by sqrt(hidden), sliding-window and global layers with RoPE bases of their own. The
Qwen3.5 layout holds none of that, so its hybrids are tcal's native ones (``--target auto``). A Gemma 3
vision-language checkpoint (``gemma3``) converts its text decoder. The tokenizer is SentencePiece-style: a GGUF
export would copy the teacher GGUF's."""
from tcal.families.family import Family


def _tiny(kw: dict) -> dict:
    """Layers 0-2 of every 4 slide over 8 tokens, the 4th is global."""
    head_dim = kw.get("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    L = kw["num_hidden_layers"]
    return {"head_dim": head_dim, "query_pre_attn_scalar": head_dim, "sliding_window": 8,
            "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(L)], **kw}


# Gemma 3's real models: five sliding-window layers (512 tokens, RoPE base 10K) to one global layer (base 1M), 4 query
# heads on one KV head of dim 256
_SHAPE = dict(num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
              max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
              tie_word_embeddings=True)

FAMILY = Family(
    name="gemma3", model_type="gemma3_text", title="Gemma 3",
    config_class="Gemma3TextConfig", causal_lm_class="Gemma3ForCausalLM",
    zero_centred_norms=True, gguf_architecture="gemma3", layout=False, vision_language="gemma3",
    tiny_keep=(0, 3),  # a sliding layer and the tiny model's global one
    shapes={"gemma3-270m": dict(_SHAPE, hidden_size=640, intermediate_size=2048, num_hidden_layers=18),
            "gemma3-1b": dict(_SHAPE, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26)},
    tiny=_tiny,
)
