"""`tcal convert` (CLI) and `tcal.convert()` (API) reach the stage chain through the same function:
for the same teacher, layers, init and calibration data they give bit-identical GDN weights."""
import json

import pytest
import torch
from safetensors.torch import load_file

import tcal
from tcal.cli import main
from tcal.data.teachers import load_teacher
from tcal.taylor.phase2 import AlignConfig
from tcal.utils.runtime import fit_matmul_kind


@pytest.mark.parametrize("init", ["taylor", "taylor-exact-silent", "phase2"])
def test_cli_and_api_give_bit_identical_gdn_weights(workspace, init):
    out = workspace / f"cli-{init}"
    argv = ["convert", "--teacher", workspace / "teacher", "--keep", "0,2", "--init", init,
            "--calib", workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 4, "--align-steps", 7,
            "--eval", "none", "--device", "cpu", "--out", out]
    assert main([str(a) for a in argv]) == 0
    cli = load_file(out / "model.safetensors")
    report = json.loads((out / "report.json").read_text())
    assert "phase2_s" in report["timings"]  # where the conversion's time went
    if init == "taylor":  # the one of the three with a KL stage: what it did is in the report
        assert report["kl_stage"]["steps_run"] >= 1 and report["timings"]["kl_stage_s"] == report["kl_stage"]["wall_s"]
    else:
        assert report["kl_stage"] is None

    teacher, tok = load_teacher(str(workspace / "teacher"))
    hybrid = tcal.convert(teacher, keep=[0, 2], init=init, calib=str(workspace / "calib.txt"), tokenizer=tok,
                          calib_window=32, calib_windows=4, align=AlignConfig(steps=7))
    api = {k: v for k, v in hybrid.state_dict().items()}
    gdn = [k for k in api if k.startswith(("model.layers.1.self_attn.", "model.layers.3.self_attn."))]
    assert len(gdn) >= 10
    for k in gdn:
        assert torch.equal(cli[k], api[k]), f"{k} differs between `tcal convert` and tcal.convert()"
    if init != "phase2":  # Phase 1 moved the decay away from fla's random default, identically in both
        assert not torch.equal(api["model.layers.1.self_attn.dt_bias"],
                               tcal.convert(teacher, keep=[0, 2], init="copy").state_dict()[
                                   "model.layers.1.self_attn.dt_bias"])


def test_cli_takes_a_calibration_mixture(workspace):
    """`--calib a+b` (what --help promises) reaches the same interleaved windows as the API."""
    words = (workspace / "calib.txt").read_text().split()
    (workspace / "calib2.txt").write_text(" ".join(reversed(words)))  # another text, the same vocabulary
    mix = f"{workspace / 'calib.txt'}+{workspace / 'calib2.txt'}"
    out = workspace / "cli-mix"
    argv = ["convert", "--teacher", workspace / "teacher", "--keep", "0,2", "--init", "phase2", "--calib", mix,
            "--calib-window", 32, "--calib-windows", 4, "--align-steps", 3, "--eval", "none", "--device", "cpu",
            "--out", out]
    assert main([str(a) for a in argv]) == 0
    cli = load_file(out / "model.safetensors")
    teacher, tok = load_teacher(str(workspace / "teacher"))
    api = tcal.convert(teacher, keep=[0, 2], init="phase2", calib=mix, tokenizer=tok, calib_window=32,
                       calib_windows=4, align=AlignConfig(steps=3)).state_dict()
    single = tcal.convert(teacher, keep=[0, 2], init="phase2", calib=str(workspace / "calib.txt"), tokenizer=tok,
                          calib_window=32, calib_windows=4, align=AlignConfig(steps=3)).state_dict()
    key = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(cli[key], api[key])
    assert not torch.equal(api[key], single[key])  # the second part was really read


def test_report_says_when_the_kl_stage_had_the_recall_mix():
    from tcal.recipes.convert import ConvertConfig, convert_markdown

    report = {"layer_types": ["full_attention", "linear_attention"], "timings": {},
              "calibration": {"data": "wiki:calib", "sequences": 4, "tokens_per_sequence": 512,
                              "kl": {"steps": 3, "recall_frac": 0.5, "recall_span": 128}}}
    cfg = ConvertConfig(teacher="t", out="o")
    assert "50% of its windows end with a copy of an earlier 128-token span" in convert_markdown(cfg, report)
    report["calibration"]["kl"] = {"steps": 3}
    assert "recall mix" not in convert_markdown(cfg, report)


def test_no_progress_silences_the_evaluation_too(workspace, capsys):
    words = (workspace / "calib.txt").read_text().split()
    (workspace / "heldout.txt").write_text(" ".join(reversed(words)))
    argv = ["convert", "--teacher", workspace / "teacher", "--keep", "0,2", "--init", "copy", "--eval",
            workspace / "heldout.txt", "--eval-window", 32, "--eval-windows", 2, "--device", "cpu", "--no-progress",
            "--out", workspace / "quiet"]
    assert main([str(a) for a in argv]) == 0
    captured = capsys.readouterr()
    assert "held-out PPL" in captured.out and "perplexity" not in captured.err + captured.out


