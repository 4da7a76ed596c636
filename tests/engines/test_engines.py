"""The engines as objects: every engine an export names has a rule and a serve command, --engines and --engine take
their keys, and the serve commands follow each engine's verdict on the export (the generating engines:
test_generating_engines.py)."""
import pytest
from helpers import target_hybrid

from tcal import engines
from tcal.export.qwen3_5 import to_qwen3_5
from tcal.utils.errors import TcalError


def test_every_export_engine_has_a_rule_a_serve_command_and_a_check():
    for fmt in ("hf", "gguf"):
        assert engines.export_engines(fmt) == [e for e in engines.ENGINES.values() if e.reads == fmt]
    for e in engines.ENGINES.values():
        assert e.checked and (e.rule is None) == (e.serve is None) == e.uses_model
    assert engines.GENERATING == tuple(k for k, e in engines.ENGINES.items() if e.generates)


def test_eval_takes_the_generating_engines():
    from tcal.cli import build_parser
    from tcal.recipes.eval import EvalConfig

    flag = EvalConfig.extra_args()["engine"][1]
    assert flag.metadata["choices"] == engines.GENERATING
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["eval"].format_help().split())
    for key in engines.GENERATING:  # --engine's help names every generating engine, from the registry
        assert f"{key} ({engines.get(key).opens})" in text


def test_parse_engines_names_the_format_each_engine_reads():
    assert [e.name for e in engines.parse_engines("vllm, SGLang", "hf")] == ["vLLM", "SGLang"]
    with pytest.raises(TcalError, match="--format gguf is not for vllm; vllm runs --format hf"):
        engines.parse_engines("vllm", "gguf")
    with pytest.raises(TcalError, match="the engines are transformers, vllm, sglang, llama.cpp"):
        engines.parse_engines("tgi", "hf")


def test_serve_commands_follow_the_verdicts():
    periodic = to_qwen3_5(target_hybrid("llama", keep=(1, 3))[0])  # interval 2, no biases: SGLang runs it
    other = to_qwen3_5(target_hybrid("llama", keep=(0, 2))[0])  # attention at 0 and 2: SGLang cannot
    assert engines.serve_commands(periodic, "hf", "float32", "out") == [
        "python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained('out')\"",
        "vllm serve out --gdn-prefill-backend triton   # on H100/H200",  # GDN head size 16, not FlashInfer's 128
        "python -m sglang.launch_server --model-path out --dtype bfloat16"]
    assert [c.split()[0] for c in engines.serve_commands(other, "hf", "bfloat16", "out")] == ["python", "vllm"]
    assert engines.required_blocker(other, "hf", "float32", engines.parse_engines("sglang", "hf")).startswith(
        "SGLang cannot run this hybrid: it places attention by full_attention_interval alone")
    assert engines.serve_commands(other, "gguf", "q8_0", "out") == ["llama-server -m out/model-q8_0.gguf"]


def test_a_new_engine_from_the_docs(monkeypatch):
    """docs/extending.md, *Adding an engine*, followed: the page's example engine, put in ENGINES, is in the engine
    table, --engines and the serve commands of an export, as its verdicts say."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(# tcal/engines/__init__\.py: one more entry.*?)```",
                     page[page.index("## Adding an engine"):], re.S).group(1)
    scope = {}
    exec(compile(code, "docs/extending.md", "exec"), scope)
    engine = scope["MYSERVE"]
    monkeypatch.setitem(engines.ENGINES, engine.key, engine)
    assert engines.export_engines("hf")[-1] is engine and not engine.generates
    assert engines.parse_engines("myserve", "hf") == [engine]
    plain = to_qwen3_5(target_hybrid("llama", keep=(1, 3))[0])
    row = engines.engine_table(plain, "hf", "float32")[-1]
    assert (row.engine, row.runs, row.how) == ("myserve", engines.ROUNDING, "bfloat16 weights")
    assert engines.serve_commands(plain, "hf", "float32", "out")[-1] == "myserve --model out"
    from helpers import tiny_teacher

    import tcal

    biased = to_qwen3_5(tcal.convert(tiny_teacher("llama", attention_bias=True), keep=[0, 2], init="copy",
                                     target="qwen3_5"))
    assert engines.required_blocker(biased, "hf", "float32", [engine]) == (
        "myserve cannot run this hybrid: its attention has no o_proj bias")
    assert "myserve --model out" not in engines.serve_commands(biased, "hf", "float32", "out")
