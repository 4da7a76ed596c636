"""`tcal export` says no before the work: another model's GGUF tokenizer, a teacher the layout cannot hold, a hybrid
without a tokenizer, options of the other format, an engine that cannot run the hybrid. Each is one
`tcal: error:` line (exit 2) and leaves no output directory."""
import json

import pytest
from helpers import TINY, target_hybrid, tiny_teacher, word_tokenizer
from test_export_gguf import byte_bpe_tokenizer

import tcal
from tcal.cli import main
from tcal.engines.llamacpp import load
from tcal.utils.errors import TcalError


def words(n):
    return word_tokenizer([f"w{i}" for i in range(n - 2)])


def run(capsys, *argv):
    code = main([str(a) for a in ("export", *argv)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def one_error(capsys, message, *argv, out=None):
    code, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.startswith("tcal: error: ")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    if out is not None:
        assert not out.exists()
    return lines[0]


@pytest.fixture()
def hybrid_dir(tmp_path):
    """A tiny qwen3_5-target hybrid (attention at 0 and 2 of 4 layers) saved with a tokenizer of its 97 rows."""
    hybrid, _ = target_hybrid("llama")
    hybrid.save_pretrained(tmp_path / "h")
    words(TINY["vocab_size"]).save_pretrained(tmp_path / "h")
    return tmp_path / "h"


def test_another_models_gguf_vocabulary(tmp_path, capsys, hybrid_dir):
    """Another model's GGUF tokenizer (some 300 tokens against 97 embedding rows): named before the file is written,
    checked or not; the API refuses to write such a file."""
    tok = byte_bpe_tokenizer()
    n = len(tok)
    other, _ = target_hybrid("llama", vocab_size=n)
    other.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    code, err = run(capsys, tmp_path / "other", "--out", tmp_path / "o", "--format", "gguf", "--gguf-type", "f32")
    assert code == 0, err
    other_gguf = tmp_path / "o" / "model-f32.gguf"
    for extra in ((), ("--no-check",)):
        one_error(capsys, f"has {n} tokens and the hybrid's embedding 97 rows: it is another model's tokenizer",
                  hybrid_dir, "--out", tmp_path / "x", "--format", "gguf", "--gguf-vocab", other_gguf, *extra,
                  out=tmp_path / "x")
    from tcal.export.gguf import write_gguf
    from tcal.export.qwen3_5 import to_qwen3_5
    from tcal.export.vocab import from_gguf

    layout = to_qwen3_5(target_hybrid("llama")[0])
    with pytest.raises(TcalError, match=f"has {n} tokens and the hybrid's embedding 97 rows"):
        write_gguf(tmp_path / "api.gguf", layout.config, layout.state_dict, from_gguf(other_gguf), "f32")
    assert not (tmp_path / "api.gguf").exists()


def test_a_tokenizer_shorter_than_the_embedding_is_padded(tmp_path, capsys):
    """Seven embedding rows more than tokens (Qwen2.5 ships 151,665 tokens for 151,936 rows): the GGUF's token list
    is padded with unused placeholders to the rows, so llama.cpp loads it and tokenises as the tokenizer does."""
    tok = byte_bpe_tokenizer()
    hybrid, _ = target_hybrid("llama", vocab_size=len(tok) + 7)
    hybrid.save_pretrained(tmp_path / "h")
    tok.save_pretrained(tmp_path / "h")
    code, err = run(capsys, tmp_path / "h", "--out", tmp_path / "g", "--format", "gguf", "--gguf-type", "f32")
    assert code == 0, err
    assert json.loads((tmp_path / "g" / "export.json").read_text())["check"]["tokenizer"] == "same ids"
    llm = load(tmp_path / "g" / "model-f32.gguf", vocab_only=True)
    assert llm.n_vocab() == len(tok) + 7


def test_a_teacher_the_layout_cannot_hold_gets_no_circular_advice(tmp_path, capsys):
    """A Gemma 3 hybrid (native target): the export says what the layout cannot hold and where the hybrid runs,
    and does not send the user to --target qwen3_5 (which refuses Gemma 3 and points back at native)."""
    gemma = tcal.convert(tiny_teacher("gemma3"), keep=[0, 2], init="copy")
    assert gemma.config.target == "native"
    gemma.save_pretrained(tmp_path / "g")
    for fmt in ("hf", "gguf"):
        line = one_error(capsys, "the Qwen3.5 layout cannot hold any hybrid of this teacher: the teacher is a "
                         "'gemma3_text' model", tmp_path / "g", "--out", tmp_path / "x", "--format", fmt,
                         "--no-check", out=tmp_path / "x")
        assert "runs where tcal is imported" in line and "not in vLLM, SGLang or llama.cpp" in line
        assert "--target" not in line


def test_hybrid_without_tokenizer_files(tmp_path, capsys):
    """The hf export takes the tokenizer of the teacher the hybrid records, else refuses: never a checkpoint whose
    tokenizer encodes text as nothing."""
    teacher = tiny_teacher("llama")
    teacher.save_pretrained(tmp_path / "teacher")
    tok = words(TINY["vocab_size"])
    tok.save_pretrained(tmp_path / "teacher")
    hybrid, _ = target_hybrid("llama")
    hybrid.save_pretrained(tmp_path / "h")
    one_error(capsys, "has no tokenizer files and records no teacher", tmp_path / "h", "--out", tmp_path / "x",
              out=tmp_path / "x")
    (tmp_path / "h" / "tcal_config.json").write_text(json.dumps({"stage": "convert", "teacher": str(tmp_path / "teacher")}))
    code, err = run(capsys, tmp_path / "h", "--out", tmp_path / "e")
    assert code == 0, err
    rec = json.loads((tmp_path / "e" / "export.json").read_text())
    assert rec["tokenizer"] == f"the teacher's ({tmp_path / 'teacher'})" and rec["check"]["tokenizer"] == "same ids"
    assert f"tokenizer: the teacher's ({tmp_path / 'teacher'})" in (tmp_path / "e" / "export.md").read_text()
    from transformers import AutoTokenizer

    text = "w3 w17 w40 w95"
    assert AutoTokenizer.from_pretrained(tmp_path / "e")(text)["input_ids"] == tok(text)["input_ids"]
    # a teacher recorded but gone: its tokenizer cannot be loaded, and the error says what to do
    (tmp_path / "h" / "tcal_config.json").write_text(json.dumps({"teacher": str(tmp_path / "gone")}))
    one_error(capsys, "save the teacher's tokenizer into the hybrid's directory", tmp_path / "h", "--out",
              tmp_path / "y", out=tmp_path / "y")


def test_options_of_the_other_format(tmp_path, capsys, hybrid_dir):
    one_error(capsys, "--gguf-type is for --format gguf", hybrid_dir, "--out", tmp_path / "x", "--gguf-type", "q8_0",
              out=tmp_path / "x")
    one_error(capsys, "--gguf-vocab is for --format gguf", hybrid_dir, "--out", tmp_path / "x", "--gguf-vocab",
              tmp_path / "t.gguf", out=tmp_path / "x")
    one_error(capsys, "--dtype is for --format hf", hybrid_dir, "--out", tmp_path / "x", "--format", "gguf",
              "--dtype", "bfloat16", out=tmp_path / "x")


def test_an_engine_that_cannot_run_the_hybrid(tmp_path, capsys, hybrid_dir):
    """--engines names engines the export must run in: one that cannot is refused before any work, with its reason;
    without --engines the export is written and names the engine that cannot run it in one line."""
    one_error(capsys, "SGLang cannot run this hybrid: it places attention by full_attention_interval alone",
              hybrid_dir, "--out", tmp_path / "x", "--engines", "vllm,sglang", out=tmp_path / "x")
    one_error(capsys, "--format hf is not for llama.cpp; llama.cpp runs --format gguf", hybrid_dir, "--out",
              tmp_path / "x", "--engines", "llama.cpp", out=tmp_path / "x")
    code, err = run(capsys, hybrid_dir, "--out", tmp_path / "w", "--no-check")
    assert code == 0 and err.count("tcal: SGLang cannot run this export: ") == 1, err
    assert "| SGLang | SGLang 0.5.17-0.5.23 (read: 0.5.17, 0.5.23) | cannot |" in (tmp_path / "w" / "export.md").read_text()
    # a qwen2 hybrid: vLLM runs its biases through qkv_bias, SGLang has none
    biased, _ = target_hybrid("qwen2", num_hidden_layers=4, keep=(1, 3))
    biased.save_pretrained(tmp_path / "b")
    words(TINY["vocab_size"]).save_pretrained(tmp_path / "b")
    one_error(capsys, "SGLang cannot run this hybrid: its attention has no q/k/v or o_proj bias", tmp_path / "b",
              "--out", tmp_path / "x", "--engines", "sglang", out=tmp_path / "x")
    code, err = run(capsys, tmp_path / "b", "--out", tmp_path / "bv", "--engines", "transformers,vllm")
    assert code == 0, err
    periodic, _ = target_hybrid("llama", num_hidden_layers=4, keep=(1, 3))
    periodic.save_pretrained(tmp_path / "p")
    words(TINY["vocab_size"]).save_pretrained(tmp_path / "p")
    code, err = run(capsys, tmp_path / "p", "--out", tmp_path / "pe", "--engines", "sglang", "--dtype", "bfloat16")
    assert code == 0 and "cannot" not in err, err
    assert json.loads((tmp_path / "pe" / "config.json").read_text())["full_attention_interval"] == 2


def test_without_llama_cpp_a_4_bit_export_names_a_type_tcal_writes_itself(tmp_path, capsys, hybrid_dir, monkeypatch):
    """--no-check cannot help a 4-bit type: llama.cpp's quantiser makes the file. The error says what can."""
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    for extra in ((), ("--no-check",)):
        err = one_error(capsys, "a q4_k_m GGUF is made by llama.cpp's quantiser, which comes with llama-cpp-python",
                        hybrid_dir, "--format", "gguf", "--gguf-type", "q4_k_m", *extra, "--out", tmp_path / "x",
                        out=tmp_path / "x")
        assert "--gguf-type q8_0" in err and "--no-check" not in err
    one_error(capsys, "checking a GGUF needs llama-cpp-python", hybrid_dir, "--format", "gguf", "--out",
              tmp_path / "x", out=tmp_path / "x")  # where --no-check does help, it is still said
