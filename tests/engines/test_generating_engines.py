"""The engines that generate, as objects: an engine's runner opens a model and generates, and HumanEval generates
through it. The same hybrid, run by tcal and exported to an f32 GGUF run by llama.cpp, writes the same greedy text
through either engine, alone and inside `tcal eval --task humaneval`."""
import json

import pytest
from helpers import byte_bpe_tokenizer, run, target_hybrid

from tcal import engines
from tcal.cli import main
from tcal.engines.rows import BENCH_ROWS
from tcal.utils.errors import TcalError

PROMPTS = ["def add(a, b):\n    return", "The river rose through the night", "In 1771 the flood"]
STOPS = ("\n\n", "bridge")


def cut(text):
    """The text up to the first stop. A random model writes byte tokens that are no UTF-8 on their own: transformers
    decodes each as U+FFFD, llama.cpp drops it, so both are compared without them."""
    text = clean(text)
    ends = [i for i in (text.find(s) for s in STOPS) if i >= 0]
    return text[:min(ends)] if ends else text


def clean(text):
    return text.replace("\ufffd", "")


def same_greedy_text(ours, theirs):
    """llama-cpp-python finishes a character that max_tokens cut in the middle of its bytes, so its answer may run a
    few tokens past tcal's: tcal's is the start of llama.cpp's, and says something."""
    return len(ours) >= 4 and theirs.startswith(ours)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A hybrid with a byte-level BPE tokenizer, saved, and its f32 GGUF export (the tokenizer inside)."""
    root = tmp_path_factory.mktemp("engines")
    tok = byte_bpe_tokenizer()
    hybrid, _ = target_hybrid("llama", vocab_size=len(tok), max_position_embeddings=512)
    hybrid.save_pretrained(root / "hybrid")
    tok.save_pretrained(root / "hybrid")
    assert main([str(a) for a in ("export", root / "hybrid", "--format", "gguf", "--gguf-type", "f32", "--out",
                                  root / "gguf")]) == 0
    return hybrid, tok, root


def test_the_generating_engines_have_runners_and_the_others_none():
    assert engines.GENERATING == tuple(k for k, e in engines.ENGINES.items() if e.runner is not None)
    for e in engines.ENGINES.values():
        assert e.generates == (e.runner is not None)
    with pytest.raises(TcalError, match="unknown engine 'tgi'; the engines are tcal, transformers"):
        engines.get("tgi")
    # every bench row names an engine tcal runs: the tcal rows the model it loads, the others an export's file
    assert {engines.get(r.engine).generates for r in BENCH_ROWS.values()} == {True}
    assert {r.reads for r in BENCH_ROWS.values()} <= {e.reads for e in engines.ENGINES.values()}


def opened(engine, exported):
    """``engine``'s generator on the exported hybrid: the loaded model where the engine runs it, else the export of
    the format it reads, found by its runner (an engine that needs software not installed here is skipped)."""
    hybrid, tok, root = exported
    try:
        engine.runner.require(f"--engine {engine.key}")
    except TcalError as e:
        pytest.skip(f"{engine.key} is not installed here: {e}")
    if engine.uses_model:
        assert engine.runner.locate(str(root / "hybrid")) is None  # it runs the model the command loaded
        return engine.runner.open(hybrid, tok, batch_size=2)
    out = root / engine.reads
    if not out.exists():
        more = ("--gguf-type", "f32") if engine.reads == "gguf" else ()
        assert main([str(a) for a in ("export", root / "hybrid", "--format", engine.reads, *more, "--out", out)]) == 0
    return engine.runner.open(engine.runner.locate(str(out)), tok, threads=1)


@pytest.mark.parametrize("key", engines.GENERATING)
def test_every_generating_engine_writes_tcals_greedy_text(exported, key):
    hybrid, tok, _ = exported
    with engines.get("tcal").runner.open(hybrid, tok, batch_size=2) as gen:
        ours = gen.generate(PROMPTS, STOPS, max_new_tokens=24)
    with opened(engines.get(key), exported) as gen:
        theirs = gen.generate(PROMPTS, STOPS, max_new_tokens=24)
        assert gen.where and gen.tokenizer is not None
    assert all(same_greedy_text(cut(a), cut(b)) for a, b in zip(ours, theirs, strict=True))


def page_engine():
    """The generating engine of docs/extending.md (*Adding an engine*), as the page gives it."""
    import re
    import types
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n# tcal/engines/hfgen\.py[^\n]*\n(.*?)```", page, re.S).group(1)
    module = types.ModuleType("hfgen")
    exec(compile(code, "hfgen.py", "exec"), module.__dict__)
    return module.ENGINE


def test_the_pages_generating_engine_writes_tcals_greedy_text(exported, monkeypatch):
    engine = page_engine()
    monkeypatch.setitem(engines.ENGINES, engine.key, engine)
    assert engine.generates and not engine.uses_model
    test_every_generating_engine_writes_tcals_greedy_text(exported, engine.key)


def test_both_engines_say_what_ran_the_model(exported):
    hybrid, tok, root = exported
    with engines.get("tcal").runner.open(hybrid, tok, batch_size=2) as gen:
        assert gen.where.startswith("tcal (transformers), float32 on cpu") and gen.tokenizer is tok
    path = engines.get("llama.cpp").runner.locate(str(root / "gguf"))
    assert path == root / "gguf" / "model-f32.gguf"
    with engines.get("llama.cpp").runner.open(path, threads=1) as gen:
        assert gen.where == "llama.cpp (llama-cpp-python), model-f32.gguf" and gen.tokenizer.eos_token == "<|end|>"


def test_the_llama_cpp_runner_locates_one_gguf(exported, tmp_path):
    _, _, root = exported
    run_ = engines.get("llama.cpp").runner
    assert run_.locate(str(root / "gguf" / "model-f32.gguf")) == root / "gguf" / "model-f32.gguf"
    (tmp_path / "two").mkdir()
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / n).write_bytes(b"")
    with pytest.raises(TcalError, match="holds 2 GGUF files"):
        run_.locate(str(tmp_path / "two"))
    with pytest.raises(TcalError, match="is not a .gguf file"):
        run_.locate(str(root / "hybrid" / "config.json"))
    with pytest.raises(TcalError, match="runs a GGUF: pass a .gguf file"):
        run_.locate(str(root / "hybrid"))


def test_humaneval_generates_through_either_engine_with_the_same_answers(exported, tmp_path, capsys):
    _, _, root = exported
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"task_id": "t/0", "prompt": "def f(x):\n    return None\n# ", "entry_point": "f",
                                    "test": "def check(candidate):\n    assert candidate(1) is None\n"}) + "\n")
    answers = {}
    for engine, model in (("tcal", root / "hybrid"), ("llama.cpp", root / "gguf")):
        out = tmp_path / engine
        code, err, _ = run(capsys, "eval", model, "--tasks", "humaneval", "--allow-code-execution", "--problems",
                           problems, "--max-new-tokens", "16", "--engine", engine, "--threads", "1", "--out", out,
                           "--no-progress")
        assert code == 0, err
        report = json.loads((out / "humaneval.json").read_text())
        assert report["settings"]["engine"] == engine and report["engine"].startswith(engine)
        answers[engine] = [r["completion"] for r in report["results"]]
    assert same_greedy_text(clean(answers["tcal"][0]), clean(answers["llama.cpp"][0]))