def test_keep_auto_is_the_teachers_convert_share(workspace, monkeypatch):
    """tcal convert --keep auto takes the teacher table's share (uniform:75% for the code teachers), and an explicit
    --keep stays the user's."""
    import tcal.data.teacher_table as table

    assert table.default_convert_keep("qwen2.5-coder-0.5b", "reference") == "uniform:75%"
    assert table.default_convert_keep("qwen2.5-coder-1.5b", "reference") == "uniform:75%"
    assert table.default_convert_keep("qwen2.5-coder-0.5b", "large") == "auto"  # the GPU default keeps half
    assert table.default_convert_keep("smollm2-135m", "reference") == "auto"
    assert table.default_convert_keep("/a/model", "reference") == "auto"
    budgets = []
    monkeypatch.setattr(table.TeacherRef, "convert_keep",
                        lambda teacher, budget: budgets.append(budget) or "uniform:75%")

    def converted(name, *keep):
        argv = ["convert", "--teacher", workspace / "teacher", *keep, "--init", "copy", "--eval", "none",
                "--device", "cpu", "--no-progress", "--out", workspace / name]
        assert main([str(a) for a in argv]) == 0
        types = json.loads((workspace / name / "config.json").read_text())["layer_types"]
        return sum(t == "linear_attention" for t in types), len(types)

    linear, layers = converted("auto")
    assert linear == layers - round(0.75 * layers) and linear >= 1
    assert converted("mine", "--keep", "uniform:50%")[0] == layers // 2
    assert budgets == ["reference"]  # asked once, for the auto run, with the CPU's budget


def test_a_teachers_cpu_recipe_fills_what_the_user_left_to_auto(workspace, monkeypatch, capsys):
    """tcal convert on a CPU with --calib-budget auto runs the teacher's CPU recipe (its budget, kept layers and
    step counts); each flag the user gives wins, an init without a KL stage and a named budget leave it unused."""
    import tcal.data.teacher_table as table

    assert table.TeacherRef("qwen2.5-coder-0.5b").cpu_convert == table.CODER_05B_CPU
    assert table.TeacherRef("qwen2.5-coder-1.5b").cpu_convert is None  # measured for the 0.5B only
    assert table.CODER_05B_CPU.flags() == ("--calib-budget medium --keep 0,1,5,6,8,10,13,14,15,16,17,20 "
                                           "--align-steps 150 --kl-steps 20 --kl-data answers --fit-matmul fast")
    recipe = table.CpuRecipe("reference", keep="0,2", align_steps=3, kl_steps=2, kl_data="calib", fit_matmul="fast")
    monkeypatch.setattr(table.TeacherRef, "cpu_convert", property(lambda ref: recipe))

    def converted(name, *flags, init="taylor"):
        calib = ["--calib", workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 4] if init != "copy" else []
        argv = ["convert", "--teacher", workspace / "teacher", "--init", init, *calib, *flags, "--eval", "none",
                "--device", "cpu", "--no-progress", "--out", workspace / name]
        assert main([str(a) for a in argv]) == 0
        cfg = json.loads((workspace / name / "tcal_config.json").read_text())
        report = json.loads((workspace / name / "report.json").read_text())
        kept = [i for i, t in enumerate(report["layer_types"]) if t != "linear_attention"]
        return cfg, report, kept

    cfg, report, kept = converted("recipe")
    assert "its CPU recipe, --calib-budget reference --keep 0,2 --align-steps 3 --kl-steps 2" in capsys.readouterr().out
    assert (cfg["calib_budget"], cfg["keep"], cfg["align_steps"], cfg["kl_steps"], kept) == (
        "reference", "0,2", 3, 2, [0, 2])
    assert report["kl_stage"]["steps_run"] == 2 and report["calibration"]["align"]["steps"] == 3
    assert cfg["fit_matmul"] == "fast" and report["calibration"]["align"]["tf32"] is True
    assert set(report["calibration"]["matmul"].values()) == {fit_matmul_kind("cpu")}  # what ran, in the report
    cfg, _, kept = converted("mine", "--keep", "0,1", "--kl-steps", "1")  # the user's flags win, the rest is the recipe's
    assert (cfg["keep"], kept, cfg["kl_steps"], cfg["align_steps"]) == ("0,1", [0, 1], 1, 3)
    capsys.readouterr()
    cfg, report, _ = converted("named", "--calib-budget", "reference", "--keep", "0,2")  # a named budget is itself
    assert (cfg["align_steps"], cfg["kl_steps"], cfg["fit_matmul"]) == (None, None, "auto")
    assert report["calibration"]["matmul"] == {"phase2": "fp32", "kl": "fp32"}  # a CPU's default
    cfg, _, _ = converted("copy", init="copy")  # no KL stage: the recipe is not this init's
    assert (cfg["calib_budget"], cfg["keep"]) == ("auto", "auto")
    assert "CPU recipe" not in capsys.readouterr().out


@pytest.mark.parametrize("init, extra", [("taylor", ["--align-steps", 2, "--kl-steps", 2]), ("phase1", [])])
def test_a_bfloat16_conversion_calibrates_and_saves_bfloat16_weights(workspace, init, extra):
    """Before: Phase 1 failed on mismatched dtypes once the statistics were collected; its fits now run in float32
    and the layers go back to bfloat16."""
    out = workspace / f"bf16-{init}"
    argv = ["convert", "--teacher", workspace / "teacher", "--keep", "0,2", "--init", init, "--calib",
            workspace / "calib.txt", "--calib-window", 32, "--calib-windows", 4, *extra, "--eval", "none", "--dtype",
            "bfloat16", "--device", "cpu", "--no-progress", "--out", out]
    assert main([str(a) for a in argv]) == 0
    weights = load_file(out / "model.safetensors")
    gdn = {k: v for k, v in weights.items() if k.startswith("model.layers.1.self_attn.") and v.dim() == 2}
    assert gdn and all(v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all() for v in gdn.values())
    record = json.loads((out / "report.json").read_text())
    assert record["init"] == init
