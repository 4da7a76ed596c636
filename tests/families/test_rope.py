"""RoPE: a Llama 3.x teacher with ``llama3`` RoPE scaling converts, reloads and exports to transformers with its
RoPE (the Qwen3.5 checkpoint carries the teacher's rope_parameters); the GGUFs tcal writes hold plain RoPE only, and
say so in one line."""
import json

import pytest
import torch
from helpers import TINY, assert_close, tiny_teacher, word_tokenizer
from transformers import AutoModelForCausalLM

import tcal
from tcal.cli import main
from tcal.families.rope import gguf_rope_blocker, rope_parameters

# Llama 3.1's scaling, over a short original context so that the tiny model's positions reach the scaled band
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def ids(B=2, T=40, seed=0):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama3():
    teacher = tiny_teacher("llama", rope_parameters=dict(LLAMA3))
    plain = tiny_teacher("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.no_grad():  # the same weights: the scaling is what differs, and it changes the logits
        assert not torch.allclose(teacher(ids()).logits, plain(ids()).logits, atol=1e-4)
    return teacher


def test_rope_parameters_and_the_gguf_rule():
    assert rope_parameters(tiny_teacher("llama").config)["rope_type"] == "default"
    assert rope_parameters(tiny_teacher("llama", rope_parameters=dict(LLAMA3)).config)["factor"] == 8.0
    assert gguf_rope_blocker({"rope_type": "default"}, "qwen35") is None
    assert gguf_rope_blocker(LLAMA3, "llama") == ("the teacher's RoPE is 'llama3'; llama.cpp's llama applies no RoPE "
                                                  "scaling in the GGUFs tcal writes")


def test_llama3_rope_converts_reloads_and_exports_to_transformers(llama3, tmp_path, capsys):
    hybrid = tcal.convert(llama3, keep=[0, 2], init="taylor", calib_ids=ids(B=6, T=32)).eval()
    assert hybrid.config.target == "qwen3_5" and hybrid.config.teacher_config().rope_parameters["rope_type"] == "llama3"
    hybrid.save_pretrained(tmp_path / "h")
    word_tokenizer([f"w{i}" for i in range(TINY["vocab_size"] - 2)]).save_pretrained(tmp_path / "h")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids()).logits, hybrid(ids()).logits)
    assert main(["export", str(tmp_path / "h"), "--out", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    rope = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    assert {k: rope[k] for k in LLAMA3} == LLAMA3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert_close(model(ids()).logits, hybrid(ids()).logits, 1e-5, "llama3-RoPE export in transformers")
    # llama.cpp: a one-line refusal, before anything is written
    assert main(["export", str(tmp_path / "h"), "--format", "gguf", "--out", str(tmp_path / "gguf")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tcal: error: ")]
    assert err == ["tcal: error: the teacher's RoPE is 'llama3'; llama.cpp's qwen35 applies no RoPE scaling in the "
                   "GGUFs tcal writes: export --format hf instead"] and not (tmp_path / "gguf").exists()


def test_a_llama3_teacher_is_not_written_as_a_gguf(llama3, tmp_path):
    from tcal.export.gguf import teacher_gguf_blocker, write_teacher_gguf
    from tcal.utils.errors import TcalError

    assert teacher_gguf_blocker(tiny_teacher("llama").config) is None
    with pytest.raises(TcalError, match="RoPE is 'llama3'; llama.cpp's llama applies no RoPE scaling"):
        write_teacher_gguf(llama3, tmp_path / "t.gguf", "f32")
