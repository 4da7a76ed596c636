"""The levers of a CPU conversion of a code teacher, each a `tcal convert` line, judged by the answers it writes.

Every variant is one `tcal convert` of the teacher at half converted with the flags a CPU user would type (fp32,
the `medium` budget unless a variant says otherwise), then `tcal eval --tasks humaneval` of the hybrid. On a GPU the
variants run side by side (``--parallel``) and give each lever's answers in minutes; the seconds of each conversion
stage are recorded so that a variant's CPU wall time can be checked against one run on the CPU.

    python bench/coder_levers.py --out runs/levers --parallel 3                  # every variant (a GPU)
    python bench/coder_levers.py --out runs/levers --variants uniform,answer     # some of them
    python bench/coder_levers.py --out /tmp/l --variants uniform --quick         # a smoke test on the CPU
    python bench/coder_levers.py --out /tmp/levers --parallel 2 --detach         # on a GPU machine: runs on, detached

``--detach`` copies src/ and bench/ (without results) to ``--job-dir`` and starts the sweep from that copy in a
session of its own (log: JOB/levers.log), so it outlives the command that started it and a work tree laid anew.

Writes OUT/levers.jsonl (one row per variant, as each finishes: flags, pass@1 with its Wilson interval, code and
wiki PPL, the convert report's stage seconds and KL stage) and OUT/levers.md (the table); each variant's
conversion and HumanEval run stay in OUT/<variant>/ and OUT/<variant>-he/ (resumable: a finished variant is skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tcal.evaluate.tasks.niah.ruler import accuracy_interval

ROOT = Path(__file__).resolve().parents[1]

# The layers the 0.5B coder's answers need most (`--keep answer:50%` on the teacher, scored on 48 code:calib tasks):
# the same set whichever device scores them, and the keep list of bench/coder_gpu.py's recovery.
ANSWER_KEEP = "0,1,5,6,8,10,13,14,15,16,17,20"
CHAT = ["--kl-data", "chat:code:calib"]  # code tasks with their own functions as the answers
OWN = ["--kl-data", "answers"]  # the teacher's own answers that ship with tcal
# in the order they are worth running: the published baseline first (its CPU pass@1 is known), then one lever at a
# time on top of the keep set, then the splits of the minutes a 2-core CPU can afford
VARIANTS: dict[str, list[str]] = {
    "uniform": ["--keep", "uniform:50%"],
    "answer": ["--keep", ANSWER_KEEP],
    "answer-own": ["--keep", ANSWER_KEEP, *OWN],
    "answer-chat": ["--keep", ANSWER_KEEP, *CHAT],
    "answer-nokl": ["--keep", ANSWER_KEEP, "--kl-steps", "0"],
    "uniform-own": ["--keep", "uniform:50%", *OWN],
    "answer-own-p150-kl20": ["--keep", ANSWER_KEEP, *OWN, "--align-steps", "150", "--kl-steps", "20"],
    "answer-p150-kl20": ["--keep", ANSWER_KEEP, "--align-steps", "150", "--kl-steps", "20"],
    "answer-own-w100-kl80": ["--keep", ANSWER_KEEP, *OWN, "--kl-windows", "100", "--kl-steps", "80"],
    "niah": ["--keep", "niah:50%"],
}


def run_variant(name: str, flags: list[str], args, out: Path) -> dict | None:
    conv, he = out / name, out / f"{name}-he"
    log = out / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    py = [sys.executable, "-m", "tcal"]
    with open(log, "a") as f:
        def sh(cmd):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode

        t0 = time.time()
        if not (conv / "report.json").is_file():
            quick = ["--align-steps", "4", "--kl-steps", "2", "--calib-windows", "4", "--calib-window", "64",
                     "--eval-windows", "1"] if args.quick else []
            if sh([*py, "convert", "--teacher", args.teacher, "--calib-budget", args.budget, "--device", args.device,
                   *flags, *quick, "--no-progress", "--out", str(conv)]):
                print(f"{name}: convert failed, see {log}", flush=True)
                return None
        convert_wall = time.time() - t0
        t0 = time.time()
        if not (he / "humaneval.json").is_file():
            if sh([*py, "eval", str(conv), "--tasks", f"humaneval:{args.problems}", "--allow-code-execution",
                   "--device", args.device, "--no-progress", "--out", str(he)]):
                print(f"{name}: humaneval failed, see {log}", flush=True)
                return None
        he_wall = time.time() - t0
    report = json.loads((conv / "report.json").read_text())
    res = json.loads((he / "humaneval.json").read_text())
    passed, n = res.get("passed"), res.get("problems")
    if passed is None:  # older reports: a list of results
        rows = res.get("results", res if isinstance(res, list) else [])
        passed, n = sum(bool(r.get("passed")) for r in rows), len(rows)
    lo, hi = accuracy_interval([1.0] * passed + [0.0] * (n - passed))  # Wilson, as tcal eval reports it
    ev = report.get("eval", {}).get("hybrid", {})
    row = {"variant": name, "flags": " ".join(flags), "passed": passed, "problems": n, "pass@1": passed / max(1, n),
           "wilson95": [round(lo, 3), round(hi, 3)], "ppl": {d: round(r["ppl"], 3) for d, r in ev.items()},
           "teacher_ppl": {d: round(r["ppl"], 3) for d, r in report.get("eval", {}).get("teacher", {}).items()},
           "timings_s": {k: round(v, 1) for k, v in report.get("timings", {}).items()},
           "kl_stage": report.get("kl_stage"), "attention": [i for i, t in enumerate(report["layer_types"])
                                                            if t != "linear_attention"],
           "convert_wall_s": round(convert_wall, 1), "humaneval_wall_s": round(he_wall, 1),
           "device": args.device, "budget": args.budget}
    print(f"{name}: {passed}/{n} pass@1 {passed / max(1, n):.3f} ({lo:.3f}-{hi:.3f}), ppl {row['ppl']}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| variant | flags | pass@1 (Wilson 95 %) | PPL | convert stages (s) |", "|---|---|---:|---|---|"]
    for r in rows:
        t = r["timings_s"]
        stages = ", ".join(f"{k.removesuffix('_s')} {v:.0f}" for k, v in t.items())
        ppl = ", ".join(f"{d} {v:.2f}" for d, v in r["ppl"].items())
        lines.append(f"| {r['variant']} | `{r['flags']}` | {r['pass@1']:.3f} ({r['passed']}/{r['problems']}), "
                     f"{r['wilson95'][0]:.3f}-{r['wilson95'][1]:.3f} | {ppl} | {stages} |")
    return "\n".join(lines) + "\n"


def detach(args, argv: list[str]) -> int:
    """The sweep started from its own copy of the code, in a session of its own: later commands may lay the work tree
    anew (or take it away) while it runs."""
    job = Path(args.job_dir)
    code = job / "code"
    shutil.rmtree(code, ignore_errors=True)
    for d in ("src", "bench"):
        shutil.copytree(ROOT / d, code / d, ignore=shutil.ignore_patterns("results", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(code / "src"), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]))
    with open(job / "levers.log", "a") as log:
        proc = subprocess.Popen([sys.executable, str(code / "bench" / "coder_levers.py"), *argv], cwd=code, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"started pid {proc.pid} from {code}; log {job / 'levers.log'}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--teacher", default="qwen2.5-coder-0.5b")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of: {', '.join(VARIANTS)}")
    ap.add_argument("--budget", default="medium")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--problems", type=int, default=164, help="HumanEval problems, the first N")
    ap.add_argument("--parallel", type=int, default=1, help="variants at once (a GPU holds several)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: a few steps on tiny windows")
    ap.add_argument("--detach", action="store_true", help="start from a copy of the code in --job-dir, detached")
    ap.add_argument("--job-dir", default="/tmp/tcal-levers")
    args = ap.parse_args(argv)
    if args.detach:
        return detach(args, [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--detach"])
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "levers.jsonl"
    done = {json.loads(x)["variant"]: json.loads(x) for x in rows_file.read_text().splitlines()} \
        if rows_file.is_file() else {}
    todo = [n for n in names if n not in done]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        for row in pool.map(lambda n: run_variant(n, VARIANTS[n], args, out), todo):
            if row is not None:
                done[row["variant"]] = row
                with open(rows_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
    rows = [done[n] for n in names if n in done]
    (out / "levers.md").write_text(table(rows))
    print(table(rows))
    return 0 if len(rows) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
