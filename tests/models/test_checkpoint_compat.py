"""Hybrids saved by earlier tcal versions still load through transformers' Auto classes and reproduce the
logits they gave when they were saved: hybrid_v0 from before the package was restructured (3c32d23), hybrid_v1
a `qwen3_5`-target hybrid of a tiny Llama from before the GDN options were declared once (8d3cdae)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).parents[1] / "fixtures"  # tests/fixtures


@pytest.mark.parametrize("name", ["hybrid_v0", "hybrid_v1"])
def test_checkpoint_of_an_earlier_version_loads_with_its_logits(tmp_path, name):
    from transformers import AutoModelForCausalLM

    import tcal  # noqa: F401  (registers the tcal_hybrid model type)

    model = AutoModelForCausalLM.from_pretrained(FIXTURE / name, dtype=torch.float32).eval()
    assert type(model).__name__ == "HybridForCausalLM"
    assert model.config.layer_types == ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    ref = load_file(FIXTURE / f"{name}_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], use_cache=False).logits
    # The stored logits were computed on another machine: CPUs of other kinds pick other fp32 GEMM kernels
    # (AVX2, AVX-512, AMX) whose sums round differently, ~2e-7 here on values up to 0.45. A weight loaded into
    # the wrong place or not at all moves them by 1e-2 and more. Bit-exact reloading is checked on this machine.
    err = float((logits - ref["logits"]).abs().max() / ref["logits"].abs().max())
    assert err < 1e-5, f"logits differ from the saved ones by {err:.2e} of their largest value"
    assert torch.equal(logits.argmax(-1), ref["logits"].argmax(-1))

    from tcal.train.checkpoint import save_model

    save_model(model, tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ref["input_ids"], use_cache=False).logits, logits)
