"""A hybrid saved by tcal before the package was restructured (main at 3c32d23) still loads
through transformers' Auto classes and reproduces the logits it gave when it was saved."""
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).parents[1] / "fixtures"  # tests/fixtures


def test_checkpoint_from_before_the_restructure_loads_with_identical_logits():
    import tcal  # noqa: F401  (registers the tcal_hybrid model type)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURE / "hybrid_v0", dtype=torch.float32).eval()
    assert type(model).__name__ == "HybridForCausalLM"
    assert model.config.layer_types == ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    ref = load_file(FIXTURE / "hybrid_v0_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], use_cache=False).logits
    assert torch.equal(logits, ref["logits"])
