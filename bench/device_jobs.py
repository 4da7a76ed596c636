"""tcal's GPU jobs on a machine without network (docs/airgap.md), one named step each: `bash scripts/device_session.sh
STEP...` runs this with the stage folder and the output folder set.

Each step runs tcal commands (`tcal eval`, `convert`, `ablate`, `distill`, `bench`, `airgap`) or the benchmarks of
bench/, as its user would type them. What a step needs of the teacher (its name, whether it is a code model, its
held-out domains) comes from tcal's teacher table; nothing here names a teacher. A command's stdout (what it
reports) is shown and kept, its stderr (progress, logging) goes to OUT/logs/STEP.log. Runs that outlive one job
(converted hybrids, distillations) are kept in RUNS (default STAGE/runs) and resume when their step is run again.

Settings, from the environment (each step's help says which it reads):
  TEACHER   the built-in teacher the steps convert (default: tcal's default teacher); its token pool is the one
            packed as --pool TEACHER=DIR (staged in STAGE/pools/TEACHER); SHAPE (default TEACHER) names its
            tcal.models.shapes shape
  CALL_S    the wall-time limit of this job in seconds (a little below the cluster's own): a step that cannot finish
            its next part in what is left does not start it, and a distillation trains for what is left
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    """One job on the GPU machine: where things are, what is left of its wall time, and how commands run."""

    stage: Path
    out: Path
    runs: Path
    env: dict = field(default_factory=lambda: dict(os.environ))
    t0: float = field(default_factory=time.time)
    step: str = ""

    def get(self, name: str, default: str = "") -> str:
        return self.env.get(name) or default

    @property
    def teacher(self) -> str:
        from tcal.utils.command_config import DEFAULT_TEACHER

        return self.get("TEACHER", DEFAULT_TEACHER)

    @property
    def pool(self) -> Path:
        return self.stage / "pools" / self.teacher

    @property
    def shape(self) -> str:
        return self.get("SHAPE", self.teacher)

    def left(self) -> float:
        """Seconds left of CALL_S (a day without it)."""
        return float(self.get("CALL_S", "100000")) - (time.time() - self.t0)

    def minutes_left(self, reserve: float, cap: str = "") -> float | None:
        """The minutes of CALL_S left once ``reserve`` seconds are kept back, at most ``cap``; None below one."""
        m = min(float(cap or 1e9), (self.left() - reserve) / 60)
        return round(m, 2) if m >= 1 else None

    def enough(self, seconds: float, what: str) -> bool:
        """Whether ``seconds`` of CALL_S are left to start ``what``; says so when not."""
        if self.left() >= seconds:
            return True
        print(f"{self.step}: {self.left():.0f} s left of CALL_S, {what} not started")
        return False

    def run(self, *argv, env: dict | None = None, timeout: float | None = None, check: bool = False) -> int:
        """Run a command: its stdout shown and logged, its stderr logged (OUT/logs/STEP.log). Returns its status."""
        argv = [str(a) for a in argv]
        log = self.out / "logs" / f"{self.step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"$ {' '.join(argv)}", flush=True)
        t0 = time.time()
        with open(log, "a") as err:
            err.write(f"$ {' '.join(argv)}\n")
            err.flush()
            try:
                done = subprocess.run(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                      stderr=err, text=True, timeout=timeout)
                status, text = done.returncode, done.stdout
            except subprocess.TimeoutExpired as e:
                status, text = 124, (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
        sys.stdout.write(text)
        with open(log, "a") as f:
            f.write(text)
        if status:
            print(f"{self.step}: exit {status} after {time.time() - t0:.0f} s; see {log}")
        if status and check:
            raise SystemExit(status)
        return status

    def tcal(self, *argv, **kw) -> int:
        """A tcal command, its progress bars off (a group's subcommands have none)."""
        quiet = [] if argv[0] == "airgap" else ["--no-progress"]
        return self.run(sys.executable, "-m", "tcal", *argv, *quiet, **kw)

    def start(self, argv: list, log: Path, env: dict | None = None) -> subprocess.Popen:
        """A command left running (its output in ``log``): the sweep's workers share the GPU."""
        out = open(log, "w")
        proc = subprocess.Popen([str(a) for a in argv], cwd=ROOT, env={**self.env, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT)
        out.close()  # the child holds its own copy
        return proc

    def bench(self, script: str, *argv, **kw) -> int:
        return self.run(sys.executable, f"bench/{script}", *argv, **kw)

    def pack(self, src: Path, name: str) -> None:
        """SRC's reports, curves and retrieval results (no weights, no unfinished runs) as OUT/NAME.tgz."""
        def keep(info):
            return None if info.name.endswith(".safetensors") or ".partial" in info.name else info

        if src.is_dir():
            with tarfile.open(self.out / f"{name}.tgz", "w:gz") as tar:
                tar.add(src, arcname=".", filter=keep)


# -- what the steps share -----------------------------------------------------------------------------------------

def teacher_facts(teacher: str) -> tuple[bool, list[str]]:
    """(a code model, its held-out domains) from tcal's teacher table."""
    from tcal.data.teacher_table import TEACHERS, default_eval

    return TEACHERS[teacher].code, list(default_eval(teacher))


def need_teacher(job: Job) -> None:
    """A machine that has not been staged cannot fetch the teacher: one line instead of a download traceback."""
    if job.tcal("airgap", "check", "--teacher", job.teacher):
        print(f"{job.step}: not run", file=sys.stderr)
        raise SystemExit(3)


def need_pool(job: Job) -> None:
    if not (job.pool / "manifest.json").is_file():
        print(f"{job.step}: no token pool of {job.teacher} is staged ({job.pool}): pack one with tcal airgap pack "
              f"--pool {job.teacher}=DIR", file=sys.stderr)
        raise SystemExit(3)


def cuda_tests(log: Path, *tests: str, cwd: Path = ROOT) -> int:
    """pytest on ``tests``, its whole output in ``log``: 4 where a named test file does not exist, 1 where pytest
    fails or no test passed (on a machine without CUDA or fla every one of these skips, which is not a check)."""
    for t in tests:
        if t.startswith("tests/") and not (cwd / t.split("::")[0]).exists():
            print(f"check: {t.split('::')[0]} does not exist; name the tests that do", file=sys.stderr)
            return 4
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider", *tests],
                            cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    lines = log.read_text().splitlines()
    print("\n".join(line for line in lines if re.search(r"fla chunk|torch chunk|passed|failed|Error|SKIP", line)))
    summary = lines[-1] if lines else ""
    if rc != 0 or not re.search(r"[1-9][0-9]* passed", summary):
        print(f"check: the CUDA tests did not run and pass (pytest exit {rc}: {summary}); see {log}", file=sys.stderr)
        return 1
    return 0


def passkey(job: Job, model, out: Path, lengths: str, samples: str) -> None:
    """tcal eval's single-needle retrieval (seed 0) of a hybrid or teacher."""
    job.tcal("eval", model, "--tasks", f"single:{samples}@{lengths}", "--seed", "0", "--device", "cuda", "--out", out)


def humaneval(job: Job, model, out: Path) -> None:
    """HumanEval pass@1 of a hybrid or teacher, every problem in one batch."""
    job.tcal("eval", model, "--tasks", "humaneval", "--allow-code-execution", "--batch-size", "164", "--device", "cuda",
             "--out", out)


def finished(run: Path) -> bool:
    return run.is_dir() and not Path(f"{run}.partial").is_dir()


# -- the steps ----------------------------------------------------------------------------------------------------

def stage(job: Job) -> None:
    """tcal airgap stage (CARRY, default .dev/carry): keep the pieces transferred, join and check every item whose
    pieces are all here, put it where tcal looks; then the versions this machine runs."""
    job.tcal("airgap", "stage", "--carry", job.get("CARRY", ".dev/carry"), "--stage", job.stage, check=True)
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    try:
        import fla
        fla_version = fla.__version__
    except ImportError:
        fla_version = "not installed"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {gpu}, fla {fla_version}")


def check(job: Job) -> None:
    """CUDA tests (fla vs the fp32 loop, chunked PyTorch on CUDA with gradients, distill on CUDA), then
    bench/gdn_ops.py at B=4 T=4096 H=16 D=128 (bf16 and fp32; the fp32 loop forward once)."""
    rc = cuda_tests(job.out / "cuda_tests.log", "tests/ops/test_fla.py",
                    "tests/evaluate/test_perplexity.py::test_cuda_matches_cpu",
                    "tests/train/test_trainer.py::test_distill_on_cuda_bf16_trains_and_resumes")
    if rc:
        raise SystemExit(rc)
    shape = ("--B", 4, "--T", 4096, "--H", 16, "--D", 128)
    for dt in ("bfloat16", "float32"):
        job.bench("gdn_ops.py", *shape, "--dtype", dt, "--impls", "chunk,scan,fla", "--reps", 10, "--json",
                  job.out / f"gdn_ops_{dt}.json")
    job.bench("gdn_ops.py", *shape, "--dtype", "float32", "--impls", "naive", "--no-backward", "--reps", 1,
              "--warmup", 0, "--json", job.out / "gdn_ops_naive.json")


def gputests(job: Job) -> None:
    """The CUDA cases of Phase 2 side by side (the stack's forward on fla, the group fit against each layer alone)."""
    rc = cuda_tests(job.out / "gputests.log", "-k", "cuda", "tests/modules/test_gdn_stack.py",
                    "tests/taylor/test_phase2_concurrent.py")
    if rc:
        raise SystemExit(rc)


def speed(job: Job) -> None:
    """tcal bench at the Qwen2.5-1.5B shape (teacher vs hybrid prefill and decode)."""
    job.tcal("bench", "--model", "qwen2.5-1.5b", "--keep", "uniform:25%", "--contexts", "2048,8192,32768", "--rows",
             "teacher-eager,hybrid-eager", "--out", job.out / "speed")


def distill_speed(job: Job) -> None:
    """bench/distill_speed.py at the teacher's shape (SHAPE): training tokens/s and peak memory."""
    job.bench("distill_speed.py", "--shape", job.shape, "--keep", "0,4,8,12,16,20,24,28", "--seq-len", 1024,
              "--batch-size", 32, "--steps", 8, "--json", job.out / "distill_speed.json")


def sweep(job: Job) -> None:
    """bench/calib_sweep.py on the carried calibration token files (.dev/sweep, .dev/sw or .dev/sn, made by
    `calib_sweep.py tokens`): SWEEP_JOBS (job sets, default methods16), SWEEP_WORKERS processes sharing the GPU
    (default 1: time-slicing CUDA contexts costs these launch-bound fits more than it overlaps), no job started
    after SWEEP_MINUTES (default 6), SWEEP_ARGS; every hybrid saved as RUNS/sweep/<job> for the quality step. Keep
    sets written on this machine (STAGE/NAME.keep: one comma list) join the jobs under their names."""
    import shlex

    tokens = job.stage / "sweep"
    for d in (".dev/sweep", ".dev/sw", ".dev/sn"):
        for f in sorted((ROOT / d).glob("*.npy")):
            tokens.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, tokens / f.name)
    # one process dequantises the GGUF into the teacher cache before the workers all read it
    import tcal

    tcal.load_teacher(job.teacher, device="cpu")
    keep_files = [a for f in sorted(job.stage.glob("*.keep")) for a in ("--keep-file", f"{f.stem}={f}")]
    n = int(job.get("SWEEP_WORKERS", "1"))
    workers = [job.start([sys.executable, "bench/calib_sweep.py", "run", *keep_files, "--tokens", tokens, "--jobs",
                          job.get("SWEEP_JOBS", "methods16"), "--worker", w, "--workers", n, "--deadline-min",
                          job.get("SWEEP_MINUTES", "6"), "--out", job.out / f"sweep-{w}.jsonl", "--save",
                          job.runs / "sweep", *shlex.split(job.get("SWEEP_ARGS"))],
                         job.out / f"sweep-{w}.log", env={"OMP_NUM_THREADS": "2"}) for w in range(n)]
    for proc in workers:
        proc.wait()
    for f in sorted(job.out.glob("sweep-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                ppl = {k: round(v, 2) for k, v in (r.get("ppl") or {}).items()}
                print(r.get("method"), r.get("keep"), r.get("budget"), r.get("calib"), ppl, round(r.get("wall_s", 0)),
                      r.get("error", ""))


def calib_speed(job: Job) -> None:
    """bench/calib_speed.py: Taylor-Calibrate wall time at the Qwen2.5-1.5B shape (random weights), CALIB_LAYERS deep
    (0 = all), CALIB_WINDOWS x 512 tokens, CALIB_INIT; a second run in one job finds the compile caches the first
    filled (calib_speed_0.json, calib_speed_1.json, ...)."""
    n = len(list(job.out.glob("calib_speed_*.json")))
    job.bench("calib_speed.py", "--shape", "qwen2.5-1.5b", "--keep", "uniform:25%", "--windows",
              job.get("CALIB_WINDOWS", "128"), "--window", 512, "--init", job.get("CALIB_INIT", "taylor"),
              "--num-layers", job.get("CALIB_LAYERS", "0"), "--json", job.out / f"calib_speed_{n}.json")


def recover(job: Job) -> None:
    """bench/distill_device.sh, the resumable recovery run (RECOVER_TOKENS, RECOVER_MINUTES, INITS): the job's
    wall-time limit must also hold what --max-minutes cannot pause (loading the teacher, a taylor conversion, the
    last checkpoint and the archive)."""
    job.run("bash", "bench/distill_device.sh", "--data", job.pool, "--tokens", job.get("RECOVER_TOKENS", "20000000"),
            "--minutes", job.get("RECOVER_MINUTES", "6.5"), "--inits", job.get("INITS", "copy,taylor"), "--run",
            job.runs / "recover", "--teacher", job.teacher)


def recover50(job: Job) -> None:
    """The same at 50 % converted (attention at 0,2,...,28): copy vs the paper's recipe vs taylor, one pool, order,
    schedule and budget; both calibrated inits read the same 512 x 512 mixed calibration tokens and go first (a
    conversion cannot pause); --keep-init keeps each init's weights for the quality step."""
    job.run("bash", "bench/distill_device.sh", "--data", job.pool, "--tokens", job.get("RECOVER_TOKENS", "8000000"),
            "--minutes", job.get("RECOVER_MINUTES", "6.5"), "--inits", job.get("INITS", "taylor,taylor-reference,copy"),
            "--run", job.runs / "recover50", "--keep", ",".join(map(str, range(0, 30, 2))), "--calib",
            "wiki:calib+shakespeare:calib", "--calib-windows", 512, "--keep-init", "--teacher", job.teacher)


def quality(job: Job) -> None:
    """bench/quality_suite.py on the teacher and recover50's models, zero-shot (-init) and trained (PPL x 3 domains,
    retrieval, lm-eval); after distill-long, DISTILL_FROM zero-shot and distilled; QUALITY_MODELS (name=path,...)
    replaces the list, QUALITY_ARGS adds flags; skipped with fewer than QUALITY_S (150) seconds of CALL_S left."""
    import shlex

    if not job.enough(float(job.get("QUALITY_S", "150")), "quality"):
        return
    models = [f"teacher={job.teacher}"]
    if job.get("QUALITY_MODELS"):
        models.append(job.get("QUALITY_MODELS"))
    elif job.get("DISTILL_FROM"):
        models.append(f"zero-shot={job.runs / 'sweep' / job.get('DISTILL_FROM')}")
        distilled = job.runs / "distill-long" / (job.get("DISTILL_FROM") + job.get("DISTILL_TAG"))
        if finished(distilled):
            models.append(f"distilled={distilled}")
        else:
            print(f"quality: {distilled} not finished, zero-shot only")
    else:
        r50 = job.runs / "recover50"
        for init in ("copy", "taylor-reference", "phase2", "taylor"):
            models += [f"{name}={r50 / name}" for name in (f"{init}-init", init) if (r50 / name).is_dir()]
    job.bench("quality_suite.py", "--models", ",".join(models), "--device", "cuda", "--out", job.out / "quality",
              *shlex.split(job.get("QUALITY_ARGS")))


def bench(job: Job) -> None:
    """tcal bench at the Llama-3.2-3B shape (random weights, 75 % converted; BENCH_LLAMA=0 skips it), then on
    recover50's trained hybrid (taylor, else taylor-reference, else copy): FastDecoder == eager check, HF generate()
    against FastDecoder.generate."""
    outs = []
    if job.get("BENCH_LLAMA", "1") == "1":
        outs.append(job.out / "bench-llama")
        job.tcal("bench", "--model", "llama-3.2-3b", "--keep", "uniform:25%", "--contexts", "2048,8192,32768", "--rows",
                 "teacher-eager,hybrid-eager,teacher-fast,hybrid-fast", "--batch-sizes", "1,32,max", "--out", outs[-1])
    trained = next((job.runs / "recover50" / i for i in ("taylor", "taylor-reference", "copy")
                    if (job.runs / "recover50" / i).is_dir()), None)
    if trained is not None:
        outs.append(job.out / "bench-trained")
        job.tcal("bench", "--model", trained, "--contexts", "512,2048,4096", "--rows",
                 "teacher-fast,hybrid-eager,hybrid-fast,generate", "--check", "--out", outs[-1])


def shape_bench(job: Job) -> None:
    """tcal bench FastDecoder rows at 8K-32K for each of SHAPES (space-separated, default SHAPE), one hybrid per
    BENCH_KEEPS entry (space-separated NAME=KEEP, default auto=auto)."""
    for shape in job.get("SHAPES", job.shape).split():
        for entry in job.get("BENCH_KEEPS", "auto=auto").split():
            name, _, keep = entry.partition("=")
            job.tcal("bench", "--model", shape, "--keep", keep, "--contexts", "8192,16384,32768", "--rows",
                     "teacher-fast,hybrid-fast", "--batch-sizes", "1,8,32", "--device", "cuda", "--out",
                     job.out / f"bench-{shape}-{name}")


def phase2_ab(job: Job) -> None:
    """Phase 2 at the teacher's shape (random weights, 15 of 30 layers converted, 64 x 512 tokens, 150 steps): one
    layer at a time in fp32, then side by side with TF32 (PHASE2_AB: space-separated "concurrent,tf32" pairs)."""
    for pair in job.get("PHASE2_AB", "off,off on,on").split():
        concurrent, tf32 = pair.split(",")
        result = job.out / "p2ab.json"
        job.bench("calib_speed.py", "--shape", job.shape, "--keep", "uniform:50%", "--windows", 64, "--window", 512,
                  "--steps", 150, "--init", "phase2", "--concurrent", concurrent, "--tf32", tf32, "--json", result,
                  timeout=85)
        if result.is_file():
            r = json.loads(result.read_text())
            print(f"concurrent,tf32={pair}: phase2_s {r.get('phase2_s')}, total_s {r.get('total_s')}")
            with open(job.out / "phase2_ab.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            result.unlink()


def scan_speed(job: Job) -> None:
    """bench/gdn_ops.py at the SmolLM2 head shape, 512 to 4,096 tokens, forward + backward: the chunk loop (eager)
    against the parallel scan over chunks, then the compiled loop, each in a process of its own and last (its
    compile at 4,096 tokens can outrun a short limit and would take the eager rows with it)."""
    cells = ((16, 512), (4, 2048), (1, 4096), (8, 4096))
    for impls, suffix, timeout in (("chunk,scan", "", 90), ("compile", "_compile", 150)):
        for b, t in cells:
            job.bench("gdn_ops.py", "--B", b, "--T", t, "--H", 9, "--D", 64, "--impls", impls, "--reps", 10, "--json",
                      job.out / f"scan_{b}x{t}{suffix}.json", timeout=timeout)


def distill_long(job: Job) -> None:
    """tcal distill of a saved sweep hybrid (DISTILL_FROM, a job name) on DISTILL_SEQ-token sequences of the pool
    (DISTILL_TOKENS, DISTILL_BATCH, DISTILL_EVAL_EVERY, DISTILL_ARGS; DISTILL_TAG names a second run of one hybrid),
    passkey at every curve point (DISTILL_PASSKEY lengths, 20 prompts each); CALL_S or DISTILL_MINUTES bound a job
    (100 s of CALL_S kept for what --max-minutes cannot bound)."""
    import shlex

    hybrid = job.runs / "sweep" / job.get("DISTILL_FROM")
    run = job.runs / "distill-long" / (job.get("DISTILL_FROM") + job.get("DISTILL_TAG"))
    if finished(run):
        print(f"distill-long: {run} is finished")
        return
    minutes = job.get("DISTILL_MINUTES", "4")
    if job.get("CALL_S"):
        minutes = job.minutes_left(100, job.get("DISTILL_MINUTES"))
        if minutes is None:
            print(f"distill-long: {job.left():.0f} s left of CALL_S, too few to start")
            return
    resume = ["--resume"] if Path(f"{run}.partial").is_dir() else []
    job.tcal("distill", hybrid, "--teacher", job.teacher, "--data", job.pool, "--tokens",
             job.get("DISTILL_TOKENS", "4000000"), "--seq-len", job.get("DISTILL_SEQ", "4096"), "--batch-size",
             job.get("DISTILL_BATCH", "8"), "--kl-chunk", 4096, "--eval", "wiki:eval", "--eval-window", 512,
             "--eval-windows", 16, "--eval-every", job.get("DISTILL_EVAL_EVERY", "1000000"), "--max-minutes", minutes,
             "--out", run, "--tasks", f"passkey:20@{job.get('DISTILL_PASSKEY', '1024,2048,4096')}", *resume,
             *shlex.split(job.get("DISTILL_ARGS")))
    for name in ("curve.csv", "report.json", "report.md"):
        if (run / name).is_file():
            shutil.copy2(run / name, job.out / f"distill_long_{name}")


def layout(job: Job) -> None:
    """The qwen3_5 target against the native layout at equal budgets (LAYOUT_BUDGETS, default reference large
    long; LAYOUT_TARGETS, default native qwen3_5): tcal convert with PPL on three held-out domains, then tcal eval's
    passkey at 512-4K (LAYOUT_SAMPLES per length, default 50); a run already done here is skipped, and none starts
    with fewer than LAYOUT_JOB_S (240) seconds of CALL_S left."""
    half = ",".join(map(str, range(0, 30, 2)))
    for budget in job.get("LAYOUT_BUDGETS", "reference large long").split():
        # the long budget was measured on the retrieval set
        keep = "0,1,2,4,7,8,15,16,18,19,20,21,23,24,29" if budget == "long" else half
        for target in job.get("LAYOUT_TARGETS", "native qwen3_5").split():
            run = job.runs / "layout" / f"{budget}-{target}"
            if not (run / "report.json").is_file():
                if not job.enough(float(job.get("LAYOUT_JOB_S", "240")), f"{budget}-{target}"):
                    return job.pack(job.runs / "layout", "layout")
                job.tcal("convert", "--teacher", job.teacher, "--keep", keep, "--calib-budget", budget, "--target",
                         target, "--eval", "wiki:eval,shakespeare:eval,sotu:eval", "--device", "cuda", "--out", run)
            niah = Path(f"{run}-niah")
            if (run / "report.json").is_file() and not (niah / "niah.json").is_file():
                if not job.enough(100, f"the passkey of {budget}-{target}"):
                    return job.pack(job.runs / "layout", "layout")
                passkey(job, run, niah, "512,1024,2048,4096", job.get("LAYOUT_SAMPLES", "50"))
    job.pack(job.runs / "layout", "layout")


def teacher(job: Job) -> None:
    """TEACHER on the GPU, each part skipped once this machine has it: the teacher's passkey at 512-8K (and
    HumanEval pass@1 for a code teacher), the zero-shot ablation at the CPU default protocol for each of
    ABLATE_KEEPS (space-separated, default auto; ABLATE=0 skips it; ABLATE_S seconds needed), then its conversions
    (JOBS: space-separated NAME/KEEP/INIT/BUDGET, default taylor-large/auto/taylor/large; JOB_S seconds needed) with
    PPL on its held-out domains (EVAL, default the teacher's own; EVAL_WINDOWS), passkey at 512-8K (SAMPLES per
    length, default 30) and pass@1 for a code teacher."""
    root = job.runs / job.teacher
    root.mkdir(parents=True, exist_ok=True)
    code, domains = teacher_facts(job.teacher)
    ev = job.get("EVAL", ",".join(domains))
    windows = ["--eval-windows", job.get("EVAL_WINDOWS")] if job.get("EVAL_WINDOWS") else []
    lengths, samples = "512,1024,2048,4096,8192", job.get("SAMPLES", "30")
    if code and not (root / "teacher-he" / "humaneval.json").is_file():
        humaneval(job, job.teacher, root / "teacher-he")
    if not (root / "teacher-niah" / "niah.json").is_file():
        passkey(job, job.teacher, root / "teacher-niah", lengths, samples)
    if job.get("ABLATE", "1") == "1":
        for keep in job.get("ABLATE_KEEPS", "auto").split():
            run = root / ("ablate-" + re.sub(r"[^a-z0-9]", "-", keep))
            if (run / "ablation.json").is_file():
                continue
            if not job.enough(float(job.get("ABLATE_S", "300")), f"ablation {keep}"):
                break
            job.tcal("ablate", "--teacher", job.teacher, "--keep", keep, "--calib-budget", "reference", "--align-steps",
                     60, "--kl-steps", 10, "--eval", ev, *windows,
                     *(["--tasks", "humaneval", "--allow-code-execution"] if code else []), "--device", "cuda", "--out",
                     run)
    for entry in job.get("JOBS", "taylor-large/auto/taylor/large").split():
        name, keep, init, budget = entry.split("/")
        run = root / name
        if not (run / "report.json").is_file():
            if not job.enough(float(job.get("JOB_S", "360")), name):
                break
            job.tcal("convert", "--teacher", job.teacher, "--keep", keep, "--init", init, "--calib-budget", budget,
                     "--eval", ev, *windows, "--device", "cuda", "--out", run)
        if (run / "report.json").is_file() and code and not (Path(f"{run}-he") / "humaneval.json").is_file():
            humaneval(job, run, Path(f"{run}-he"))
        if (run / "report.json").is_file() and not (Path(f"{run}-niah") / "niah.json").is_file():
            if not job.enough(60, f"the passkey of {name}"):
                break
            passkey(job, run, Path(f"{run}-niah"), lengths, samples)
    job.pack(root, job.teacher)


def teacher_distill(job: Job) -> None:
    """tcal distill of a teacher job's hybrid (DISTILL_FROM, default taylor-large) on TEACHER's staged pool
    (DISTILL_TOKENS, DISTILL_SEQ, DISTILL_BATCH, DISTILL_EVAL_EVERY, DISTILL_ARGS), scored on its home domain at every
    curve point, resumed across jobs (CALL_S; DISTILL_KEEP_S seconds kept back, default 150); then its passkey at
    512-8K."""
    import shlex

    root = job.runs / job.teacher
    hybrid = root / job.get("DISTILL_FROM", "taylor-large")
    run = Path(f"{hybrid}-distilled")
    if not (hybrid / "report.json").is_file():
        print(f"teacher-distill: no hybrid at {hybrid}: run the teacher step with a JOBS entry of that name",
              file=sys.stderr)
        raise SystemExit(3)
    if not (run / "report.json").is_file() or Path(f"{run}.partial").is_dir():
        minutes = job.minutes_left(float(job.get("DISTILL_KEEP_S", "150")))
        if minutes is None:
            print(f"teacher-distill: {job.left():.0f} s left of CALL_S, too few to start")
            return job.pack(root, job.teacher)
        resume = ["--resume"] if Path(f"{run}.partial").is_dir() else []
        job.tcal("distill", hybrid, "--teacher", job.teacher, "--data", job.pool, "--tokens",
                 job.get("DISTILL_TOKENS", "8000000"), "--seq-len", job.get("DISTILL_SEQ", "4096"), "--batch-size",
                 job.get("DISTILL_BATCH", "8"), "--kl-chunk", 4096, "--eval", teacher_facts(job.teacher)[1][0],
                 "--eval-windows", 16, "--eval-every", job.get("DISTILL_EVAL_EVERY", "4000000"), "--max-minutes",
                 minutes, "--out", run, *resume, *shlex.split(job.get("DISTILL_ARGS")))
    if finished(run) and (run / "report.json").is_file() and not (Path(f"{run}-niah") / "niah.json").is_file():
        passkey(job, run, Path(f"{run}-niah"), "512,1024,2048,4096,8192", job.get("SAMPLES", "30"))
    job.pack(root, job.teacher)


def smoke(job: Job) -> None:
    """bench/fsdp_smoke.py under torchrun with one process: the FSDP2 path on a mesh of one GPU."""
    job.run(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 1, "bench/fsdp_smoke.py")


# name -> (function, needs the teacher staged, needs its pool staged)
STEPS = {
    "stage": (stage, False, False), "check": (check, False, False), "speed": (speed, False, False),
    "distill-speed": (distill_speed, False, False), "sweep": (sweep, True, False),
    "calib-speed": (calib_speed, False, False), "recover": (recover, True, True), "recover50": (recover50, True, True),
    "quality": (quality, True, False), "smoke": (smoke, False, False), "gputests": (gputests, False, False),
    "phase2-ab": (phase2_ab, False, False), "scan-speed": (scan_speed, False, False),
    "distill-long": (distill_long, True, True), "layout": (layout, True, False), "teacher": (teacher, True, False),
    "teacher-distill": (teacher_distill, True, True), "shape-bench": (shape_bench, False, False),
    "bench": (bench, False, False),
}


def main(argv: list[str] | None = None) -> int:
    import textwrap

    steps = "\n".join(textwrap.fill(" ".join((fn.__doc__ or "").split()), 116, initial_indent=f"  {name:16s}",
                                     subsequent_indent=" " * 18) for name, (fn, _, _) in STEPS.items())
    p = argparse.ArgumentParser(description=__doc__, epilog="steps:\n" + steps,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default=os.environ.get("STAGE", "/tmp/tcal-stage"),
                   help="the stage folder tcal airgap stage fills (STAGE)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="what comes back from the machine (OUT)")
    p.add_argument("--runs", default=os.environ.get("RUNS", ""),
                   help="where runs that outlive a job are kept (RUNS; default STAGE/runs)")
    p.add_argument("steps", nargs="*", metavar="STEP", help="steps, in order")
    args = p.parse_args(argv)
    bad = [s for s in args.steps if s not in STEPS]
    if bad:
        print(f"unknown step {bad[0]}; the steps are {', '.join(STEPS)}", file=sys.stderr)
        return 2
    stage_dir = Path(args.stage)
    job = Job(stage_dir, Path(args.out), Path(args.runs) if args.runs else stage_dir / "runs")
    for d in (job.stage, job.out, job.runs):
        d.mkdir(parents=True, exist_ok=True)
    for name in args.steps:
        fn, teacher_needed, pool_needed = STEPS[name]
        job.step = name
        print(f"=== {name} ({time.strftime('%H:%M:%S')})", flush=True)
        try:
            if teacher_needed:
                need_teacher(job)
            if pool_needed:
                need_pool(job)
            fn(job)
        except SystemExit as e:
            return int(e.code or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
