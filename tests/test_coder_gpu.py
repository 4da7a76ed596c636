"""bench/coder_gpu.py's detached job: the code it runs is a copy outside the work tree, the steps start in a session
of their own, and --watch reports the curve rows and copies the tables out (no GPU, no model: the job's command is
caught, the run folder made by hand)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def coder_gpu():
    spec = importlib.util.spec_from_file_location("coder_gpu", ROOT / "bench" / "coder_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_detach_runs_a_copy_of_the_code_in_a_session_of_its_own(tmp_path, monkeypatch, capsys):
    mod = coder_gpu()
    started = {}

    class Popen:
        def __init__(self, cmd, **kw):
            started.update(cmd=cmd, **kw)
            self.pid = 4242

    monkeypatch.setattr(mod.subprocess, "Popen", Popen)
    samples = tmp_path / "tree" / "samples.jsonl.xz"
    samples.parent.mkdir()
    samples.write_bytes(b"x")
    job, runs = tmp_path / "job", tmp_path / "runs"
    rc = mod.main(["--detach", "--minutes", "20", "--steps", "instruct,recover", "--job-dir", str(job), "--runs",
                   str(runs), "--instruct-samples", str(samples), "--tokens", "2000000"])
    assert rc == 0
    code = job / "code"
    assert (code / "src" / "tcal" / "cli.py").is_file() and (code / "bench" / "coder_gpu.py").is_file()
    assert not (code / "bench" / "results").exists()  # the copy holds code, not the results pages' raw outputs
    cmd = started["cmd"]
    assert cmd[1] == str(code / "bench" / "coder_gpu.py") and started["cwd"] == job
    assert started["start_new_session"] and started["stdin"] == subprocess.DEVNULL
    assert "--detach" not in cmd and cmd[cmd.index("--steps") + 1] == "instruct,recover"
    # the samples file lay in the work tree: the job reads its own copy
    assert cmd[cmd.index("--instruct-samples") + 1] == str(job / "inputs" / "samples.jsonl.xz")
    assert (job / "inputs" / "samples.jsonl.xz").read_bytes() == b"x"
    assert cmd[cmd.index("--tokens") + 1] == "2000000" and cmd.count("--instruct-samples") == 1
    assert (job / "job.pid").read_text().strip() == "4242"
    assert "started pid 4242" in capsys.readouterr().out


def test_a_second_detach_while_the_job_runs_is_refused(tmp_path, capsys):
    mod = coder_gpu()
    job = tmp_path / "job"
    job.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (job / "job.pid").write_text(f"{sleeper.pid}\n")
        assert mod.alive(job / "job.pid")
        assert mod.main(["--detach", "--minutes", "5", "--job-dir", str(job), "--runs", str(tmp_path / "r")]) == 1
        assert "a job already runs" in capsys.readouterr().out
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not mod.alive(job / "job.pid")


def test_watch_prints_the_curve_rows_and_copies_the_tables(tmp_path, capsys):
    mod = coder_gpu()
    job, runs, out = tmp_path / "job", tmp_path / "runs", tmp_path / "out"
    run = runs / "recover.partial" / "taylor.partial"
    run.mkdir(parents=True)
    (run / "curve.csv").write_text("tokens,step,eval_ppl,train_loss,lr,elapsed_s,humaneval,answer_kl\n"
                                   "0,0,4.5,nan,0.0,10.0,0.25,0.15\n16384,1,4.4,0.3,1e-4,40.0,0.26,0.14\n")
    (run / "timing.csv").write_text("tokens,step,point,ppl,humaneval\n0,0,21.5,1.2,15.0\n16384,1,20.0,1.1,14.0\n")
    (runs / "logs").mkdir()
    (runs / "logs" / "recover.log").write_text("line one\ndistill: 50%|#### | 1.0M/2.0M [00:50<00:50, 20.0kit/s]\n"
                                               "line two\n")
    job.mkdir()
    (job / "job.log").write_text("=== started\n")
    (job / "job.pid").write_text("999999999\n")
    assert mod.main(["--watch", "--job-dir", str(job), "--runs", str(runs), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "job not running" in text and "line two" in text and "kit/s" not in text
    assert "curve rows so far (2)" in text
    assert "taylor     16,384 eval_ppl=4.400 humaneval=0.260 answer_kl=0.140  [s: point=20.0 ppl=1.1 humaneval=14.0]" \
        in text
    assert (out / "tables" / "recover.partial" / "taylor.partial" / "curve.csv").is_file()
    assert (out / "coder-gpu.tgz").is_file() and (out / "job.log").is_file()


def test_strip_flag_takes_either_spelling():
    mod = coder_gpu()
    assert mod.strip_flag(["--a", "1", "--steps", "x", "--steps=y", "--b"], "--steps") == ["--a", "1", "--b"]
    assert os.path.basename(mod.__file__) == "coder_gpu.py"
