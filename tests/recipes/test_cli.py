"""The `tcal` command line end to end on a tiny teacher directory and text files (no downloads)."""
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

import tcal
from tcal.cli import COMMANDS, build_parser, main, recipe
from tcal.recipes.eval import EvalConfig
from tcal.recipes.eval import run as run_eval


def run(*argv):
    return main([str(a) for a in argv])


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("convert", "eval", "stats", "ablate", "distill", "recover", "pool", "bench", "export"):
        assert cmd in out


def test_command_table_maps_to_recipes():
    assert set(COMMANDS) == {"convert", "eval", "stats", "ablate", "distill", "recover", "pool", "instruct", "bench",
                             "export"}
    for name, help_text in COMMANDS.items():
        cls, run = recipe(name)
        assert cls.__module__ in (f"tcal.recipes.{name}", "tcal.train.options") and callable(run) and help_text
        assert cls.__name__ == f"{name.capitalize()}Config" and run.__module__ == f"tcal.recipes.{name}"
    ns = build_parser().parse_args(["eval", "some/dir", "--windows", "3"])
    assert (ns.command, ns.positional, ns.windows) == ("eval", "some/dir", 3)


def test_every_command_with_progress_bars_can_turn_them_off():
    # stats measures a few windows and shows no bar; every other command has long work behind a bar
    for cmd in set(COMMANDS) - {"stats"}:
        assert build_parser().parse_args([cmd, "--no-progress"]).progress is False, cmd
        assert build_parser().parse_args([cmd]).progress is True, cmd


def test_help_does_not_import_torch():
    code = ("import sys\nfrom tcal.cli import build_parser\nbuild_parser().format_help()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "tcal.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "convert" in out.stdout


def test_convert_copy_writes_a_loadable_checkpoint(workspace, capsys):
    out = workspace / "hybrid"
    assert run("convert", "--teacher", workspace / "teacher", "--keep", "0,2", "--init", "copy", "--out", out,
               "--eval", workspace / "eval.txt", "--eval-window", 32, "--eval-windows", 4, "--device", "cpu") == 0
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tcal_config.json", "report.json", "report.md",
            "tokenizer.json"} <= files
    cfg = json.loads((out / "tcal_config.json").read_text())
    assert cfg["keep"] == "0,2" and cfg["init"] == "copy" and cfg["stage"] == "convert"
    report = json.loads((out / "report.json").read_text())
    assert set(report["eval"]) == {"teacher", "hybrid"}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, tcal.HybridForCausalLM) and model.config.attention_layers == [0, 2]
    # tcal eval on the saved hybrid reproduces the report's number (same protocol, same weights)
    rep = run_eval(EvalConfig(model=str(out), data=str(workspace / "eval.txt"), window=32, windows=4, device="cpu"))
    assert rep["ppl"] == pytest.approx(report["eval"]["hybrid"][str(workspace / "eval.txt")]["ppl"], rel=1e-6)


def test_convert_taylor_with_policy(workspace):
    out = workspace / "taylor"
    assert run("convert", "--teacher", workspace / "teacher", "--keep", "uniform:2", "--init", "taylor",
               "--calib", workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 8,
               "--align-steps", 5, "--out", out, "--eval", "none", "--device", "cpu") == 0
    report = json.loads((out / "report.json").read_text())
    assert report["calibration"]["sequences"] == 8
    assert {"teacher_stats.json", "report.md"} <= set(os.listdir(out))
    assert AutoModelForCausalLM.from_pretrained(out).config.attention_layers == [0, 2]


def test_stats_command(workspace):
    out = workspace / "stats"
    assert run("stats", workspace / "teacher", "--data", workspace / "calib.txt", "--window", 32, "--windows", 4,
               "--out", out, "--device", "cpu") == 0
    assert {"teacher_stats.json", "stats.png", "stats.txt"} <= set(os.listdir(out))


def test_ablate_small(workspace):
    out = workspace / "ablate"
    assert run("ablate", "--teacher", workspace / "teacher", "--keep", "0,2", "--inits", "copy,zero-gate,taylor",
               "--calib", workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 8, "--align-steps", 5,
               "--eval", workspace / "eval.txt", "--eval-window", 32, "--eval-windows", 4, "--out", out,
               "--device", "cpu", "--no-progress") == 0
    res = json.loads((out / "ablation.json").read_text())
    assert [r["init"] for r in res["rows"]] == ["copy", "zero-gate", "taylor"]
    assert res["rows"][0]["copy_over_init"] == pytest.approx(1.0)
    assert res["rows"][2]["heldout_fit"] is not None and res["rows"][2]["phase_seconds"]["phase2"] > 0
    assert {"ablation.md", "ablation.png", "teacher_stats.json", "tcal_config.json"} <= set(os.listdir(out))
    assert res["evaluation"]["windows"] == 4


def test_ablate_without_a_copy_row_writes_its_table(workspace):
    out = workspace / "ablate-one"
    assert run("ablate", "--teacher", workspace / "teacher", "--keep", "0,2", "--inits", "phase1",
               "--calib", workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 8,
               "--eval", workspace / "eval.txt", "--eval-window", 32, "--eval-windows", 2, "--out", out,
               "--device", "cpu", "--no-progress") == 0
    assert json.loads((out / "ablation.json").read_text())["rows"][0]["copy_over_init"] is None
    assert "| phase1 |" in (out / "ablation.md").read_text()


def test_ablate_scores_fewer_windows_of_a_large_vocabulary_on_cpu():
    from tcal.recipes.ablate import AblateConfig, default_eval_windows

    assert AblateConfig().eval_windows is None
    assert default_eval_windows("cpu", 49_152) == 8  # SmolLM2: the table's protocol is unchanged
    assert default_eval_windows("cpu", 262_144) == 3  # Gemma 3
    assert default_eval_windows("cuda", 262_144) == 8


@pytest.mark.parametrize("argv, message", [
    (["convert", "--teacher", "{ws}/nope", "--out", "{ws}/x", "--eval", "none"], "does not exist"),
    (["convert", "--teacher", "{ws}/teacher", "--keep", "0,9", "--out", "{ws}/x", "--eval", "none"],
     "keep index 9 out of range"),
    (["convert", "--teacher", "{ws}/teacher", "--keep", "best:2", "--out", "{ws}/x", "--eval", "none"],
     "unknown keep policy"),
    (["convert", "--teacher", "{ws}/teacher", "--init", "magic", "--out", "{ws}/x", "--eval", "none"],
     "unknown init 'magic'"),
    (["eval", "{ws}/teacher", "--data", "{ws}/empty.txt", "--window", "32", "--windows", "2"], "empty"),
    (["eval", "{ws}/teacher", "--data", "{ws}/eval.txt", "--window", "32", "--windows", "5000"], "tokens"),
    (["ablate", "--teacher", "{ws}/teacher", "--calib", "wiki", "--eval", "wiki:eval", "--out", "{ws}/x"], "overlaps"),
    (["convert", "--teacher", "{ws}/teacher", "--calib", "wiki:eval", "--eval", "wiki:eval", "--out", "{ws}/x"],
     "overlaps"),
])
def test_bad_input_is_one_line_and_leaves_no_output(workspace, capsys, argv, message):
    (workspace / "empty.txt").write_text("")
    argv = [a.replace("{ws}", str(workspace)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tcal: error: ")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err
    assert not (workspace / "x").exists()
