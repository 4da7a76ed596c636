"""Phi-3: fused qkv_proj and gate_up_proj read as views of their rows; a tiny random Phi-3 converts (Taylor-Calibrate,
both targets), saves and reloads with bit-identical logits, decodes in FastDecoder, and exports to the Qwen3.5 layout
that transformers loads with the hybrid's logits (also with Phi-4-mini's partial rotary factor). The
parametrised conversion and export tests run it too (tests/helpers.py FAMILIES)."""
import json

import pytest
import torch
from helpers import TINY, assert_close, tiny_teacher, word_tokenizer
from transformers import AutoModelForCausalLM

import tcal
from tcal import families
from tcal.cli import main

PHI3 = families.get("phi3")


def ids(B=2, T=24, seed=0):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_fused_projections_are_read_as_views_of_their_rows():
    teacher = tiny_teacher("phi3")
    attn = teacher.model.layers[1].self_attn
    w = PHI3.attention_weights(attn)
    qkv = attn.qkv_proj.weight  # (H d + 2 KV d, D): [q | k | v]
    assert torch.equal(torch.cat([w.q, w.k, w.v]), qkv) and w.q.shape == (64, 64) and w.k.shape == (32, 64)
    assert w.q.data_ptr() == qkv.data_ptr() and w.o is attn.o_proj.weight
    assert w.q_bias is w.q_norm is None
    gate_up = teacher.model.layers[1].mlp.gate_up_proj.weight
    parts = dict(PHI3.split_fused("model.layers.1.mlp.gate_up_proj.weight", gate_up))
    assert torch.equal(parts["model.layers.1.mlp.gate_proj.weight"], gate_up[:96])
    assert torch.equal(parts["model.layers.1.mlp.up_proj.weight"], gate_up[96:])
    assert PHI3.split_fused("model.norm.weight", gate_up) == [("model.norm.weight", gate_up)]


@pytest.mark.parametrize("target", ["native", "qwen3_5"])
def test_taylor_conversion_saves_and_reloads_bit_identical(tmp_path, target):
    teacher = tiny_teacher("phi3")
    hybrid = tcal.convert(teacher, keep=[0, 2], init="taylor", calib_ids=ids(B=6), target=target).eval()
    assert hybrid.config.target == target and hybrid.config.layer_types[1] == "linear_attention"
    for key, value in teacher.model.layers[0].state_dict().items():  # a kept layer: the teacher's, fused as it was
        assert torch.equal(hybrid.model.layers[0].state_dict()[key], value), key
    hybrid.save_pretrained(tmp_path / "h")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h").eval()
    assert type(reloaded) is tcal.HybridForCausalLM
    with torch.no_grad():
        assert torch.equal(reloaded(ids()).logits, hybrid(ids()).logits)


def test_fast_decoder_greedy_equals_generate():
    from tcal.models.fast import FastDecoder

    hybrid = tcal.convert(tiny_teacher("phi3"), keep=[0, 2], init="copy").eval()
    prompt = ids(B=1, T=8, seed=3)
    with torch.no_grad():
        want = hybrid.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(FastDecoder(hybrid, max_len=32).generate(prompt, max_new_tokens=12), want)


@pytest.mark.parametrize("rotary", [1.0, 0.75])  # 0.75: Phi-4-mini's partial rotary embedding
def test_hf_export_is_a_qwen3_5_checkpoint_with_the_hybrids_logits(tmp_path, capsys, rotary):
    teacher = tiny_teacher("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": rotary})
    hybrid = tcal.convert(teacher, keep=[0, 2], init="taylor", calib_ids=ids(B=6)).eval()
    hybrid.save_pretrained(tmp_path / "h")
    word_tokenizer([f"w{i}" for i in range(TINY["vocab_size"] - 2)]).save_pretrained(tmp_path / "h")
    assert main(["export", str(tmp_path / "h"), "--out", str(tmp_path / "exp")]) == 0, capsys.readouterr().err
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["partial_rotary_factor"] == rotary
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exp").eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    sd = model.state_dict()
    gate_up = teacher.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(sd["model.layers.1.mlp.gate_proj.weight"], gate_up[:96])
    assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"], gate_up[96:])
    with torch.no_grad():
        assert_close(model(ids()).logits, hybrid(ids()).logits, 1e-5, f"Phi-3 export, rotary {rotary}")


def test_a_phi3_gguf_is_a_teacher_tcal_converts(tmp_path):
    """A Phi-3 GGUF (llama.cpp's phi3) passes the check made before a teacher loads; another architecture does not."""
    from helpers import header_gguf

    from tcal.conversion.resolve import check_teacher_spec
    from tcal.utils.errors import TcalError

    for arch in ("phi3", "falcon"):
        header_gguf(tmp_path / f"{arch}.gguf", arch)
    assert families.by_gguf_architecture("phi3") == [PHI3]
    check_teacher_spec(str(tmp_path / "phi3.gguf"))
    with pytest.raises(TcalError, match="architecture 'falcon', which tcal does not convert; tcal converts .*phi3"):
        check_teacher_spec(str(tmp_path / "falcon.gguf"))
