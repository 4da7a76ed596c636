"""`tcal eval MODEL --lm-eval TASKS`: the harness's numbers as JSON and a table, resumable per task;
bad input is one line before any model loads; `--task list` names the local tasks."""
import json
import sys

import pytest
from helpers import story_text, tiny_teacher, word_tokenizer

from tcal.cli import main
from tcal.recipes.eval import PARTIAL_MARK


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return code, cap.out, [ln for ln in cap.err.splitlines() if ln.startswith("tcal: error: ")]


@pytest.fixture()
def saved(tmp_path):
    """A tiny Llama with a word tokenizer saved as a model directory, and a text to build tasks from."""
    text = story_text(300, seed=2)
    tok = word_tokenizer(sorted(set(text.replace(".", " ").split())), extra=["."])
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "held_out.txt").write_text(text)
    return tmp_path


def test_lm_eval_writes_json_samples_and_a_table_and_resumes(saved, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    argv = ["eval", saved / "m", "--lm-eval", "tcal_lastword,tcal_cloze", "--lm-eval-limit", 5,
            "--lm-eval-data", saved / "held_out.txt", "--device", "cpu", "--out", saved / "le"]
    code, out, errors = _run(capsys, *argv)
    assert code == 0 and not errors
    d = saved / "le"
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == [
        "lm_eval.json", "lm_eval.md", "lm_eval_samples.json", "tcal_config.json"]
    data = json.loads((d / "lm_eval.json").read_text())
    assert [(r["task"], r["metric"]) for r in data["rows"]] == [
        ("tcal_lastword", "perplexity"), ("tcal_lastword", "acc"), ("tcal_cloze", "acc"), ("tcal_cloze", "acc_norm")]
    assert all(r["samples"] == 5 for r in data["rows"])
    samples = json.loads((d / "lm_eval_samples.json").read_text())
    assert len(samples["tcal_lastword"]["tcal_lastword"]) == 5
    table = (d / "lm_eval.md").read_text()
    for r in data["rows"]:  # the table holds the JSON's numbers, and the run printed it
        line = f"| {r['task']} | {r['metric']} | {r['value']:.4f} | {r['stderr']:.4f} | 5 |"
        assert line in table and line in out
    assert "held_out.txt" in table
    assert not (saved / "le.partial").exists()

    # an interrupted run keeps its finished tasks: the rerun runs only the missing one
    partial = saved / "again.partial"
    partial.mkdir()
    (partial / PARTIAL_MARK).write_text('{"stage": "eval"}')  # as tcal marks its own unfinished work
    state = {"settings": data["settings"],
             "tasks": {"tcal_lastword": {**data["tasks"]["tcal_lastword"], "task": "tcal_lastword",
                                         "rows": data["rows"][:2], "samples": samples["tcal_lastword"],
                                         "lm_eval_version": data["lm_eval_version"]}}}
    (partial / "lm_eval.json").write_text(json.dumps(state))
    import tcal.evaluate.tasks.lm_eval.harness as harness

    calls, real = [], harness.run_task
    monkeypatch.setattr(harness, "run_task", lambda lm, p, task, **k: calls.append(task) or real(lm, p, task, **k))
    argv[-1] = saved / "again"
    code, _, errors = _run(capsys, *argv)
    assert code == 0 and not errors and calls == ["tcal_cloze"]
    assert json.loads((saved / "again" / "lm_eval.json").read_text())["rows"] == data["rows"]
    # other text behind the same path: the kept work is not this run's, and is refused, not silently dropped
    (saved / "held_out.txt").write_text(story_text(300, seed=3))
    (partial).mkdir()
    (partial / PARTIAL_MARK).write_text('{"stage": "eval"}')
    (partial / "lm_eval.json").write_text(json.dumps(state))
    calls.clear()
    code, _, errors = _run(capsys, *argv, "--overwrite")
    assert code == 2 and len(errors) == 1 and "lm-eval's settings changed" in errors[0] and calls == [], errors
    assert json.loads((partial / "lm_eval.json").read_text()) == state


@pytest.mark.parametrize("extra, message", [
    (["--lm-eval", "tcal_lastwrd"], "unknown local lm-eval task 'tcal_lastwrd'; local offline tasks: "
                                    "tcal_lastword, tcal_cloze"),
    (["--lm-eval", "tcal_lastword", "--lm-eval-limit", "0"], "--lm-eval-limit must be at least 1"),
    (["--lm-eval", "tcal_cloze", "--lm-eval-data", "shakespeare:calib"], "not an evaluation split"),
    (["--tasks", "tcal_cloze", "--completions", "c.jsonl"], "--completions is read by humaneval only"),
    (["--lm-eval", "tcal_cloze", "--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bad_lm_eval_input_is_one_line_before_the_model_loads(tmp_path, capsys, extra, message):
    # the model path does not exist: an error about it would mean the checks ran after loading
    code, _, errors = _run(capsys, "eval", tmp_path / "no_model", *extra, "--out", tmp_path / "o")
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "o").exists()


def test_unknown_harness_task_lists_the_local_ones(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    code, _, errors = _run(capsys, "eval", tmp_path / "no_model", "--lm-eval", "tcal_cloze,lambada_openaii",
                           "--out", tmp_path / "o")
    assert code == 2 and len(errors) == 1, errors
    assert "unknown lm-eval task 'lambada_openaii'; local offline tasks: tcal_lastword, tcal_cloze" in errors[0]


def test_without_lm_eval_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    code, _, errors = _run(capsys, "eval", tmp_path / "no_model", "--lm-eval", "tcal_lastword",
                           "--lm-eval-data", "text:" + story_text(100), "--out", tmp_path / "o")
    assert code == 2 and errors == ["tcal: error: lm-eval is not installed: pip install 'tcal[eval]'"]


def test_task_list_names_every_task_and_loads_nothing(tmp_path, capsys):
    code, out, errors = _run(capsys, "eval", tmp_path / "no_model", "--task", "list")
    assert code == 0 and not errors
    for name in ("ppl", "niah", "multikey", "tcal_lastword", "tcal_cloze", "lm-eval/NAME", "humaneval", "passkey"):
        assert name in out
