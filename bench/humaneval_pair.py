"""HumanEval outputs side by side: pass@1 of each, and each against the first on the same problems.

    python bench/humaneval_pair.py A/humaneval.json B/humaneval.json [C/humaneval.json ...] [--md OUT.md]

Two runs of one model in two engines should differ only by numerics: how many answers are the same text, how
many problems only one of them passed (answers compared after the stop-sequence cut), and McNemar's exact p-value of that split (tcal.evaluate.tasks.humaneval.problems.paired).
A run scored on fewer problems (``--limit``) is compared on the problems both hold.
"""
import argparse
import json
from pathlib import Path

from tcal.evaluate.tasks.humaneval.problems import Result, cut, paired
from tcal.evaluate.tasks.niah.ruler import accuracy_interval


def load(path: str) -> tuple[dict, dict[str, Result]]:
    rec = json.loads(Path(path).read_text())
    return rec, {r["task_id"]: Result(**r) for r in rec["results"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="humaneval.json files; the first is the reference")
    ap.add_argument("--names", default=None, help="comma-separated labels (default: each file's folder)")
    ap.add_argument("--md", default=None, help="also write the table here")
    args = ap.parse_args()
    names = args.names.split(",") if args.names else [Path(p).parent.name for p in args.runs]
    runs = [load(p) for p in args.runs]
    ref_rec, ref = runs[0]
    lines = ["| run | engine | pass@1 | 95 % interval | vs first: problems | same answer | only first passed | "
             "only this passed | McNemar p |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, (rec, res) in zip(names, runs):
        lo, hi = accuracy_interval([float(r.passed) for r in res.values()])
        common = [t for t in res if t in ref]
        a, b = [ref[t] for t in common], [res[t] for t in common]
        # the program each answer gives: llama.cpp stops before a stop string, tcal's generator just after it
        same = sum(cut(x.completion, ref_rec["prompt_style"]).rstrip() == cut(y.completion, rec["prompt_style"]).rstrip()
                   for x, y in zip(a, b))
        p = paired(a, b)
        lines.append(f"| {name} | {rec['engine']} | {rec['pass@1']:.3f} ({rec['passed']}/{rec['problems']}) | "
                     f"{lo:.3f}-{hi:.3f} | {len(common)} | {same} | {p['only_first']} | {p['only_second']} | "
                     f"{p['mcnemar_p']:.3g} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")


if __name__ == "__main__":
    main()
