"""What a conversion costs: wall time and resident memory over time of `tcal convert`, per teacher.

Each teacher is converted by the CLI in a process of its own (the command a user runs, default flags unless
--args says otherwise); this script samples that process's resident memory every --every seconds and reads the
report tcal writes (time per stage, the peak after each part). Out: one JSON per teacher and a plot of memory
against time with the stages shaded.

    python bench/convert_cost.py --teachers smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b --out DIR

Time it with no other process on the machine: the numbers are the wall time of that machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

# the report's stage timings in the order they run (tcal.recipes.convert), and what each is called in the plot
STAGES = [("load_teacher_s", "load teacher"), ("tokenise_s", "tokenise"), ("select_s", "select layers"),
          ("build_s", "build hybrid"), ("phase1_s", "statistics + Phase 1"), ("phase2_s", "Phase 2"),
          ("kl_stage_s", "KL stage")]


def sample(cmd: list[str], every: float) -> tuple[int, list[tuple[float, float]], float]:
    """Run ``cmd``; (exit status, [(seconds, resident GiB)] of it and its children, wall seconds)."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    ps = psutil.Process(proc.pid)
    trace = []
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            trace.append((time.perf_counter() - t0, rss / 2**30))
        except psutil.Error:
            pass
        time.sleep(every)
    return proc.returncode, trace, time.perf_counter() - t0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.8 * len(results)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        t, gib = zip(*r["rss_trace"]) if r["rss_trace"] else ((), ())
        ax.plot(t, gib, lw=1.2)
        start = 0.0
        for k, (key, label) in enumerate(STAGES):
            span = r["timings"].get(key)
            if not span:
                continue
            ax.axvspan(start, start + span, alpha=0.12, color=f"C{k % 10}", label=label)
            start += span
        ax.set_title(f"{name}: {r['wall_s']:.0f} s, peak {r['peak_rss_gib']:.2f} GiB resident", fontsize=10)
        ax.set_xlabel("seconds")
        ax.set_ylabel("resident GiB")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teachers", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--args", default="", help="more tcal convert flags, the same for every teacher")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between memory samples")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in [t.strip() for t in a.teachers.split(",") if t.strip()]:
        work = out / f"hybrid-{name}"
        shutil.rmtree(work, ignore_errors=True)
        cmd = [sys.executable, "-m", "tcal", "convert", "--teacher", name, "--no-progress", "--out", str(work),
               *a.args.split()]
        code, trace, wall = sample(cmd, a.every)
        report = json.loads((work / "report.json").read_text()) if code == 0 else {}
        results[name] = {"command": " ".join(["tcal", *cmd[3:]]), "exit": code, "wall_s": wall,
                         "peak_rss_gib": max((g for _, g in trace), default=0.0), "rss_trace": trace,
                         "timings": report.get("timings", {}), "peak_memory": report.get("peak_memory"),
                         "eval": {m: {d: r["ppl"] for d, r in by.items()} for m, by in report.get("eval", {}).items()},
                         "layer_types": report.get("layer_types")}
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=1) + "\n")
        print(f"{name}: exit {code}, {wall:.0f} s, peak {results[name]['peak_rss_gib']:.2f} GiB", flush=True)
        shutil.rmtree(work, ignore_errors=True)  # the hybrid itself is not what is measured
    plot(results, out / "convert_cost.png")


if __name__ == "__main__":
    main()
