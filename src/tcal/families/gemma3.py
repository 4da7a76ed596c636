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


FAMILY = Family(
    name="gemma3", model_type="gemma3_text", title="Gemma 3",
    config_class="Gemma3TextConfig", causal_lm_class="Gemma3ForCausalLM",
    zero_centred_norms=True, gguf_architecture="gemma3", layout=False, vision_language="gemma3",
    tiny=_tiny,
)
