"""Qwen3: per-head q/k RMSNorms (carried into the GDN layers by the native target, kept as they are by the Qwen3.5
layout), no biases, a head size of its own (``head_dim``, not hidden / heads); Qwen2's tokenizer."""
from tcal.families.family import Family
from tcal.families.qwen2 import QWEN2_SPLIT


def _tiny(kw: dict) -> dict:
    return {"head_dim": kw["hidden_size"] // kw["num_attention_heads"], **kw}


FAMILY = Family(
    name="qwen3", model_type="qwen3", title="Qwen3",
    config_class="Qwen3Config", causal_lm_class="Qwen3ForCausalLM",
    gguf_architecture="qwen3", teacher_gguf=True,
    pre_tokenizers={QWEN2_SPLIT: "qwen2"},
    tiny=_tiny,
)
