"""Evaluation tasks as objects (tcal.evaluate.task, tcal.evaluate.tasks): the --tasks spelling, the registry, the
old flags mapped onto --tasks, the one code-execution gate, and a new task, docs/extending.md's, run by tcal eval and
at a tcal distill curve point."""
import json
import re
import types
from pathlib import Path

import pytest
from helpers import one_error, run

from tcal.evaluate import tasks as T
from tcal.evaluate.task import TaskOptions, TaskSpec, join_tasks, parse_tasks
from tcal.utils.errors import TcalError, TcalWarning

ROOT = Path(__file__).resolve().parents[2]


# -- the spelling -----------------------------------------------------------------------------------------------------

def test_tasks_are_names_with_a_count_and_context_lengths():
    specs = parse_tasks("humaneval:164, passkey@1024,4096,single:10@512,lm-eval/hellaswag:5,niah@256:2")
    assert specs == [TaskSpec("humaneval", 164), TaskSpec("passkey", None, (1024, 4096)),
                     TaskSpec("single", 10, (512,)), TaskSpec("lm-eval/hellaswag", 5), TaskSpec("niah", 2, (256,))]
    assert join_tasks(specs) == "humaneval:164,passkey@1024,4096,single:10@512,lm-eval/hellaswag:5,niah:2@256"
    assert parse_tasks(join_tasks(specs)) == specs and parse_tasks("") == []


@pytest.mark.parametrize("text, message", [
    ("4096", "follows no task with a context length"),
    ("humaneval,4096", "follows no task with a context length"),
    ("single@", "is not NAME, NAME:N or NAME@LENGTH"),
    ("single@1k", "is not NAME, NAME:N or NAME@LENGTH"),
    ("single:2:3", "gives :N or @LENGTH twice"),
    ("humaneval:0", "a count and a context length are at least 1"),
])
def test_a_malformed_task_list_is_one_line(text, message):
    with pytest.raises(TcalError, match=message):
        parse_tasks(text)


def test_the_registry_holds_every_task_once_and_builds_one_task_per_kind():
    assert set(T.TASKS) == {"ppl", "niah", "humaneval", "lm-eval", "answer_kl"}
    for name in ("passkey", "single", "cwe", "niah", "tcal_cloze", "lm-eval/hellaswag", "humaneval", "ppl",
                 "answer_kl"):
        assert sum(t.accepts(name) for t in T.TASKS.values()) == 1, name
    built = T.build(parse_tasks("single@512,humaneval:3,passkey@1024,vt@512"), TaskOptions())
    assert [t.name for t in built] == ["niah", "humaneval"]
    assert built[0].cells == [("single", 512), ("single", 1024), ("vt", 512)]  # passkey is single
    assert built[0].lengths == [512, 1024] and built[1].limit == 3
    with pytest.raises(TcalError, match="unknown task 'needle' in --tasks"):
        T.build([TaskSpec("needle")], TaskOptions())
    with pytest.raises(TcalError, match="humaneval takes no context length"):
        T.build([TaskSpec("humaneval", None, (512,))], TaskOptions())
    with pytest.raises(TcalError, match="ppl does not score a model at a curve point"):
        T.build([TaskSpec("ppl")], TaskOptions(), where="tcal distill", curve=True)
    with pytest.raises(TcalError, match="task name 'single' is taken"):
        T.register(type("Mine", (T.Task,), {"name": "single"}))
    listed = T.listing()
    assert all(name in listed for name in ("ppl:N@L", "niah:N@L", "humaneval:N", "lm-eval/NAME:N", "answer_kl",
                                           "passkey", "multikey"))


def test_the_code_execution_gate_is_written_once_and_guards_every_command(tmp_path, capsys):
    # one place in the package refuses to run a model's code without --allow-code-execution
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "src" / "tcal").rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if "add --allow-code-execution" in line]
    assert len(hits) == 1 and hits[0].startswith("src/tcal/evaluate/sandbox.py:"), hits
    model = tmp_path / "m"
    for argv in (("eval", model, "--tasks", "humaneval:2"), ("ablate", "--teacher", model, "--tasks", "humaneval"),
                 ("distill", model, "--teacher", model, "--data", "text:a b c", "--tasks", "humaneval:2"),
                 ("recover", "--teacher", model, "--data", "text:a b c", "--tasks", "humaneval:2")):
        one_error(capsys, "humaneval runs the code the model writes on this machine: add --allow-code-execution",
                  *argv, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the old spellings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over, tasks", [
    ({}, "ppl"),
    ({"window": 32, "windows": 4}, "ppl:4@32"),
    ({"task": "niah", "lengths": "512,1024", "samples": 3}, "niah:3@512,1024"),
    ({"task": "single,multikey", "lengths": "256"}, "single@256,multikey@256"),
    ({"task": "humaneval", "limit": 20}, "humaneval:20"),
    ({"lm_eval": "tcal_lastword,hellaswag", "lm_eval_limit": 5}, "tcal_lastword:5,lm-eval/hellaswag:5"),
    ({"tasks": "single@1024", "samples": 4}, "single:4@1024"),  # a size flag sizes --tasks' specs too
    ({"tasks": "single:2@1024", "samples": 4}, "single:2@1024"),  # ... that do not state it
])
def test_the_old_eval_flags_map_onto_tasks(over, tasks):
    from tcal.recipes.eval import EvalConfig, fold_old_flags

    specs, used = fold_old_flags(EvalConfig(**over))
    assert join_tasks(specs) == tasks
    assert sorted(used) == sorted("--" + k.replace("_", "-") for k in over if k != "tasks")


