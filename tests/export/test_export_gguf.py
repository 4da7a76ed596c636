"""`tcal export --format gguf`: llama.cpp (llama-cpp-python) runs the GGUF as the hybrid, for every teacher family;
its tokenizer is the hybrid's; each file type keeps what it cannot round in f32."""
import json

import gguf
import numpy as np
import pytest
import torch
from helpers import assert_close, block_import, byte_bpe_tokenizer, target_hybrid, tiny_teacher

import tcal
from tcal import families
from tcal.cli import main
from tcal.engines.llamacpp import load


def export(tmp_path, capsys, hybrid, *extra, tok=None, name="exp"):
    hybrid.save_pretrained(tmp_path / "hybrid")
    if tok is not None:
        tok.save_pretrained(tmp_path / "hybrid")
    code = main([str(a) for a in ("export", tmp_path / "hybrid", "--out", tmp_path / name, "--format", "gguf", *extra)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def llama(path, n_ctx=256):
    """llama.cpp with an f32 KV cache (its default f16 cache rounds keys and values: the model is what is compared)"""
    return load(path, n_ctx, logits_all=True, threads=1, kv_cache="f32")


def gguf_logits(path, ids):
    llm = llama(path)
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))


def gguf_greedy(path, prompt, n):
    llm = llama(path)
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def test_f32_gguf_is_the_hybrid(tmp_path, capsys, family, short_conv):
    hybrid, _ = target_hybrid(family, short_conv=short_conv)
    code, err = export(tmp_path, capsys, hybrid, "--gguf-type", "f32")
    assert code == 0, err
    path = tmp_path / "exp" / "model-f32.gguf"
    ids = torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = hybrid(input_ids=torch.tensor([ids])).logits[0]
        greedy = hybrid.generate(torch.tensor([ids[:10]]), max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert_close(gguf_logits(path, ids), want, 1e-5, f"{family} llama.cpp f32 logits")
    assert gguf_greedy(path, ids[:10], 64) == greedy[0, 10:].tolist()


@pytest.mark.parametrize("family", [f.name for f in families.FAMILIES.values() if f.teacher_gguf])
def test_teacher_gguf_in_its_own_architecture(tmp_path, family):
    """The llama.cpp rows' teacher, for every family that says teacher_gguf: Llama and Mistral as llama.cpp's llama
    (RoPE rows interleaved), Qwen2 and Qwen3 as qwen2 / qwen3, with the teacher's logits."""
    from tcal.conversion.resolve import check_teacher_spec
    from tcal.data.teacher_table import gguf_architecture
    from tcal.export.gguf import write_teacher_gguf

    teacher = tiny_teacher(family)
    write_teacher_gguf(teacher, tmp_path / "t.gguf", "f32")
    # written in the architecture its family is read back as, and accepted as a teacher
    assert families.get(family) in families.by_gguf_architecture(gguf_architecture(tmp_path / "t.gguf"))
    check_teacher_spec(str(tmp_path / "t.gguf"))
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        want = teacher(input_ids=torch.tensor([ids])).logits[0]
    assert_close(gguf_logits(tmp_path / "t.gguf", ids), want, 1e-5, f"{family} teacher in llama.cpp")


def test_gguf_types_and_their_error(tmp_path, capsys):
    hybrid, _ = target_hybrid("llama")
    ids = torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        want = hybrid(input_ids=torch.tensor([ids])).logits[0]
    for kind, tol in (("f16", 3e-2), ("bf16", 8e-2), ("q8_0", 8e-2)):
        code, err = export(tmp_path, capsys, hybrid, "--gguf-type", kind, name=kind)
        assert code == 0, err
        types = json.loads((tmp_path / kind / "export.json").read_text())["tensor_types"]
        # fp16 (and q8_0's fp16 block scales) would flush the q/k weights' 2^-k scale to zero; bf16 holds it
        assert types["blk.0.attn_q.weight"] == types["blk.0.attn_k.weight"] == "BF16"
        assert types["blk.1.ssm_conv1d.weight"] == "F32" and types["blk.1.ssm_norm.weight"] == "F32"
        assert types["blk.1.attn_qkv.weight"] == {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[kind]
        assert_close(gguf_logits(tmp_path / kind / f"model-{kind}.gguf", ids), want, tol, f"llama.cpp {kind} logits")


def test_gguf_placement_keys(tmp_path, capsys):
    hybrid, _ = target_hybrid("llama", num_hidden_layers=8)  # attention kept at 0 and 2: not Qwen's periodic layout
    assert export(tmp_path, capsys, hybrid, "--gguf-type", "f32")[0] == 0
    r = gguf.GGUFReader(str(tmp_path / "exp" / "model-f32.gguf"))
    assert r.fields["general.architecture"].contents() == "qwen35"
    assert r.fields["qwen35.attention.recurrent_layers"].contents() == [i not in (0, 2) for i in range(8)]
    assert "qwen35.full_attention_interval" not in r.fields
    periodic = target_hybrid("llama", num_hidden_layers=8, keep=(3, 7))[0]  # Qwen's own placement, interval 4
    assert export(tmp_path, capsys, periodic, "--gguf-type", "f32", name="periodic")[0] == 0
    r = gguf.GGUFReader(str(tmp_path / "periodic" / "model-f32.gguf"))
    assert r.fields["qwen35.full_attention_interval"].contents() == 4


def test_gguf_tokenizer_from_a_transformers_tokenizer(tmp_path, capsys):
    tok = byte_bpe_tokenizer()
    hybrid, _ = target_hybrid("llama", vocab_size=len(tok))
    code, err = export(tmp_path, capsys, hybrid, "--gguf-type", "f32", tok=tok)
    assert code == 0, err
    rec = json.loads((tmp_path / "exp" / "export.json").read_text())
    assert rec["check"]["tokenizer"] == "same ids" and "pre-tokenizer llama-bpe" in rec["tokenizer"]
    llm = load(tmp_path / "exp" / "model-f32.gguf", vocab_only=True)
    for text in ("the cat sat on the old bridge", "In 1771, 23 floods!", " leading  spaces\nand lines"):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok(text, add_special_tokens=False)["input_ids"]


def test_gguf_bad_input(tmp_path, capsys, monkeypatch):
    def one_error(message, hybrid, *extra):
        code, err = export(tmp_path, capsys, hybrid, *extra)
        lines = [line for line in err.splitlines() if line.startswith("tcal: error: ")]
        assert code == 2 and len(lines) == 1 and message in lines[0], err
        assert not (tmp_path / "exp").exists()

    teacher = tiny_teacher("llama", attention_bias=True)  # an attention output bias llama.cpp's qwen35 has not
    one_error("self_attn.o_proj.bias: llama.cpp's qwen35 has no attention output bias",
              tcal.convert(teacher, keep=[0, 2], init="copy", target="qwen3_5"), "--gguf-type", "f32")
    scaled = tiny_teacher("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    one_error("RoPE is 'linear'; llama.cpp's qwen35 applies no RoPE scaling",
              tcal.convert(scaled, keep=[0, 2], init="copy", target="qwen3_5"))
    hybrid, _ = target_hybrid("llama")
    one_error("--gguf-vocab", hybrid, "--gguf-vocab", tmp_path / "nope.gguf")
    block_import(monkeypatch, "llama_cpp")
    one_error("pip install 'tcal[gguf]'", hybrid)
    assert export(tmp_path, capsys, hybrid, "--no-check")[0] == 0  # writing needs only the gguf package


def test_4bit_gguf_keeps_the_tensors_the_layout_needs(tmp_path, capsys):
    """q4_k_m and q4_0 are llama.cpp's quantiser on the f16 file: the scaled attention q/k weights stay bf16 (a 4-bit
    block's f16 scale flushes 2^-k W to zero, which the quantiser does to them when not told otherwise) and the
    gates and conv f32; llama.cpp loads and runs the file. How much 4 bits cost is measured on the real hybrid
    (docs/results.md): a tiny random model says nothing about it."""
    from gguf.quants import dequantize

    from tcal.export.gguf import quantise, write_gguf
    from tcal.export.qwen3_5 import to_qwen3_5
    from tcal.export.vocab import no_vocab

    hybrid, _ = target_hybrid("llama", hidden_size=256, intermediate_size=512)
    layout = to_qwen3_5(hybrid)
    scaled_q = layout.state_dict["model.layers.0.self_attn.q_proj.weight"]
    ids = torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(8)).tolist()
    for kind, quant in (("q4_k_m", {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}), ("q4_0", {"Q4_0", "Q6_K", "Q8_0"})):
        code, err = export(tmp_path, capsys, hybrid, "--gguf-type", kind, "--no-check", name=kind)
        assert code == 0, err
        path = tmp_path / kind / f"model-{kind}.gguf"
        types = json.loads((tmp_path / kind / "export.json").read_text())["tensor_types"]
        assert types["blk.0.attn_q.weight"] == types["blk.0.attn_k.weight"] == "BF16"
        assert {types[f"blk.1.{n}.weight"] for n in ("ssm_alpha", "ssm_beta", "ssm_conv1d", "ssm_norm")} == {"F32"}
        assert {types[f"blk.1.{n}.weight"] for n in ("attn_qkv", "attn_gate", "ssm_out", "ffn_up")} <= quant
        t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight")
        stored = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(scaled_q.shape)
        assert_close(stored, scaled_q, 1e-2, f"{kind} scaled q weights")  # bf16's rounding, not zeros
        assert torch.isfinite(gguf_logits(path, ids)).all()
    # what the kept types prevent: the quantiser left to itself flushes the scaled q weights
    write_gguf(tmp_path / "f16.gguf", layout.config, layout.state_dict, no_vocab(), "f16", scaled=layout.scaled)
    quantise(tmp_path / "f16.gguf", tmp_path / "plain.gguf", "q4_0", {})
    t = next(t for t in gguf.GGUFReader(str(tmp_path / "plain.gguf")).tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type.name == "Q4_0" and not np.any(dequantize(t.data, t.tensor_type))
