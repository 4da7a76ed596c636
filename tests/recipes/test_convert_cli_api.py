"""`tcal convert` (CLI) and `tcal.convert()` (API) reach the stage chain through the same function:
for the same teacher, layers, init and calibration data they give bit-identical GDN weights."""
import random

import pytest
import torch
from safetensors.torch import load_file

import tcal
from tcal.cli import main
from tcal.data.teachers import load_teacher
from tcal.taylor.phase2 import AlignConfig

WORDS = ("the cat sat on a mat dog ran far away and then came back home to old red big small tree house "
         "river hill road town king queen sun moon star day night").split()


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))
    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, bos_token_id=0))
    teacher.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    rng = random.Random(0)
    (tmp_path / "calib.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    return tmp_path


@pytest.mark.parametrize("init", ["taylor", "taylor-exact-silent", "phase2"])
def test_cli_and_api_give_bit_identical_gdn_weights(workspace, init):
    out = workspace / f"cli-{init}"
    argv = ["convert", "--teacher", workspace / "teacher", "--keep", "0,2", "--init", init,
            "--calib", workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 4, "--align-steps", 7,
            "--eval", "none", "--device", "cpu", "--out", out]
    assert main([str(a) for a in argv]) == 0
    cli = load_file(out / "model.safetensors")

    teacher, tok = load_teacher(str(workspace / "teacher"))
    hybrid = tcal.convert(teacher, keep=[0, 2], init=init, calib=str(workspace / "calib.txt"), tokenizer=tok,
                          calib_window=32, calib_windows=4, align=AlignConfig(steps=7))
    api = {k: v for k, v in hybrid.state_dict().items()}
    gdn = [k for k in api if k.startswith(("model.layers.1.self_attn.", "model.layers.3.self_attn."))]
    assert len(gdn) >= 10
    for k in gdn:
        assert torch.equal(cli[k], api[k]), f"{k} differs between `tcal convert` and tcal.convert()"
    if init != "phase2":  # Phase 1 moved the decay away from fla's random default, identically in both
        assert not torch.equal(api["model.layers.1.self_attn.dt_bias"],
                               tcal.convert(teacher, keep=[0, 2], init="copy").state_dict()[
                                   "model.layers.1.self_attn.dt_bias"])