@pytest.mark.parametrize("over, tasks, haystack", [
    ({}, "", "sotu:eval"),
    ({"eval_passkey": "1024,4096"}, "passkey:10@1024,4096", "sotu:eval"),
    ({"eval_passkey": "512", "eval_passkey_samples": 20, "eval_passkey_haystack": "wiki:eval", "eval_humaneval": 164},
     "passkey:20@512,humaneval:164", "wiki:eval"),
    ({"tasks": "humaneval:8", "haystack": "my.txt"}, "humaneval:8", "my.txt"),
])
def test_the_old_curve_flags_map_onto_tasks(over, tasks, haystack):
    from tcal.recipes.distill import DistillConfig
    from tcal.train.options import curve_specs

    specs, _, hay = curve_specs(DistillConfig(**over))
    assert (join_tasks(specs), hay) == (tasks, haystack)


def test_an_old_flag_is_one_warning_line_naming_the_tasks_it_stands_for(tmp_path, capsys):
    from tcal.cli import _format_warning

    with pytest.warns(TcalWarning) as record:
        code, errors, err = run(capsys, "eval", tmp_path / "m", "--task", "humaneval", "--limit", "3", "--out",
                                tmp_path / "o")
    assert code == 2 and "add --allow-code-execution" in errors[0]
    mine = [w for w in record if issubclass(w.category, TcalWarning)]
    assert [str(w.message) for w in mine] == ["--task --limit are deprecated; this run is --tasks humaneval:3"]
    # what the user's terminal shows: one line, without the source line that raised it
    assert _format_warning(mine[0].message, TcalWarning, "x.py", 1) == (
        "tcal: warning: --task --limit are deprecated; this run is --tasks humaneval:3\n")
    one_error(capsys, "--limit is read by humaneval only, and this run is single", "eval", tmp_path / "m", "--tasks",
              "single@512", "--limit", "3", "--out", tmp_path / "o")
    one_error(capsys, "--eval-passkey-haystack (a.txt) is the old name of --haystack (b.txt)", "distill",
              tmp_path / "m", "--eval-passkey", "512", "--eval-passkey-haystack", "a.txt", "--haystack", "b.txt")


# -- a new task is one module: docs/extending.md's, run by tcal eval and at a distillation's curve points -------------

@pytest.fixture()
def copy_task():
    """The copy task of docs/extending.md (*Adding an evaluation task*), its module run from the page, registered for
    the test only."""
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page[page.index("## Adding an evaluation task"):]
    code = re.search(r"```python\n(# tcal/evaluate/tasks/copy\.py\n.*?)```", section, re.S).group(1)
    module = types.ModuleType("copy_task")
    exec(compile(code, "docs/extending.md", "exec"), module.__dict__)
    T.register(module.TASK)
    yield module
    T.TASKS.pop(module.TASK.name)


def _expected(module, model, spec: str) -> dict:
    """The copy task's scores of ``model``, computed apart from any command: the same seeded sequences."""
    task = module.TASK(parse_tasks(spec), TaskOptions())
    task.prepare(model, None)
    return {f"copy@{n}": module.copy_accuracy(model, ids) for n, ids in task.ids.items()}


def test_a_new_task_runs_in_tcal_eval(copy_task, assets, tmp_path, capsys):
    import shutil

    from helpers import word_tokenizer

    from tcal.train.checkpoint import load_model

    shutil.copytree(assets / "hybrid", tmp_path / "hybrid")
    word_tokenizer("a b c".split()).save_pretrained(tmp_path / "hybrid")  # tcal eval reads a model with its tokenizer
    out = tmp_path / "out"
    code, errors, err = run(capsys, "eval", tmp_path / "hybrid", "--tasks", "copy:3@16,32", "--device", "cpu",
                            "--no-progress", "--out", out)
    assert code == 0, err
    report = json.loads((out / "copy.json").read_text())
    hybrid = load_model(assets / "hybrid")
    assert report["scores"] == _expected(copy_task, hybrid, "copy:3@16,32")
    assert report["settings"]["tasks"] == "copy:3@16,32"
    assert "| copy@32 |" in (out / "copy.md").read_text()
    assert json.loads((out / "tcal_config.json").read_text())["tasks"] == "copy:3@16,32"
    assert "copy:N@L" in T.listing()


def test_a_new_task_scores_every_distillation_curve_point(copy_task, assets, tmp_path):
    from tcal.recipes.distill import DistillConfig
    from tcal.recipes.distill import run as distill
    from tcal.train.checkpoint import load_model
    from tcal.train.curve import read_curve

    out = tmp_path / "run"
    rep = distill(DistillConfig(hybrid=str(assets / "hybrid"), teacher=str(assets / "teacher"),
                                data=str(assets / "train.npy"), eval=str(assets / "eval.npy"), eval_window=32,
                                eval_windows=2, tokens=8 * 64, seq_len=16, batch_size=4, eval_every=4 * 64,
                                eval_early=0, kl_chunk=24, tasks="copy:2@24", out=str(out), progress=False))
    rows = read_curve(out / "curve.csv")
    assert [r["step"] for r in rows] == [0, 4, 8] and all("copy@24" in r for r in rows)
    assert rows[0]["copy@24"] == pytest.approx(_expected(copy_task, load_model(assets / "hybrid"), "copy:2@24")
                                               ["copy@24"])
    assert rows[-1]["copy@24"] == pytest.approx(_expected(copy_task, load_model(out), "copy:2@24")["copy@24"])
    assert rep["teacher_probes"] == pytest.approx(_expected(copy_task, load_model(assets / "teacher"), "copy:2@24"))
    md = (out / "report.md").read_text()
    assert "copy (copy:2@24): greedy accuracy on the second copy" in md and "| training tokens | copy@24 |" in md
