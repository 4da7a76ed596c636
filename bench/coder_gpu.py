"""The Qwen2.5-Coder GPU experiment in one command: stage what was carried, check and time the GDN training path,
build the instruct set, recover each init on it, and copy the tables out. Every step keeps its work in --runs and
skips what is done, so a job cut by its wall-time limit resumes by running the same command again.

    python bench/coder_gpu.py --minutes 40                       # all steps, within 40 minutes of this job
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
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("stage", "speed", "instruct", "recover")
# the recovery recipe of docs/results.md (*Recovery judged by the answers*): attention kept by answer:50%
RECIPE = ["--seq-len", "1024", "--batch-size", "16", "--micro-batch", "8", "--mix-frac", "0.25",
          "--eval", "code:eval", "--eval-windows", "8", "--align-steps", "200", "--kl-steps", "100",
          "--kl-data", "chat:code:calib", "--allow-code-execution"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--minutes", type=float, required=True, help="wall time this job may use, all steps together")
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
    ap.add_argument("--tokens", type=int, default=4_800_000)
    ap.add_argument("--eval-every", type=int, default=2_400_000)
    ap.add_argument("--eval-early", type=int, default=3, help="extra points at eval-every/2, /4, ...")
    ap.add_argument("--warmup", default="12000", help="recover --warmup (tokens): the same warm-up at any budget")
    ap.add_argument("--tasks", default="humaneval:164,passkey:10@512,1024,2048,4096,8192")
    ap.add_argument("--recover-args", default="", help="more tcal recover arguments")
    args = ap.parse_args(argv)
    deadline = time.time() + args.minutes * 60
    runs, out, stage_dir = Path(args.runs), Path(args.out), Path(args.stage_dir)
    logs = runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(stage_dir / "site"), str(ROOT / "src"), str(ROOT / "tests")]))

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
                     "--micro-batch", "8", "--kl-chunk", "1024", "--steps", "12", "--warmup", "4"]
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
                   "--max-minutes", f"{minutes:.1f}", "--no-progress", *args.recover_args.split()]
            if Path(f"{work}.partial").is_dir():
                cmd.append("--resume")
            run(cmd, "recover.log")
        pack_results(runs, out / "coder-gpu.tgz")
    return 0


def pack_results(runs: Path, archive: Path) -> None:
    """The small files of every step (logs, speed JSON, the instruct set's report, the recovery's curves, reports,
    tables and plots), not weights, checkpoints or token arrays."""
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tf:
        for p in sorted(runs.rglob("*")):
            if p.is_file() and p.suffix in (".csv", ".md", ".json", ".png", ".log", ".txt") \
                    and p.stat().st_size < 4 << 20 and not any(".converted" in x or "checkpoint" in x for x in p.parts):
                tf.add(p, arcname=str(p.relative_to(runs)))
    tmp.replace(archive)


if __name__ == "__main__":
    sys.exit(main())
