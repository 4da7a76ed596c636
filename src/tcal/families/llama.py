"""Llama (Llama 2, Llama 3.x, SmolLM2, ...): separate q/k/v/o projections, optional attention biases
(``attention_bias``), two RMSNorms per layer, a SiLU MLP.

Its GGUF behaviour lives here: llama.cpp's ``llama`` architecture rotates q and k pairwise where transformers rotates
halves, so a teacher's q/k rows are written in llama.cpp's order (:func:`llama_cpp_rows`); and Llama 3.x's ``llama3``
RoPE scaling converts and exports to transformers as it is, and to a GGUF where llama.cpp holds it
(:class:`Llama3Rope`)."""
from __future__ import annotations

import math

from tcal.families.family import Family
from tcal.families.rope import GGUFRope, rope_parameters

# the Split regex of Llama 3's tokenizer.json (before its ByteLevel step): llama.cpp's "llama-bpe"
LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def llama_cpp_rows(gguf_name: str, tensor, config):
    """A q or k projection (weight or bias) in the row order llama.cpp's ``llama`` architecture rotates: within each
    head, row i of transformers' first half and row i of its second half become neighbours. Other tensors as they
    are."""
    if ".attn_q." in gguf_name:
        heads = config.num_attention_heads
    elif ".attn_k." in gguf_name:
        heads = config.num_key_value_heads or config.num_attention_heads
    else:
        return tensor
    shape = tensor.shape
    return tensor.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def llama3_factors(rope: dict, head_dim: int, context: int) -> list[float]:
    """Per rotary frequency, what ``llama3`` scaling divides it by (transformers' ``_compute_llama3_parameters``):
    1 for wavelengths below the original context / high_freq_factor, ``factor`` above original / low_freq_factor,
    a smooth blend between. ``context``: the original context where the RoPE does not say it."""
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings") or context
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < old / high:
            out.append(1.0)
        elif wavelength > old / low:
            out.append(float(factor))
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


class Llama3Rope(GGUFRope):
    """Llama 3.x's ``llama3`` RoPE in a GGUF. llama.cpp's ``llama`` architecture divides each rotary frequency by a
    stored factor (``rope_freqs.weight``, as its own converter writes it), so a plain teacher keeps its RoPE; the
    Qwen3.5 layout's ``qwen35`` loads no such tensor, so a hybrid's GGUF is refused in Llama's own words. Any other
    scaling is the plain rule's."""

    def blocker(self, rope: dict, arch: str) -> str | None:
        if rope.get("rope_type") != "llama3":
            return super().blocker(rope, arch)
        if arch == FAMILY.gguf_architecture:
            return None
        return (f"the teacher's RoPE is Llama 3's 'llama3' scaling, which llama.cpp holds as per-frequency factors "
                f"(rope_freqs) that its {arch} architecture does not load")

    def tensors(self, config, arch: str) -> dict[str, list[float]]:
        rope = rope_parameters(config)
        if rope.get("rope_type") != "llama3":
            return {}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return {"rope_freqs.weight": llama3_factors(rope, head_dim, config.max_position_embeddings)}


FAMILY = Family(
    name="llama", model_type="llama", title="Llama",
    config_class="LlamaConfig", causal_lm_class="LlamaForCausalLM",
    gguf_architecture="llama", teacher_gguf=True, gguf_tensor=llama_cpp_rows, gguf_rope=Llama3Rope(),
    pre_tokenizers={LLAMA3_SPLIT: "llama-bpe"},
    shapes={
        "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                             num_key_value_heads=8, vocab_size=128256, head_dim=128, max_position_embeddings=131072,
                             rope_theta=5e5, tie_word_embeddings=True),
        "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5,
                             tie_word_embeddings=True),
    },
)
