"""`tcal export --format hf`: a checkpoint plain transformers loads as Qwen3_5ForCausalLM in a process that cannot
import tcal, with the hybrid's logits and greedy tokens; the command's bad input."""
import json
import subprocess
import sys

import pytest
import torch
from helpers import TINY, assert_close, target_hybrid, tiny_teacher, word_tokenizer

import tcal
from tcal.cli import main

# run in a fresh interpreter where `import tcal` fails: what a serving machine without tcal sees
WITHOUT_TCAL = """
import sys
sys.modules["tcal"] = None
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(input_ids=ids).logits
    tokens = model.generate(ids[:1], max_new_tokens=64, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "tokens": tokens, "class": type(model).__name__,
            "tcal": any(m == "tcal" or m.startswith("tcal.") for m in sys.modules if sys.modules[m] is not None)},
           sys.argv[3])
"""


def vocab_tokenizer():
    """A word tokenizer with as many tokens as the tiny hybrids' embedding rows (an hf export carries one)."""
    return word_tokenizer([f"w{i}" for i in range(TINY["vocab_size"] - 2)])


def export(capsys, *argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_hf_export_loads_without_tcal(tmp_path, capsys, family):
    hybrid, _ = target_hybrid(family, short_conv=family == "llama")
    hybrid.save_pretrained(tmp_path / "hybrid")
    vocab_tokenizer().save_pretrained(tmp_path / "hybrid")
    code, err = export(capsys, "export", tmp_path / "hybrid", "--out", tmp_path / "exp")
    assert code == 0, err
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    # what vLLM and SGLang read besides transformers' keys (tests/export/test_engine_configs.py runs their code on it)
    assert cfg["qkv_bias"] == cfg["attention_bias"] == (family == "qwen2") and cfg["mamba_ssm_dtype"] == "float32"
    assert cfg["partial_rotary_factor"] == cfg["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert "full_attention_interval" not in cfg  # attention at 0 and 2 of 4 layers: not a periodic placement
    rec = json.loads((tmp_path / "exp" / "export.json").read_text())
    assert rec["check"]["rel_err"] <= 1e-5 and rec["check"]["tokenizer"] == "same ids"
    assert rec["check"]["bf16_rel_err"] > 1e-4  # bfloat16 compute rounds; measured, not assumed
    runs = {e["engine"]: e["runs"] for e in rec["engines"]}
    assert runs == {"transformers": "exactly", "vLLM": "with rounding", "SGLang": "cannot"}
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", WITHOUT_TCAL, tmp_path / "exp", tmp_path / "ids.pt", tmp_path / "got.pt"],
                   check=True, capture_output=True)
    got = torch.load(tmp_path / "got.pt")
    assert got["class"] == "Qwen3_5ForCausalLM" and not got["tcal"]
    with torch.no_grad():
        assert_close(got["logits"], hybrid(input_ids=ids).logits, 1e-5, f"{family} exported logits")
        want = hybrid.generate(ids[:1], max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(got["tokens"], want)


def test_hf_export_carries_tokenizer_and_bf16(tmp_path, capsys):
    tok = word_tokenizer(["the", "cat", "sat"] + [f"w{i}" for i in range(90)])
    hybrid, _ = target_hybrid("llama", vocab_size=len(tok))
    hybrid.save_pretrained(tmp_path / "hybrid")
    tok.save_pretrained(tmp_path / "hybrid")
    code, err = export(capsys, "export", tmp_path / "hybrid", "--out", tmp_path / "exp", "--dtype", "bfloat16")
    assert code == 0, err
    from safetensors import safe_open
    from transformers import AutoTokenizer

    with safe_open(str(tmp_path / "exp" / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.layers.0.self_attn.q_norm.weight"] == "F32" and dtypes["model.embed_tokens.weight"] == "BF16"
    assert AutoTokenizer.from_pretrained(tmp_path / "exp")("the cat")["input_ids"] == tok("the cat")["input_ids"]
    assert json.loads((tmp_path / "exp" / "export.json").read_text())["check"]["top1_agree"] >= 0.9


def test_export_bad_input(tmp_path, capsys):
    native = tcal.convert(tiny_teacher("llama"), keep=[0, 2], init="copy", target="native")
    with torch.no_grad():
        native.model.layers[3].self_attn.b_proj.bias.fill_(0.25)
    native.save_pretrained(tmp_path / "native")
    teacher = tiny_teacher("llama")
    teacher.save_pretrained(tmp_path / "teacher")

    def one_error(message, *argv):
        code, err = export(capsys, "export", *argv)
        lines = [line for line in err.splitlines() if line.startswith("tcal: error: ")]
        assert code == 2 and len(lines) == 1 and message in lines[0], err

    one_error("model.layers.3.self_attn.b_proj.bias: the layout's GDN projections have no bias; convert with "
              "--target qwen3_5", tmp_path / "native", "--out", tmp_path / "a")
    tcal.convert(tiny_teacher("llama", rms_norm_eps=1e-5), keep=[0, 2], init="copy",
                 target="native").save_pretrained(tmp_path / "eps")
    one_error("RMSNorm eps is 1e-05; llama.cpp would", tmp_path / "eps", "--out", tmp_path / "a",
              "--format", "gguf", "--no-check")
    one_error("holds no tcal hybrid (model_type 'llama')", tmp_path / "teacher", "--out", tmp_path / "a")
    one_error("is not a directory", tmp_path / "missing", "--out", tmp_path / "a")
    assert not (tmp_path / "a").exists()
    hybrid, _ = target_hybrid("llama")
    hybrid.save_pretrained(tmp_path / "h")
    vocab_tokenizer().save_pretrained(tmp_path / "h")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    one_error("holds files tcal did not write", tmp_path / "h", "--out", tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    one_error("--dtype float16 cannot hold the linearised attention q/k norms", tmp_path / "h", "--out",
              tmp_path / "b", "--dtype", "float16")
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "h"), "--out", str(tmp_path / "b"), "--gguf-type", "q3_k"])
    assert not (tmp_path / "b").exists()
