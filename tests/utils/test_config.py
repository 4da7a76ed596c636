"""Config dataclasses <-> argparse flags, and the shared field groups the commands are built from."""
import argparse
import dataclasses

import pytest

from tcal.utils.config import CalibArgs, DeviceArgs, EvalArgs, GDNArgs, TeacherArgs, add_dataclass_args, arg, from_args


@dataclasses.dataclass
class Example(TeacherArgs, DeviceArgs):
    steps: int = arg(3, "steps")
    limit: int | None = arg(None, "an optional limit")
    rate: float = arg(0.5, "a 50% rate")
    mode: str = arg("a", "a mode", choices=("a", "b"))
    verbose: bool = arg(True, "talk")


def parse(cls, argv, **kw):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls, **kw)
    return p, p.parse_args(argv)


def test_fields_become_flags_with_types_and_defaults():
    _, ns = parse(Example, [])
    assert from_args(Example, ns) == Example()
    _, ns = parse(Example, ["--steps", "7", "--limit", "4", "--rate", "0.25", "--mode", "b", "--no-verbose",
                            "--teacher", "t", "--device", "cpu"])
    cfg = from_args(Example, ns)
    assert (cfg.steps, cfg.limit, cfg.rate, cfg.mode, cfg.verbose, cfg.teacher, cfg.device) == (
        7, 4, 0.25, "b", False, "t", "cpu")
    assert from_args(Example, ns, steps=9).steps == 9  # overrides win


def test_choices_help_percent_and_skip(capsys):
    p, _ = parse(Example, [])
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "a 50% rate" in out and "(default: smollm2-135m)" in out  # % survives argparse's formatting
    p, ns = parse(Example, [], skip=("steps",))
    assert not hasattr(ns, "steps") and from_args(Example, ns).steps == 3


def test_shared_field_groups():
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert names(TeacherArgs) == ["teacher"] and TeacherArgs().teacher == "smollm2-135m"
    assert names(DeviceArgs) == ["device"] and DeviceArgs().device == "auto"
    assert names(CalibArgs) == ["calib", "calib_budget", "calib_window", "calib_windows", "align_steps", "kl_steps",
                                "kl_recall_frac", "kl_recall_span"]
    assert (CalibArgs().calib, CalibArgs().calib_budget, CalibArgs().calib_window, CalibArgs().calib_windows,
            CalibArgs().align_steps) == ("wiki:calib+shakespeare:calib", "auto", None, None, None)
    assert names(EvalArgs) == ["eval", "eval_window", "eval_windows"] and EvalArgs().eval == "wiki:eval"
    assert names(GDNArgs) == ["use_short_conv", "output_gate"]
    assert (GDNArgs().use_short_conv, GDNArgs().output_gate) == (False, True)
    _, ns = parse(GDNArgs, ["--use-short-conv", "--no-output-gate"])
    assert from_args(GDNArgs, ns) == GDNArgs(use_short_conv=True, output_gate=False)


def test_calibration_budget_follows_the_device_and_explicit_flags_win():
    from tcal.utils.config import CALIB_BUDGETS
    from tcal.utils.errors import TcalError

    ref_kl = {"steps": 40, "batch_size": 3}
    assert CalibArgs().budget("cpu") == ("reference", 4, 256, {"steps": 300}, ref_kl)  # the paper's on CPU
    name, n, w, align, kl = CalibArgs().budget("cuda:0")
    assert (name, n, w) == ("large", CALIB_BUDGETS["large"]["windows"], 512) and align["batch_size"] == 16
    assert kl == {"steps": 300, "batch_size": 8}
    assert CalibArgs(calib_budget="reference").budget("cuda") == ("reference", 4, 256, {"steps": 300}, ref_kl)
    assert CalibArgs(calib_windows=8, calib_window=64, align_steps=5, kl_steps=2).budget("cpu") == (
        "reference", 8, 64, {"steps": 5}, {"steps": 2, "batch_size": 3})
    name, n, w, align, kl = CalibArgs(calib_budget="xl").budget("cuda")
    assert (name, n * w, kl["steps"], align["batch_size"]) == ("xl", 2**20, 1200, 16)  # 1M tokens
    big = CalibArgs(calib_budget="large", align_steps=7).budget("cpu")[3]
    assert big["steps"] == 7 and CALIB_BUDGETS["large"]["align"]["steps"] == 300  # the preset itself is not edited
    kl = CalibArgs(kl_recall_frac=0.5, kl_recall_span=128).budget("cuda")[4]  # the KL stage's recall mix
    assert kl == {"steps": 300, "batch_size": 8, "recall_frac": 0.5, "recall_span": 128}
    name, n, w, align, kl = CalibArgs(calib_budget="long").budget("cuda")  # the mix is this budget's own
    assert (name, n, w, kl) == ("long", 64, 4096, {"steps": 90, "batch_size": 1, "recall_frac": 0.5, "recall_span": 256})
    assert "recall_frac" not in CalibArgs(calib_budget="long", kl_recall_frac=0.0).budget("cuda")[4]  # 0 turns it off
    assert CalibArgs(calib_budget="long", kl_recall_frac=0.25).budget("cuda")[4]["recall_frac"] == 0.25
    assert CALIB_BUDGETS["long"]["kl"]["recall_frac"] == 0.5  # resolving it left the preset alone
    with pytest.raises(TcalError, match="--calib-window"):  # the budget's mix on a window too short for its span
        CalibArgs(calib_budget="long", calib_window=256).budget("cuda")
    for bad in (dict(calib_windows=1), dict(calib_window=1), dict(align_steps=-1), dict(kl_steps=-1),
                dict(calib_budget="huge"), dict(kl_recall_frac=1.5), dict(kl_recall_frac=0.5, kl_recall_span=0),
                dict(kl_recall_frac=0.5, calib_window=300)):
        with pytest.raises(TcalError):
            CalibArgs(**bad).check_calib()


def test_eval_lists_several_domains_and_refuses_repeats():
    from tcal.utils.errors import TcalError

    assert EvalArgs(eval="wiki:eval, sotu:eval").eval_list() == ["wiki:eval", "sotu:eval"]
    assert EvalArgs(eval="some text\nwith, a comma").eval_list() == ["some text\nwith, a comma"]  # raw text
    for bad in ("wiki:eval,wiki:eval", "wiki:eval,,sotu:eval"):
        with pytest.raises(TcalError, match="empty or repeated"):
            EvalArgs(eval=bad).check_eval()
