"""Qwen2 and Qwen2.5 (and the Qwen2.5-Coder built-ins): Llama's layer with q/k/v biases always on."""
from tcal.families.family import Family

# the Split regex of the Qwen2 / Qwen2.5 / Qwen3 tokenizer.json (before its ByteLevel step): llama.cpp's "qwen2"
QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

FAMILY = Family(
    name="qwen2", model_type="qwen2", title="Qwen2/2.5",
    config_class="Qwen2Config", causal_lm_class="Qwen2ForCausalLM",
    gguf_architecture="qwen2", teacher_gguf=True,
    pre_tokenizers={QWEN2_SPLIT: "qwen2"},
    # qwen2.5-0.5b: the built-in qwen2.5-coder-0.5b's shape, whose GGUF carries its own output matrix (untied)
    shapes={"qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                                 rope_theta=1e6, tie_word_embeddings=False),
            "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                                 rope_theta=1e6, tie_word_embeddings=True)},
)
