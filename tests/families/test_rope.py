"""RoPE: a Llama 3.x teacher with ``llama3`` RoPE scaling converts, reloads and exports to transformers with its
RoPE (the Qwen3.5 checkpoint carries the teacher's rope_parameters); the Llama family writes it into a teacher GGUF of
llama.cpp's llama architecture (its frequency factors), and refuses a hybrid GGUF (qwen35 loads none) in one line.
Every other scaling is refused in GGUFs by the plain rule."""
import json

import pytest
import torch
from helpers import TINY, assert_close, tiny_teacher, word_tokenizer
from transformers import AutoModelForCausalLM

import tcal
from tcal import families
from tcal.cli import main
from tcal.families.rope import PLAIN_ROPE, rope_parameters

# Llama 3.1's scaling, over a short original context so that the tiny model's head (dim 16) has a frequency in each
# band: kept (wavelength below 64 / 4), blended, divided by the factor (above 64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def ids(B=2, T=40, seed=0):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama3():
    teacher = tiny_teacher("llama", rope_parameters=dict(LLAMA3))
    plain = tiny_teacher("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.no_grad():  # the same weights: the scaling is what differs, and it changes the logits
        assert not torch.allclose(teacher(ids()).logits, plain(ids()).logits, atol=1e-4)
    return teacher


def test_rope_parameters_and_the_gguf_rules():
    assert rope_parameters(tiny_teacher("llama").config)["rope_type"] == "default"
    assert rope_parameters(tiny_teacher("llama", rope_parameters=dict(LLAMA3)).config)["factor"] == 8.0
    assert PLAIN_ROPE.blocker({"rope_type": "default"}, "qwen35") is None
    assert PLAIN_ROPE.blocker(LLAMA3, "llama") == ("the teacher's RoPE is 'llama3'; llama.cpp's llama applies no RoPE "
                                                   "scaling in the GGUFs tcal writes")
    llama, mistral = families.get("llama"), families.get("mistral")
    assert llama.gguf_rope.blocker(LLAMA3, "llama") is None  # Llama's own rule: its architecture holds llama3
    assert "does not load" in llama.gguf_rope.blocker(LLAMA3, "qwen35")
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert llama.gguf_rope.blocker(linear, "llama") == PLAIN_ROPE.blocker(linear, "llama")
    assert mistral.gguf_rope.blocker(LLAMA3, "llama") == PLAIN_ROPE.blocker(LLAMA3, "llama")


def test_llama3_factors_are_transformers_own():
    """The factors the Llama family writes are what transformers divides each rotary frequency by."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_teacher("llama", rope_parameters=dict(LLAMA3)).config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / LLAMA3["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    factors = torch.tensor(families.get("llama").gguf_rope.tensors(config, "llama")["rope_freqs.weight"],
                           dtype=torch.float64)
    assert factors.shape == (8,) and factors.min() == 1.0 and factors.max() == 8.0  # every band
    assert 1.0 < factors[1] < 8.0
    torch.testing.assert_close(factors, plain / scaled.double(), rtol=1e-6, atol=0)


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
    assert err == ["tcal: error: the teacher's RoPE is Llama 3's 'llama3' scaling, which llama.cpp holds as "
                   "per-frequency factors (rope_freqs) that its qwen35 architecture does not load: export --format hf "
                   "instead"] and not (tmp_path / "gguf").exists()


def test_a_llama3_teacher_gguf_runs_in_llama_cpp_with_its_rope(llama3, tmp_path):
    """The Llama family's hook: the frequency factors in rope_freqs.weight, and llama.cpp gives the teacher's logits
    (the plain teacher of the same weights gives others: the scaling is what is tested)."""
    import numpy as np

    from tcal.engines.llamacpp import load
    from tcal.export.gguf import teacher_gguf_blocker, write_teacher_gguf

    assert teacher_gguf_blocker(llama3.config) is None
    types = write_teacher_gguf(llama3, tmp_path / "t.gguf", "f32")
    assert types["rope_freqs.weight"] == "F32"
    llm = load(tmp_path / "t.gguf", 128, logits_all=True, threads=1, kv_cache="f32")
    llm.eval(ids(B=1)[0].tolist())
    got = torch.from_numpy(np.array(llm.scores[:40], dtype=np.float32))
    llm.close()
    with torch.no_grad():
        want = llama3(ids(B=1)).logits[0]
    assert_close(got, want, 1e-5, "llama3 teacher in llama.cpp")
