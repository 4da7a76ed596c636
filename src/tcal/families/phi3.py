"""Phi-3 (Phi-3-mini/-medium, and Phi-4-mini's decoder): Llama's layer with the q/k/v projections fused into one
``qkv_proj`` (rows [q | k | v]) and the MLP's gate and up into one ``gate_up_proj`` (rows [gate | up]). tcal reads the
fused tensors as views of their parts: the GDN layers copy q, k, v from them, and the Qwen3.5 layout gets them
separate. Phi-3's Llama-2 tokenizer is SentencePiece-style: a GGUF export copies a teacher GGUF's
(``--gguf-vocab``)."""
from tcal.families.family import Attention, Family, Mlp

FAMILY = Family(
    name="phi3", model_type="phi3", title="Phi-3",
    config_class="Phi3Config", causal_lm_class="Phi3ForCausalLM",
    attention=Attention(qkv="qkv_proj"), mlp=Mlp(gate_up="gate_up_proj"),
    gguf_architecture="phi3",
    tiny=lambda kw: {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw},
)
