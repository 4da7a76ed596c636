"""Llama (Llama 2, Llama 3.x, SmolLM2, ...): separate q/k/v/o projections, optional attention biases
(``attention_bias``), two RMSNorms per layer, a SiLU MLP. Llama 3.x's ``llama3`` RoPE scaling converts and exports to
transformers as it is (:mod:`tcal.families.rope`)."""
from tcal.families.family import Family

# the Split regex of Llama 3's tokenizer.json (before its ByteLevel step): llama.cpp's "llama-bpe"
LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

FAMILY = Family(
    name="llama", model_type="llama", title="Llama",
    config_class="LlamaConfig", causal_lm_class="LlamaForCausalLM",
    gguf_architecture="llama", teacher_gguf=True,
    pre_tokenizers={LLAMA3_SPLIT: "llama-bpe"},
)
