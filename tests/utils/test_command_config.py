"""Config dataclasses <-> argparse flags, and the shared field groups the commands are built from."""
import argparse
import dataclasses

import pytest

from tcal.utils.command_config import DeviceArgs, EvalArgs, GDNArgs, TeacherArgs, add_dataclass_args, arg, from_args


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
    assert names(EvalArgs) == ["eval", "eval_window", "eval_windows"] and EvalArgs().eval == "auto"
    from tcal.conversion.resolve import resolve_teacher_args

    home, every, given = EvalArgs(), EvalArgs(), EvalArgs(eval="sotu:eval")
    resolve_teacher_args(home, "qwen2.5-coder-0.5b")
    resolve_teacher_args(every, "qwen2.5-coder-0.5b", every_eval=True)
    resolve_teacher_args(given, "qwen2.5-coder-0.5b")
    assert (home.eval, every.eval, given.eval) == ("code:eval", "code:eval,wiki:eval", "sotu:eval")
    assert names(GDNArgs) == ["use_short_conv", "output_gate"]
    assert (GDNArgs().use_short_conv, GDNArgs().output_gate) == (False, True)
    _, ns = parse(GDNArgs, ["--use-short-conv", "--no-output-gate"])
    assert from_args(GDNArgs, ns) == GDNArgs(use_short_conv=True, output_gate=False)


def test_eval_lists_several_domains_and_refuses_repeats():
    from tcal.utils.errors import TcalError

    assert EvalArgs(eval="wiki:eval, sotu:eval").eval_list() == ["wiki:eval", "sotu:eval"]
    assert EvalArgs(eval="some text\nwith, a comma").eval_list() == ["some text\nwith, a comma"]  # raw text
    for bad in ("wiki:eval,wiki:eval", "wiki:eval,,sotu:eval"):
        with pytest.raises(TcalError, match="empty or repeated"):
            EvalArgs(eval=bad).check_eval()
