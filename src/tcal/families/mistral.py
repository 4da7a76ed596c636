"""Mistral: Llama's decoder layer with an optional sliding window (``sliding_window``; the Qwen3.5 layout holds it
only where the window never slides). llama.cpp writes and reads Mistral GGUFs as architecture ``llama``
(transformers tells them apart by the GGUF's name), so a teacher's q/k rows go in Llama's order."""
from tcal.families.family import Family
from tcal.families.llama import llama_cpp_rows

FAMILY = Family(
    name="mistral", model_type="mistral", title="Mistral",
    config_class="MistralConfig", causal_lm_class="MistralForCausalLM",
    gguf_architecture="llama", teacher_gguf=True, gguf_tensor=llama_cpp_rows,
)
