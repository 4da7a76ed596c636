"""Evaluation tasks as objects (tcal.evaluate.task, tcal.evaluate.tasks): the --tasks spelling, the registry, the
old flags mapped onto --tasks, the one code-execution gate, and a new task, docs/extending.md's, run by tcal eval and
at a tcal distill curve point."""
import json
import re
from pathlib import Path

import pytest
from helpers import one_error, run

from tcal.evaluate import tasks as T
from tcal.evaluate.task import TaskSpec, join_tasks, parse_tasks
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
    from test_registries import BUILT_INS

    assert BUILT_INS["tasks"] <= set(T.TASKS)
    for name in ("passkey", "single", "cwe", "niah", "tcal_cloze", "lm-eval/hellaswag", "humaneval", "ppl",
                 "answer_kl"):
        assert sum(t.accepts(name) for t in T.TASKS.values()) == 1, name
    built = T.build(parse_tasks("single@512,humaneval:3,passkey@1024,vt@512"), T.options())
    assert [t.name for t in built] == ["niah", "humaneval"]
    assert built[0].cells == [("single", 512), ("single", 1024), ("vt", 512)]  # passkey is single
    assert built[0].lengths == [512, 1024] and built[1].limit == 3
    with pytest.raises(TcalError, match="unknown task 'needle' in --tasks"):
        T.build([TaskSpec("needle")], T.options())
    with pytest.raises(TcalError, match="humaneval takes no context length"):
        T.build([TaskSpec("humaneval", None, (512,))], T.options())
    with pytest.raises(TcalError, match="ppl does not score a model at a curve point"):
        T.build([TaskSpec("ppl")], T.options(), where="tcal distill", curve=True)
    with pytest.raises(TcalError, match="task name 'single' is taken"):
        T.register(type("Mine", (T.Task,), {"name": "single"}))
    listed = T.listing()
    assert all(name in listed for name in ("ppl:N@L", "niah:N@L", "humaneval:N", "lm-eval/NAME:N", "answer_kl",
                                           "passkey", "multikey"))


def test_the_code_execution_gate_is_written_once_and_guards_every_command(tmp_path, capsys):
    # one place in the package refuses to run a model's code without --allow-code-execution
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "src" / "tcal").rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if "add --allow-code-execution" in line]
    assert len(hits) == 1 and hits[0].startswith("src/tcal/sandbox/core.py:"), hits
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
    from tcal.evaluate.plan import fold
    from tcal.recipes.eval import EVAL, EvalConfig

    specs, used, _ = fold(EvalConfig(**over), EVAL)
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
    from tcal.evaluate.plan import fold
    from tcal.recipes.distill import DistillConfig
    from tcal.train.options import CURVE

    haystack_flag = {"task_flags": {"haystack": over.pop("haystack")}} if "haystack" in over else {}
    cfg = DistillConfig(**over, **haystack_flag)
    specs, _, renamed = fold(cfg, CURVE)
    assert (join_tasks(specs), renamed.get("haystack", cfg.haystack)) == (tasks, haystack)


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


# -- perplexity: tcal eval's ppl, and every other command's --eval -----------------------------------------------------

def test_every_commands_eval_is_the_ppl_task_and_scores_what_the_protocol_scores(assets, tmp_path):
    import numpy as np
    import torch
    from helpers import word_tokenizer

    from tcal.evaluate import perplexity_report
    from tcal.evaluate.plan import held_out
    from tcal.train.checkpoint import load_model

    model, tok = load_model(assets / "teacher"), word_tokenizer("a b c d e".split())
    text = tmp_path / "t.txt"
    text.write_text(" ".join("abcde"[i * 7 % 5] + ("." if i % 11 == 0 else "") for i in range(400)))
    domains = [str(text), str(assets / "eval.npy")]  # a text and a token file
    ppl = held_out(domains, 16, 3)
    assert [join_tasks(ppl.specs), ppl.domains, ppl.curve] == ["ppl:3@16", domains, False]
    ppl.check()
    ppl.prepare(model, tok)
    got = ppl.measure(model)
    by_text = perplexity_report(model, tok, str(text), window=16, windows=3, progress=False)
    ids = torch.from_numpy(np.load(assets / "eval.npy")[:48].astype(np.int64).reshape(3, 16))
    by_ids = perplexity_report(model, None, ids, progress=False)
    assert got["ppl_by_domain"] == {domains[0]: by_text["ppl"], domains[1]: by_ids["ppl"]}
    assert got["ppl"] == by_text["ppl"] and ppl.score(model) == by_text["ppl"]
    reports = ppl.reports(model, tok)
    assert {k: v for k, v in reports[domains[0]].items() if k != "seconds"} == {
        k: v for k, v in by_text.items() if k != "seconds"}
    with pytest.raises(TcalError, match="tcal eval scores the perplexity of one text, got 2"):
        ppl.check_eval()
    with pytest.raises(TcalError, match="ppl does not score a model at a curve point"):
        T.build([TaskSpec("ppl")], T.options(), where="tcal distill", curve=True)


# -- a new task is one module, its flag with it: docs/extending.md's, run by tcal eval and at a distillation's curve
# points ----------------------------------------------------------------------------------------------------------------

def page_module() -> str:
    """The copy task of docs/extending.md (*Adding an evaluation task*), as the page gives it."""
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page[page.index("## Adding an evaluation task"):]
    return re.search(r"```python\n# tcal/evaluate/tasks/copy\.py\n(.*?)```", section, re.S).group(1)


# Run in a copy of the package that holds the page's module as tcal/evaluate/tasks/copy.py: its flag is one of every
# command's because the module is there, and nothing else was changed for it.
SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from tcal.cli import build_parser, main
from tcal.evaluate import tasks as T
from tcal.evaluate.task import parse_tasks
from tcal.evaluate.tasks import copy
from tcal.train.checkpoint import load_model
from tcal.train.curve import read_curve

