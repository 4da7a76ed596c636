"""The Qwen2.5-Coder GPU experiment in one command: stage what was carried, check and time the GDN training path,
build the instruct set, recover each init on it, and copy the tables out. Every step keeps its work in --runs and
skips what is done, so a job cut by its wall-time limit resumes by running the same command again.

    python bench/coder_gpu.py --minutes 40                       # all steps in this command, within 40 minutes
    python bench/coder_gpu.py --minutes 9 --steps stage          # one transfer of a multi-transfer staging

Steps (``--steps``, in this order):

- ``stage``: ``python -m tcal.airgap stage`` of the folders under ``--carry`` (what ``python -m tcal.airgap pack``
  wrote: the teacher, its corpora and token pool, the wheels); the pool lands in STAGE/pools/TEACHER.
- ``speed``: fla's kernels against the fp32 loop (tests/ops/test_fla.py, gradients included, where fla trains here),
  then training tokens/s and peak memory of ``bench/distill_speed.py`` at the teacher's shape with the recovery's
  batch on the default path (fla's backward where it works). The path it replaces is the image's own: the same
  ``bench/distill_speed.py`` line before the wheels are staged (the chunked PyTorch path, compiled with the
  image's Triton; a newer Triton than the image's torch knows cannot compile it).
- ``instruct``: the instruct set: ``tcal instruct --samples FILE`` packs an earlier run's samples again (no
  generation), otherwise the teacher answers ``--instruct-tasks`` tasks of ``--instruct-sources``.
- ``recover``: ``tcal recover`` of ``--inits`` on the instruct set with a quarter of every batch from the teacher's
  pool, HumanEval pass@1, passkey and code PPL at every curve point; paused (checkpointed) when this job's minutes
  run out, resumed by the next.

Every step's log and results (reports, curves, tables; no weights) are packed into OUT/coder-gpu.tgz after every
step: one file, whatever a job may copy back.

Detached (a GPU machine cuts each command at 10 minutes and lays the work tree anew at every call)::

    python bench/coder_gpu.py --detach --minutes 24 --instruct-samples S.jsonl.xz   # returns in about a minute
    python bench/coder_gpu.py --watch                                             # a few seconds, any time after

``--detach`` copies the code it runs (src/, bench/, tests/) to ``--job-dir`` (outside the work tree, so a later call
cannot take its files or its directory away), stages what was carried (``stage``, in the foreground: the carried
folders are the work tree's), copies ``--instruct-samples`` there too, then starts the other steps in a session of
their own (``setsid``) writing ``JOB/job.log``, and returns. Every step keeps its work in ``--runs``, the recovery
checkpoints every ``--save-every`` tokens, so a cut or returned machine loses at most the training since the last
checkpoint; the same command started again on a machine that kept ``--runs`` resumes. ``--watch`` says whether the
job still runs, prints the tail of its log and every curve row so far (tokens, PPL, pass@1, passkey, answer KL and
the seconds of each point), and copies the tables and the results archive to OUT.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("stage", "speed", "instruct", "recover")
# the recovery recipe of docs/results.md (*Recovery judged by the answers*): attention kept by answer:50%
RECIPE = ["--seq-len", "1024", "--batch-size", "16", "--mix-frac", "0.25",
          "--eval", "code:eval", "--eval-windows", "8", "--align-steps", "200", "--kl-steps", "100",
          "--kl-data", "chat:code:calib", "--allow-code-execution"]
# what a detached job copies out of the work tree to run from
CODE = ("src", "bench", "tests")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--minutes", type=float, default=None,
                    help="wall time this job may use, all steps together (required but with --watch)")
    ap.add_argument("--teacher", default="qwen2.5-coder-0.5b")
    ap.add_argument("--carry", default=".dev/carry", help="the transferred folders (skipped where absent)")
    ap.add_argument("--stage-dir", default="/tmp/tcal-stage")
    ap.add_argument("--runs", default="/tmp/tcal-runs/coder", help="where every step keeps its work (resumable)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="reports copied here")
    ap.add_argument("--instruct-samples", default="", help="an earlier instruct run's samples.jsonl(.xz) to pack")
    ap.add_argument("--instruct-tasks", type=int, default=4096)
    ap.add_argument("--instruct-sources", default="code:calib,python-src,python-lib")
    ap.add_argument("--keep", default="0,1,5,6,8,10,13,14,15,16,17,20")
    ap.add_argument("--inits", default="taylor,copy,taylor-reference")
    # one lease (docs/results.md, *Recovery judged by the answers*): three inits in about 20 minutes of GPU time at
    # 20K training tokens/s and 30 s a curve point: 2M tokens (100 s) and 5 points (0, 250K, 500K, 1M, 2M: 150 s)
    # each, the conversions, checkpoints and the teacher's scores besides
    ap.add_argument("--tokens", type=int, default=2_000_000, help="training tokens of every init")
    ap.add_argument("--eval-every", type=int, default=2_000_000)
    ap.add_argument("--eval-early", type=int, default=3, help="extra points at eval-every/2, /4, ...")
    ap.add_argument("--micro-batch", type=int, default=8, help="recover --micro-batch (of the 16 x 1024 batch)")
    ap.add_argument("--kl-chunk", type=int, default=4096, help="recover --kl-chunk: token rows per KL chunk")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="recover --compile")
    ap.add_argument("--warmup", default="12000", help="recover --warmup (tokens): the same warm-up at any budget")
    ap.add_argument("--tasks", default="humaneval:164,passkey:10@512,1024,2048,4096,8192")
    ap.add_argument("--save-every", type=int, default=500_000,
                    help="recover --save-every (tokens): what a cut machine loses at most")
    ap.add_argument("--recover-args", default="", help="more tcal recover arguments")
    ap.add_argument("--detach", action="store_true",
                    help="copy the code to --job-dir, stage, start the other steps detached (setsid) and return")
    ap.add_argument("--watch", action="store_true",
                    help="the detached job's progress: alive or not, its log's tail, the curve rows so far; the "
                         "tables and the results archive copied to --out")
    ap.add_argument("--job-dir", default="/tmp/tcal-job", help="where a detached job's code and log live")
    ap.add_argument("--tail", type=int, default=15, help="--watch: log lines shown")
    args = ap.parse_args(argv)
    if args.watch:
        return watch(args)
    if args.minutes is None:
        ap.error("--minutes is required (the wall time the job may use)")
    if args.detach:
        return detach(args, argv if argv is not None else sys.argv[1:])
    deadline = time.time() + args.minutes * 60
    runs, out, stage_dir = Path(args.runs), Path(args.out), Path(args.stage_dir)
    logs = runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(stage_dir / "site"), str(ROOT / "src"), str(ROOT / "tests")]))
    # compiled kernels kept beside the work: an init, a resumed call or a new job after a cut compiles nothing twice
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(runs / "compile-cache" / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(runs / "compile-cache" / "triton"))

    def left() -> float:
        return (deadline - time.time()) / 60

    def run(cmd: list[str], log: str, extra_env: dict | None = None) -> int:
        print(f"$ {' '.join(cmd)}", flush=True)
        with open(logs / log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.run(cmd, cwd=ROOT, env={**env, **(extra_env or {})}, stdout=f, stderr=subprocess.STDOUT)
        tail = [ln for ln in (logs / log).read_text(errors="replace").splitlines() if "it/s]" not in ln][-3:]
        print("\n".join(f"  {line[:300]}" for line in tail), flush=True)
        return p.returncode

    py = sys.executable
    for step in [s.strip() for s in args.steps.split(",") if s.strip()]:
        if step not in STEPS:
            print(f"unknown step {step!r}; steps: {', '.join(STEPS)}", file=sys.stderr)
            return 2
        print(f"=== {step} ({left():.1f} min left)", flush=True)
        if step == "stage":
            if Path(args.carry).is_dir():
                run([py, "-m", "tcal.airgap", "stage", "--carry", args.carry, "--stage", str(stage_dir)], "stage.log")
        elif step == "speed":
            if (runs / "speed-done").is_file():
                continue
            run([py, "-c", "import torch, transformers, triton, fla; print('torch', torch.__version__, "
                 "'transformers', transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__, "
                 "torch.cuda.get_device_name())"], "speed.log")
            rc = run([py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/ops/test_fla.py"], "speed.log")
            shape = ["--shape", "qwen2.5-0.5b", "--keep", args.keep, "--seq-len", "1024", "--batch-size", "16",
                     "--micro-batch", str(args.micro_batch), "--kl-chunk", str(args.kl_chunk), "--compile",
                     args.compile, "--steps", "12", "--warmup", "4"]
            run([py, "bench/distill_speed.py", *shape, "--json", str(runs / "speed-default.json")], "speed.log")
            if rc == 0 and "passed" in (logs / "speed.log").read_text():
                (runs / "speed-done").write_text("")
        elif step == "instruct":
            if (runs / "instruct" / "manifest.json").is_file():
                continue
            cmd = [py, "-m", "tcal.cli", "instruct", "--teacher", args.teacher, "--seq-len", "1024",
                   "--out", str(runs / "instruct"), "--no-progress"]
            if args.instruct_samples:
                cmd += ["--samples", args.instruct_samples]
            else:
                cmd += ["--sources", args.instruct_sources, "--max-tasks", str(args.instruct_tasks),
                        "--batch-size", "256", *(["--resume"] if (runs / "instruct.partial").is_dir() else [])]
            run(cmd, "instruct.log")
        elif step == "recover":
            minutes = left() - 2  # room to write the checkpoint and copy the reports
            if minutes < 3:
                print(f"recover: {left():.1f} min left, too little to start; run again", flush=True)
                continue
            pool = stage_dir / "pools" / args.teacher
            work = runs / "recover"
            cmd = [py, "-m", "tcal.cli", "recover", "--teacher", args.teacher, "--keep", args.keep,
                   "--inits", args.inits, "--data", str(runs / "instruct"), "--mix-data", str(pool), *RECIPE,
                   "--tokens", str(args.tokens), "--eval-every", str(args.eval_every), "--eval-early",
                   str(args.eval_early), "--warmup", args.warmup, "--tasks", args.tasks, "--out", str(work),
                   "--save-every", str(args.save_every), "--micro-batch", str(args.micro_batch), "--kl-chunk",
                   str(args.kl_chunk), "--compile", args.compile,
                   "--max-minutes", f"{minutes:.1f}", "--no-progress", *args.recover_args.split()]
            if Path(f"{work}.partial").is_dir():
                cmd.append("--resume")
            run(cmd, "recover.log")
        pack_results(runs, out / "coder-gpu.tgz")
    return 0


def detach(args, argv: list[str]) -> int:
    """Copy the code to JOB/code, stage what was carried (here, while the carried folders exist), and start the
    other steps from the copy in a session of their own; return at once with the job's pid."""
    job = Path(args.job_dir)
    pid_file = job / "job.pid"
    if alive(pid_file):
        print(f"a job already runs (pid {pid_file.read_text().strip()}); watch it with --watch", flush=True)
        return 1
    code = job / "code"
    for name in CODE:
        if (code / name).exists():
            shutil.rmtree(code / name)
        shutil.copytree(ROOT / name, code / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
    rest = [x for x in argv if x not in ("--detach",)]
    steps = [x.strip() for x in args.steps.split(",") if x.strip()]
    if "stage" in steps:  # in the foreground: the carried folders are the work tree's, laid anew by the next call
        rc = main([*strip_flag(rest, "--steps"), "--steps", "stage"])
        if rc:
            return rc
        steps.remove("stage")
    if args.instruct_samples:  # the samples file may lie in the work tree too
        src = Path(args.instruct_samples)
        kept = job / "inputs" / src.name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, kept)
        rest = [*strip_flag(rest, "--instruct-samples"), "--instruct-samples", str(kept)]
    if not steps:
        return 0
    cmd = [sys.executable, str(code / "bench" / "coder_gpu.py"), *strip_flag(rest, "--steps"),
           "--steps", ",".join(steps)]
    with open(job / "job.log", "a") as log:
        log.write(f"=== started {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
        log.flush()
        p = subprocess.Popen(cmd, cwd=job, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pid_file.write_text(f"{p.pid}\n")
    print(f"started pid {p.pid} (steps {','.join(steps)}); code {code}; log {job / 'job.log'}; "
          f"watch with: python bench/coder_gpu.py --watch --job-dir {job} --runs {args.runs}", flush=True)
    return 0


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (either spelling: ``--f v`` or ``--f=v``)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x == flag:
            skip = True
            continue
        if x.startswith(flag + "="):
            continue
        out.append(x)
    return out


def alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    try:  # a finished child not yet reaped is a zombie: not running
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def curve_rows(runs: Path) -> list[str]:
    """Every recovery curve row so far, one line each, with the seconds of each point (timing.csv)."""
    lines = []
    for curve in sorted((runs).glob("recover*/*/curve.csv")):
        init = curve.parent.name.removesuffix(".partial")
        rows = list(csv.DictReader(curve.open()))
        timing = {}
        if (curve.parent / "timing.csv").is_file():
            timing = {r["tokens"]: r for r in csv.DictReader((curve.parent / "timing.csv").open())}
        for r in rows:
            scores = " ".join(f"{k}={float(v):.3f}" for k, v in r.items()
                              if k not in ("tokens", "step", "train_loss", "lr", "elapsed_s") and v not in ("", None))
            t = timing.get(r["tokens"], {})
            took = " ".join(f"{k}={v}" for k, v in t.items() if k not in ("tokens", "step") and v)
            lines.append(f"{init:>17} {int(r['tokens']):>10,} {scores}  [s: {took}]")
    return lines


def watch(args) -> int:
    """The detached job's state in a few seconds: alive, the log's tail, every curve row; tables copied to OUT."""
    job, runs, out = Path(args.job_dir), Path(args.runs), Path(args.out)
    running = alive(job / "job.pid")
    print(f"job {'RUNNING' if running else 'not running'} ({job})", flush=True)
    for log in [job / "job.log", *sorted((runs / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime)[-1:]]:
        if log.is_file():
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if "it/s]" not in ln
                     and "s/it]" not in ln]
            print(f"--- {log} (last {args.tail} lines)")
            print("\n".join(ln[:300] for ln in lines[-args.tail:]))
    rows = curve_rows(runs)
    print(f"--- curve rows so far ({len(rows)})")
    print("\n".join(rows) if rows else "(none yet)")
    out.mkdir(parents=True, exist_ok=True)
    if runs.is_dir():
        pack_results(runs, out / "coder-gpu.tgz")
        for f in [*runs.glob("recover*/*/curve.csv"), *runs.glob("recover*/*/timing.csv"),
                  *runs.glob("recover*/*.md"), *runs.glob("recover*/*.json"), *runs.glob("*.json")]:
            dest = out / "tables" / f.relative_to(runs)
            try:
                if f.stat().st_size < 4 << 20 and "checkpoint" not in f.parts:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, dest)
            except OSError:  # replaced by the running job meanwhile
                pass
    if (job / "job.log").is_file():
        shutil.copyfile(job / "job.log", out / "job.log")
    return 0


def pack_results(runs: Path, archive: Path) -> None:
    """The small files of every step (logs, speed JSON, the instruct set's report, the recovery's curves, reports,
    tables and plots), not weights, checkpoints or token arrays."""
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tf:
        for p in sorted(runs.rglob("*")):
            if p.suffix not in (".csv", ".md", ".json", ".png", ".log", ".txt") \
                    or any(".converted" in x or "checkpoint" in x or x == "compile-cache" for x in p.parts):
                continue
            try:
                if p.is_file() and p.stat().st_size < 4 << 20:
                    tf.add(p, arcname=str(p.relative_to(runs)))
            except OSError:  # replaced by the running job meanwhile (a rename): its next pack holds it
                pass
    tmp.replace(archive)


if __name__ == "__main__":
    sys.exit(main())
