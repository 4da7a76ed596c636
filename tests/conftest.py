import pytest
import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    Qwen3Config, Qwen3ForCausalLM,
)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def tiny_teacher(family: str = "llama", seed: int = 0, **over):
    """A tiny random teacher of a supported family (GQA 4 query / 2 KV heads, head_dim 16)."""
    torch.manual_seed(seed)
    kw = {**TINY, **over}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))  # q/k/v biases
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))  # q/k norm
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw))
    else:
        raise ValueError(family)
    # Random biases/norm weights so that carrying them over is actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.normal_(0.0, 0.5 if "bias" in name else 0.2).add_(1.0 if "norm" in name else 0.0)
    return model.eval()


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls are dominated by thread-pool wake-ups on a busy 2-core box.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
