"""The GPU machine's jobs (bench/device_jobs.py, run by scripts/device_session.sh): they name tests that exist, their
check steps fail loudly when no test ran (on a machine without CUDA every CUDA test skips, which pytest counts as
success), and every command a step runs is one its program takes: each tcal command parses with tcal's own parser,
each benchmark exists and has every flag it is given."""
import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + sorted((ROOT / "bench").glob("*.sh")) + [ROOT / "bench" /
                                                                                               "device_jobs.py"]


@functools.cache
def device_jobs():
    spec = importlib.util.spec_from_file_location("device_jobs", ROOT / "bench" / "device_jobs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_test_a_script_names_exists():
    named = {(script.name, m[1], m[2]) for script in SCRIPTS
             for m in re.finditer(r"(tests/[\w/]+\.py)(?:::(\w+))?", script.read_text())}
    assert named, "the scripts name no tests: the pattern above no longer finds them"
    for script, path, test in named:
        assert (ROOT / path).is_file(), f"{script} names {path}, which does not exist"
        if test:
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{script} names {path}::{test}"


def test_the_check_step_fails_on_a_test_that_does_not_exist(tmp_path, capsys):
    assert device_jobs().cuda_tests(tmp_path / "log", "tests/test_evaluate.py::test_cuda_matches_cpu") == 4
    assert "tests/test_evaluate.py does not exist" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA these tests run")
def test_the_check_step_fails_when_every_test_skipped(tmp_path, capsys):
    assert device_jobs().cuda_tests(tmp_path / "log", "tests/evaluate/test_perplexity.py::test_cuda_matches_cpu") == 1
    assert "the CUDA tests did not run and pass" in capsys.readouterr().err
    assert "1 skipped" in (tmp_path / "log").read_text()


def test_every_command_a_step_runs_is_one_its_program_takes(tmp_path, monkeypatch, capsys):
    """Every step, run with its commands recorded instead of run, on a machine where the teacher, its pool and every
    run a later step reads are in place: each tcal command parses (a flag tcal dropped fails here, not on the GPU
    machine), each benchmark exists and defines every flag given to it."""
    from tcal.cli import build_parser

    jobs = device_jobs()
    ran = []
    monkeypatch.setattr(jobs.Job, "run", lambda self, *argv, **kw: ran.append([str(a) for a in argv]) or 0)
    monkeypatch.setattr(jobs.Job, "start", lambda self, argv, log, env=None: ran.append([str(a) for a in argv]) or
                        type("Done", (), {"wait": lambda self: 0})())
    monkeypatch.setattr(jobs, "cuda_tests", lambda log, *tests: ran.append(["pytest", *tests]) or 0)
    monkeypatch.setattr("tcal.load_teacher", lambda *a, **k: None)
    stage, runs = tmp_path / "stage", tmp_path / "stage" / "runs"
    job = jobs.Job(stage, tmp_path / "out", runs, env={"DISTILL_FROM": "taylor-large", "CALL_S": "100000"})
    (job.pool).mkdir(parents=True)
    (job.pool / "manifest.json").write_text("{}")
    (runs / job.teacher / "taylor-large").mkdir(parents=True)
    (runs / job.teacher / "taylor-large" / "report.json").write_text("{}")
    (runs / "recover50" / "taylor").mkdir(parents=True)
    for d in (job.stage, job.out):
        d.mkdir(parents=True, exist_ok=True)
    for name, (fn, _, _) in jobs.STEPS.items():
        job.step = name
        if name != "stage":  # stage reports the versions of torch and fla after tcal airgap stage
            fn(job)
    jobs.need_teacher(job)
    parser = build_parser()
    tcal_commands = [argv[3:] for argv in ran if argv[1:3] == ["-m", "tcal"]]
    assert {c[0] for c in tcal_commands} >= {"airgap", "eval", "convert", "ablate", "distill", "bench"}
    for argv in tcal_commands:
        parser.parse_args(argv)  # argparse exits on a flag tcal does not take
    # (the benchmark, its arguments), torchrun's included
    benches = [(a, argv[i + 1:]) for argv in ran for i, a in enumerate(argv) if a.startswith("bench/")]
    assert {Path(a).name for a, _ in benches} >= {"gdn_ops.py", "calib_speed.py", "calib_sweep.py", "quality_suite.py",
                                                   "distill_speed.py", "distill_device.sh", "fsdp_smoke.py"}
    helps = {}
    for name, args in benches:
        if name == "bench/distill_device.sh":  # its own flags, then tcal recover's
            own = {"--tokens", "--data", "--minutes", "--run", "--inits"}
            parser.parse_args(["recover", *[a for i, a in enumerate(args)
                                            if a not in own and (i == 0 or args[i - 1] not in own)]])
            text, args = (ROOT / name).read_text(), [a for a in args if a in own]
        else:  # the benchmark's own --help (a subcommand's, where it has them)
            sub = [args[0]] if args and not args[0].startswith("-") else []
            key = (name, *sub)
            if key not in helps:
                helps[key] = subprocess.run([sys.executable, name, *sub, "--help"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=300).stdout
            text = helps[key]
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", text), f"{name} takes no {flag}"
    assert not any("/tmp/tcal-runs" in a for argv in ran for a in argv)  # runs live where the job says
    assert "Traceback" not in capsys.readouterr().err


def test_the_session_script_is_a_thin_wrapper():
    text = (ROOT / "scripts" / "device_session.sh").read_text()
    code = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert len(code) <= 8 and "python3 -c" not in text and "it/s" not in text and "tcal-runs" not in text
    assert code[-1].startswith("exec python3 bench/device_jobs.py")


def test_an_unknown_step_is_one_line(capsys):
    assert device_jobs().main(["--stage", "/nonexistent/never", "warp"]) == 2
    assert capsys.readouterr().err.startswith("unknown step warp; the steps are stage, check")
