"""Saving and loading a hybrid: safetensors only, Auto classes, bit-exact, nothing left on failure."""
import os

import pytest
import torch
from helpers import tiny_teacher
from transformers import AutoConfig, AutoModelForCausalLM

import tcal

KEEP = [0, 2]


def ids(B=2, T=21, seed=1):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_save_load_roundtrip_bit_exact(tmp_path, family):
    hybrid = tcal.convert(tiny_teacher(family), keep=KEEP, init="copy", use_short_conv=True)
    hybrid.save_pretrained(tmp_path / "h")
    files = sorted(os.listdir(tmp_path / "h"))
    assert "model.safetensors" in files and "config.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".pth"))]
    assert AutoConfig.from_pretrained(tmp_path / "h").model_type == "tcal_hybrid"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h")
    assert type(reloaded) is tcal.HybridForCausalLM
    x = ids()
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(x).logits, hybrid.eval()(x).logits)


def test_load_in_another_dtype_casts_every_module(tmp_path):
    """from_pretrained(dtype=bf16) of a float32 hybrid: the teacher's own modules too, not only the GDN layers
    (a mix fails at the first matmul)."""
    hybrid = tcal.convert(tiny_teacher("llama"), keep=KEEP, init="copy")
    hybrid.save_pretrained(tmp_path / "h")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h", dtype=torch.bfloat16)
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        want = hybrid.eval()(ids()).logits
        got = reloaded.eval()(ids()).logits.float()
    assert float((got - want).norm() / want.norm()) < 5e-2
    assert {p.dtype for p in AutoModelForCausalLM.from_pretrained(tmp_path / "h").parameters()} == {torch.float32}


def test_failed_save_leaves_no_directory(tmp_path, monkeypatch):
    hybrid = tcal.convert(tiny_teacher("llama"), keep=KEEP, init="copy")
    from transformers import PreTrainedModel

    def boom(self, path, *a, **k):
        (path / "partial.safetensors").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", boom)
    with pytest.raises(OSError):
        hybrid.save_pretrained(tmp_path / "out")
    assert os.listdir(tmp_path) == []
