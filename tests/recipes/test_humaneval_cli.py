"""`tcal eval --task humaneval` and the code-teacher inputs from the command line: every bad input is one
`tcal: error:` line before any model loads and nothing is written; a test that hangs, allocates without bound,
starts processes or does not parse is a failed problem, and the evaluation goes on."""
import json

import pytest
from helpers import one_error, run, tiny_teacher, word_tokenizer

# the prompt ends in a comment, so that whatever the tiny model writes is a comment and the tests decide
GOOD = {"task_id": "t/0", "prompt": "def f(x):\n    return None\n# ", "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(1) is None\n"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama teacher with a word-level tokenizer (no chat template: the completion prompt style)."""
    root = tmp_path_factory.mktemp("he")
    tok = word_tokenizer("def f ( x ) : return None pass".split())
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "m")
    tok.save_pretrained(root / "m")
    return root / "m"


def _problems(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nothing_runs_without_allow_code_execution(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    one_error(capsys, "add --allow-code-execution", "eval", model_dir, "--task", "humaneval", "--out", out)
    one_error(capsys, "add --allow-code-execution", "ablate", "--teacher", model_dir, "--humaneval", "--out", out)
    one_error(capsys, "add --allow-code-execution", "distill", model_dir, "--teacher", model_dir, "--data",
              "text:a b c", "--eval-humaneval", "4", "--out", out)
    assert not out.exists()


@pytest.mark.parametrize("content, message", [
    ("", "holds no problems"),
    ("{not json\n", "line 1 is not JSON"),
    ('{"task_id": "a", "prompt": "def f():\\n", "test": "x"}\n', "line 1 has no text field 'entry_point'"),
])
def test_a_problems_file_not_in_humaneval_format_is_refused_before_the_model_loads(model_dir, tmp_path, capsys,
                                                                                   content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    out = tmp_path / "out"
    one_error(capsys, message, "eval", model_dir, "--task", "humaneval", "--allow-code-execution", "--problems",
              bad, "--out", out)
    one_error(capsys, "does not exist", "eval", model_dir, "--task", "humaneval", "--allow-code-execution",
              "--problems", tmp_path / "missing.jsonl", "--out", out)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_tests_that_hang_allocate_fork_or_do_not_parse_fail_and_the_evaluation_goes_on(model_dir, tmp_path, capsys):
    bad_tests = {
        "hang": "def check(candidate):\n    while True:\n        pass\n",
        "alloc": "def check(candidate):\n    x = bytearray(50 * 1024 ** 3)\n",
        "fork": "import os\ndef check(candidate):\n    os.fork()\n",
        "spawn": "import subprocess\ndef check(candidate):\n    subprocess.Popen(['sleep', '60'])\n",
        "parse": "def check(candidate:\n    pass\n",
    }
    rows = [dict(GOOD, task_id=f"t/{k}", test=t) for k, t in bad_tests.items()] + [dict(GOOD, task_id="t/ok")]
    out = tmp_path / "out"
    code, errors, err = run(capsys, "eval", model_dir, "--task", "humaneval", "--allow-code-execution", "--problems",
                            _problems(tmp_path / "p.jsonl", rows), "--max-new-tokens", "3", "--timeout", "2",
                            "--no-progress", "--out", out)
    assert code == 0, err
    report = json.loads((out / "humaneval.json").read_text())
    reasons = {r["task_id"]: (r["passed"], r["reason"]) for r in report["results"]}
    assert report["problems"] == 6 and report["prompt_style"] == "completion"
    assert reasons["t/ok"] == (True, "passed")
    assert reasons["t/hang"] == (False, "timed out after 2 s")
    assert not reasons["t/alloc"][0] and "MemoryError" in reasons["t/alloc"][1]
    assert not reasons["t/fork"][0] and "os.fork is switched off" in reasons["t/fork"][1]
    assert not reasons["t/spawn"][0] and "subprocess.Popen is switched off" in reasons["t/spawn"][1]
    assert not reasons["t/parse"][0] and "SyntaxError" in reasons["t/parse"][1]
    assert (out / "humaneval.md").read_text().startswith("# HumanEval: ")
    assert not (tmp_path / "out.partial").exists()


def test_the_llama_cpp_engine_needs_a_gguf(model_dir, tmp_path, capsys):
    one_error(capsys, "runs a GGUF", "eval", model_dir, "--task", "humaneval", "--allow-code-execution",
              "--engine", "llama.cpp", "--out", tmp_path / "out")


def test_a_gguf_of_an_architecture_tcal_does_not_convert_is_refused_before_it_loads(tmp_path, capsys):
    from helpers import header_gguf

    path = header_gguf(tmp_path / "falcon.gguf", "falcon")
    out = tmp_path / "out"
    one_error(capsys, "is a GGUF of architecture 'falcon', which tcal does not convert", "convert", "--teacher", path,
              "--out", out)
    one_error(capsys, "architecture 'falcon'", "ablate", "--teacher", path, "--out", out)
    assert not out.exists()


def test_ablate_scores_every_inits_humaneval_beside_its_ppl(workspace, capsys):
    out = workspace / "ab"
    code, errors, err = run(capsys, "ablate", "--teacher", workspace / "teacher", "--keep", "0,2", "--calib",
                            workspace / "calib.txt", "--eval", workspace / "eval.txt", "--eval-window", "32",
                            "--eval-windows", "2", "--calib-window", "32", "--calib-windows", "4", "--align-steps", "1",
                            "--kl-steps", "1", "--humaneval", "--humaneval-limit", "2", "--allow-code-execution",
                            "--device", "cpu", "--no-progress", "--out", out)
    assert code == 0, err
    res = json.loads((out / "ablation.json").read_text())
    assert res["teacher_humaneval"]["problems"] == 2 and res["teacher_humaneval"]["prompt_style"] == "completion"
    for row in res["rows"]:
        he = row["humaneval"]
        assert he["problems"] == 2 and 0.0 <= he["pass@1"] <= 1.0
        assert [r["task_id"] for r in he["results"]] == ["HumanEval/0", "HumanEval/1"]
    md = (out / "ablation.md").read_text()
    assert "| HumanEval pass@1 |" in md and "HumanEval pass@1 (greedy, `completion` prompts, 2 problems" in md
