"""`tcal eval`: every task's result can be saved (perplexity too, with --out), kept work is reused only with the same
settings, and each message names the real problem (the path, the encoding, the context length)."""
import hashlib
import json

from helpers import one_error, run

ADD = {"task_id": "t/ok", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "entry_point": "add",
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}


def test_perplexity_is_saved_with_out_and_printed_without(workspace, capsys, monkeypatch):
    """Before: --out was refused for ppl, so a perplexity could not be saved."""
    monkeypatch.chdir(workspace)
    base = ("eval", workspace / "teacher", "--data", workspace / "eval.txt", "--tasks", "ppl:2@16", "--device", "cpu",
            "--no-progress")
    code, _, err = run(capsys, *base)
    assert code == 0, err
    assert not (workspace / "runs").exists()  # ppl alone prints its report
    out = workspace / "ppl-out"
    code, _, err = run(capsys, *base, "--out", out)
    assert code == 0, err
    report = json.loads((out / "ppl.json").read_text())
    assert report["windows"] == 2 and report["window"] == 16 and report["ppl"] > 1
    assert f"PPL {report['ppl']:.3f}" in (out / "ppl.md").read_text()
    assert json.loads((out / "tcal_config.json").read_text())["tasks"] == "ppl:2@16"
    one_error(capsys, "pass --overwrite", *base, "--out", out)
    assert not (workspace / "ppl-out.partial").exists()


def test_a_missing_or_misencoded_data_file_is_named_not_out(workspace, capsys):
    """Before: with --out the error was about --out, not about the path or the encoding."""
    err = one_error(capsys, str(workspace / "missing.txt"), "eval", workspace / "no-model", "--data",
                    workspace / "missing.txt", "--out", workspace / "o")
    assert "--out" not in err
    (workspace / "fr.txt").write_bytes(" ".join(["the café"] * 40).encode("cp1252"))
    err = one_error(capsys, "is not UTF-8", "eval", workspace / "no-model", "--data", workspace / "fr.txt", "--out",
                    workspace / "o")
    assert "--out" not in err and not (workspace / "o").exists()


def test_completions_in_the_chat_style_are_scored(tmp_path, capsys):
    """Before: --prompt-style chat with --completions (documented) asked for a tokenizer with a chat template."""
    (tmp_path / "p.jsonl").write_text(json.dumps(ADD) + "\n")
    answer = "def add(a, b):\n    return a + b\n```\nDone."  # the turn continues after the opened ```python fence
    (tmp_path / "s.jsonl").write_text(json.dumps({"task_id": "t/ok", "completion": answer}) + "\n")
    out = tmp_path / "out"
    code, _, err = run(capsys, "eval", "--tasks", "humaneval", "--problems", tmp_path / "p.jsonl", "--completions",
                       tmp_path / "s.jsonl", "--prompt-style", "chat", "--allow-code-execution", "--no-progress",
                       "--out", out)
    assert code == 0, err
    report = json.loads((out / "humaneval.json").read_text())
    assert report["prompt_style"] == "chat" and report["results"][0]["passed"]


def test_completions_messages_name_the_folder_and_the_tasks_spelling(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text(json.dumps(ADD) + "\n" + json.dumps(dict(ADD, task_id="t/1")) + "\n")
    (tmp_path / "s.jsonl").write_text(json.dumps({"task_id": "t/ok", "completion": "    return a + b\n"}) + "\n")
    base = ("eval", "--tasks", "humaneval", "--problems", tmp_path / "p.jsonl", "--allow-code-execution", "--out",
            tmp_path / "o")
    one_error(capsys, f"completions file {tmp_path} is a directory, not a file", *base, "--completions", tmp_path)
    err = one_error(capsys, "give one answer per problem, or fewer problems (--tasks humaneval:N, or --problems)",
                    *base, "--completions", tmp_path / "s.jsonl")
    assert "--limit" not in err


def test_kept_answers_of_other_settings_are_refused_not_dropped(workspace, capsys, monkeypatch):
    """Before: a rerun with another --max-new-tokens silently threw the kept answers away. Refused before the model
    loads."""
    import pytest

    import tcal.data.teachers
    from tcal.utils.partial import Work, partial_dir

    problems = workspace / "p.jsonl"
    problems.write_text(json.dumps(ADD) + "\n" + json.dumps(dict(ADD, task_id="t/1")) + "\n")
    out = workspace / "he"
    settings = {"model": str(workspace / "teacher"), "engine": "tcal",
                "problems_sha256": hashlib.sha256(problems.read_bytes()).hexdigest(), "prompt_style": "completion",
                "max_new_tokens": 5, "dtype": "float32"}
    kept = {"settings": settings, "completions": {"t/ok": "    return a + b\n"}}
    Work(partial_dir(out), "eval").write_json("humaneval.json", kept)  # an interrupted run's first answer
    monkeypatch.setattr(tcal.data.teachers, "load_teacher", lambda *a, **k: pytest.fail("the model loaded"))
    one_error(capsys, "humaneval's settings changed (max_new_tokens); rerun with the same settings", "eval",
              workspace / "teacher", "--tasks", "humaneval", "--problems", problems, "--allow-code-execution",
              "--max-new-tokens", "3", "--device", "cpu", "--no-progress", "--out", out)
    assert json.loads((partial_dir(out) / "humaneval.json").read_text()) == kept


def test_a_context_length_too_short_is_said_in_the_tasks_spelling(workspace, capsys):
    err = one_error(capsys, "is too short", "eval", workspace / "teacher", "--tasks", "single:1@16", "--haystack",
                    workspace / "eval.txt", "--device", "cpu", "--no-progress", "--out", workspace / "o")
    assert "use a longer context length (@L in --tasks)" in err and "--lengths" not in err
