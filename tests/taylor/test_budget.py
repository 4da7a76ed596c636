"""Named calibration budgets, typed, and the flags that pick and override them."""
import dataclasses

import pytest

from tcal.taylor.budget import CALIB_BUDGETS, CalibArgs, CalibBudget
from tcal.taylor.stage_config import AlignConfig, KLConfig
from tcal.utils.errors import TcalError


def test_calib_flags():
    names = [f.name for f in dataclasses.fields(CalibArgs)]
    assert names == ["calib", "calib_budget", "calib_window", "calib_windows", "align_steps", "kl_steps",
                     "kl_recall_frac", "kl_recall_span", "kl_data", "kl_windows", "fit_matmul"]
    assert (CalibArgs().calib, CalibArgs().calib_budget, CalibArgs().calib_window, CalibArgs().calib_windows,
            CalibArgs().align_steps) == ("auto", "auto", None, None, None)


def test_calibration_budget_follows_the_device_and_explicit_flags_win():
    ref_kl = {"steps": 40, "batch_size": 3}
    reference = CalibBudget("reference", 4, 256, AlignConfig(steps=300), KLConfig(**ref_kl))
    assert CalibArgs().budget("cpu") == reference  # the paper's on CPU
    b = CalibArgs().budget("cuda:0")
    assert (b.name, b.windows, b.window) == ("large", CALIB_BUDGETS["large"].windows, 512) and b.align.batch_size == 16
    assert b.kl == KLConfig(steps=300, batch_size=8)
    assert CalibArgs(calib_budget="reference").budget("cuda") == reference
    assert CalibArgs(calib_windows=8, calib_window=64, align_steps=5, kl_steps=2).budget("cpu") == CalibBudget(
        "reference", 8, 64, AlignConfig(steps=5), KLConfig(steps=2, batch_size=3))
    b = CalibArgs(calib_budget="xl").budget("cuda")
    assert (b.name, b.windows * b.window, b.kl.steps, b.align.batch_size) == ("xl", 2**20, 1200, 16)  # 1M tokens
    big = CalibArgs(calib_budget="large", align_steps=7).budget("cpu").align
    assert big.steps == 7 and CALIB_BUDGETS["large"].align.steps == 300  # the preset itself is not edited
    kl = CalibArgs(kl_recall_frac=0.5, kl_recall_span=128).budget("cuda").kl  # the KL stage's recall mix
    assert kl == KLConfig(steps=300, batch_size=8, recall_frac=0.5, recall_span=128)
    b = CalibArgs(calib_budget="long").budget("cuda")  # the mix is this budget's own
    assert (b.name, b.windows, b.window, b.kl) == (
        "long", 64, 4096, KLConfig(steps=90, batch_size=1, recall_frac=0.5, recall_span=256))
    assert CalibArgs(calib_budget="long", kl_recall_frac=0.0).budget("cuda").kl == KLConfig(steps=90, batch_size=1)
    assert CalibArgs(calib_budget="long", kl_recall_frac=0.25).budget("cuda").kl.recall_frac == 0.25
    assert CALIB_BUDGETS["long"].kl.recall_frac == 0.5  # resolving it left the preset alone
    with pytest.raises(TcalError, match="--calib-window"):  # the budget's mix on a window too short for its span
        CalibArgs(calib_budget="long", calib_window=256).budget("cuda")
    for bad, message in ((dict(calib_windows=1), "--calib-windows must be at least 2"),
                         (dict(calib_window=1), "--calib-window must be at least 2 tokens, got 1"),
                         (dict(align_steps=-1), "--align-steps must be >= 0, got -1"),
                         (dict(kl_steps=-1), "--kl-steps must be >= 0, got -1"),
                         (dict(calib_budget="huge"), "--calib-budget must be .*; got 'huge'"),
                         (dict(kl_recall_frac=1.5), "--kl-recall-frac must be in \\[0, 1\\], got 1.5"),
                         (dict(kl_recall_frac=0.5, kl_recall_span=0), "--kl-recall-span must be at least 1, got 0"),
                         (dict(kl_recall_frac=0.5, calib_window=300), "needs --calib-window of at least 512 tokens, "
                                                                      "got 300")):
        with pytest.raises(TcalError, match=message):
            CalibArgs(**bad).check_calib()


def test_fit_matmul_sets_both_fits_and_auto_leaves_the_device_default():
    auto = CalibArgs(calib_budget="medium").budget("cpu")
    assert (auto.align.tf32, auto.kl.tf32) == (None, None)  # the device's: TF32 on CUDA, fp32 on a CPU
    for flag, value in (("fast", True), ("fp32", False)):
        b = CalibArgs(calib_budget="medium", fit_matmul=flag).budget("cpu")
        assert (b.align.tf32, b.kl.tf32) == (value, value)
        assert dataclasses.replace(b.align, tf32=None) == auto.align  # nothing else changed
    with pytest.raises(TcalError, match="--fit-matmul must be auto, fast or fp32, got 'bf16'"):
        CalibArgs(fit_matmul="bf16").check_calib()


def test_a_resolved_budget_holds_its_own_configs():
    # the stage configs are mutable dataclasses: what a caller does to its budget stays out of the presets
    for name in CALIB_BUDGETS:
        b = CalibArgs(calib_budget=name).budget("cuda")
        assert b.align is not CALIB_BUDGETS[name].align and b.kl is not CALIB_BUDGETS[name].kl
    b = CalibArgs().budget("cpu")
    b.align.steps, b.kl.steps = 1, 1
    assert (CALIB_BUDGETS["reference"].align.steps, CALIB_BUDGETS["reference"].kl.steps) == (300, 40)


def test_kl_data_follows_the_teacher_and_its_windows_the_budget():
    """--kl-data auto: the calibration windows for every built-in teacher (chat windows kept code PPL lower but not
    HumanEval answers, docs/results.md); --kl-data chat:CODE's windows' count and length come from the budget unless
    --kl-windows says; a budget with the recall mix (long) fits the calibration windows."""
    from tcal.conversion.resolve import resolve_teacher_args
    from tcal.utils.errors import TcalError

    coder, prose = CalibArgs(), CalibArgs()
    resolve_teacher_args(coder, "qwen2.5-coder-0.5b")
    resolve_teacher_args(prose, "smollm2-135m")
    assert (coder.kl_data, prose.kl_data) == ("calib", "calib")
    assert coder.kl_options(coder.budget("cpu")) == {}
    coder.kl_data = "chat:code:calib"
    assert coder.kl_options(coder.budget("cpu")) == {"kl_data": "chat:code:calib", "kl_windows": (20, 512)}
    assert coder.kl_options(coder.budget("cuda")) == {"kl_data": "chat:code:calib", "kl_windows": (160, 1024)}
    assert prose.kl_options(prose.budget("cpu")) == {}
    coder.kl_windows = 8
    assert coder.kl_options(coder.budget("cpu"))["kl_windows"] == (8, 512)
    coder.calib_budget = "long"
    assert coder.kl_options(coder.budget("cuda")) == {}
    for bad, msg in (({"kl_data": "chats"}, "--kl-data must be"), ({"kl_windows": 1}, "--kl-windows must be"),
                     ({"kl_data": "chat:code:calib", "kl_recall_frac": 0.5}, "one or the other")):
        with pytest.raises(TcalError, match=msg):
            CalibArgs(**bad).check_calib()