assets, hybrid, out = (a for a in sys.argv[1:])
def expected(model, spec, repeats):
    task = T.build(parse_tasks(spec), T.options(copy_repeats=repeats))[0]
    task.check()
    task.prepare(model, None)
    return {f"copy@{n}": copy.copy_accuracy(model, ids, repeats) for n, ids in task.ids.items()}

found = {"help": {c: build_parser().parse_args([c, "--copy-repeats", "3"]).copy_repeats
                  for c in ("eval", "ablate", "distill", "recover")}}
code = main(["eval", hybrid, "--tasks", "copy:3@16,32", "--copy-repeats", "3", "--device", "cpu", "--no-progress",
             "--out", out + "/eval"])
found["eval"] = {"code": code, "report": json.load(open(out + "/eval/copy.json")),
                 "md": open(out + "/eval/copy.md").read(),
                 "want": expected(load_model(hybrid), "copy:3@16,32", 3)}
code = main(["distill", assets + "/hybrid", "--teacher", assets + "/teacher", "--data", assets + "/train.npy",
             "--eval", assets + "/eval.npy", "--eval-window", "32", "--eval-windows", "2", "--tokens", str(8 * 64),
             "--seq-len", "16", "--batch-size", "4", "--eval-every", str(4 * 64), "--eval-early", "0",
             "--kl-chunk", "24", "--tasks", "copy:2@24", "--copy-repeats", "3", "--no-progress", "--out",
             out + "/run"])
rows = read_curve(out + "/run/curve.csv")
found["distill"] = {"code": code, "rows": rows, "report": json.load(open(out + "/run/report.json")),
                    "md": open(out + "/run/report.md").read(),
                    "want": [expected(load_model(d), "copy:2@24", 3)["copy@24"]
                             for d in (assets + "/hybrid", out + "/run", assets + "/teacher")]}
print("RESULT " + json.dumps(found))
"""


def test_a_new_task_with_its_own_flag_is_one_module(assets, tmp_path, capsys):
    import shutil
    import subprocess
    import sys

    from helpers import word_tokenizer

    package = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "tcal", package / "tcal", ignore=shutil.ignore_patterns("__pycache__"))
    (package / "tcal" / "evaluate" / "tasks" / "copy.py").write_text(page_module())
    shutil.copytree(assets / "hybrid", tmp_path / "hybrid")
    word_tokenizer("a b c".split()).save_pretrained(tmp_path / "hybrid")  # tcal eval reads a model with its tokenizer
    env = {**__import__("os").environ, "PYTHONPATH": str(package), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(assets), str(tmp_path / "hybrid"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert found["help"] == {"eval": 3, "ablate": 3, "distill": 3, "recover": 3}  # a flag of every command
    ev = found["eval"]
    assert ev["code"] == 0 and ev["report"]["scores"] == ev["want"] and set(ev["want"]) == {"copy@16", "copy@32"}
    assert ev["report"]["settings"]["tasks"] == "copy:3@16,32" and "| copy@32 |" in ev["md"]
    ds = found["distill"]
    assert ds["code"] == 0 and [r["step"] for r in ds["rows"]] == [0, 4, 8]
    # the curve's first and last points and the teacher: copy_accuracy of the hybrid, the trained run, the teacher
    assert [ds["rows"][0]["copy@24"], ds["rows"][-1]["copy@24"], ds["report"]["teacher_probes"]["copy@24"]] == \
        pytest.approx(ds["want"])
    assert "copy (copy:2@24): greedy accuracy on the repeats" in ds["md"] and "| training tokens | copy@24 |" in ds["md"]
    # the flag the task declares, refused where no task of the run reads it; out of the package, no such flag
    code, errors, err = subprocess_error(package, "eval", tmp_path / "hybrid", "--copy-repeats", "3")
    assert code == 2 and errors == ["--copy-repeats is read by copy only, and this run is ppl: drop --copy-repeats"], err
    from tcal.recipes.eval import EvalConfig

    assert "copy" not in T.TASKS and not hasattr(EvalConfig(), "copy_repeats")


def subprocess_error(package, *argv):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tcal.cli", *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(package)})
    errors = [line.removeprefix("tcal: error: ") for line in done.stderr.splitlines() if line.startswith("tcal: error")]
    return done.returncode, errors, done.stderr


def test_a_task_registered_after_the_commands_were_imported_has_its_flag_in_every_command():
    from tcal.cli import build_parser
    from tcal.evaluate.task import Option
    from tcal.recipes.ablate import AblateConfig
    from tcal.recipes.eval import EvalConfig  # the commands are imported before the task registers
    from tcal.utils.command_config import from_args

    late = type("Late", (T.Task,), {"name": "late", "options": (Option("late_knob", 1, "a knob"),)})
    T.register(late)
    try:
        for command, cls in (("eval", EvalConfig), ("ablate", AblateConfig)):
            cfg = from_args(cls, build_parser().parse_args([command, "--late-knob", "5"]))
            assert (cfg.late_knob, cls().late_knob, T.options(cfg).late_knob) == (5, 1, 5)
            assert T.settings(cfg)["late_knob"] == 5
    finally:
        del T.TASKS["late"]
    assert not hasattr(EvalConfig(), "late_knob")
    shared = type("Shared", (T.Task,), {"name": "shared", "options": (Option("seed", 1, "another default"),)})
    with pytest.raises(TcalError, match="declares --seed unlike the tasks that declare it already"):
        T.register(shared)
    reads = type("Reads", (T.Task,), {"name": "reads", "options": ("haystack",)})
    with pytest.raises(TcalError, match="reads 'haystack', which is no command setting"):
        T.register(reads)
