"""How much text the disjointness check finds shared between calibration / training text and evaluation text, and
what the check costs (tcal.data.overlap; docs/data.md, *Disjointness check*).

    python bench/eval_overlap.py --ngrams 8,13,20 --json OUT.json --md OUT.md \
        [--pool-sources sotu,brown,python-doc,postgres-doc,linux-doc --pool-texts DIR] [--python-packages numpy,...]

For each n (words per n-gram), every built-in calibration split, the default pool's sources and Python packages
split like the built-ins (sha1 of the file path, 80 % / 20 %: what a code corpus's calibration split shares with its
evaluation split) against every built-in evaluation split and the package's own evaluation half: the share of the
data's distinct n-grams found in the evaluation text, and the share of the evaluation text's found in the data.
Also three files that hold evaluation text: all of wiki:eval, half of it, and wiki:calib with a tenth of wiki:eval
added. Then the cost at the n the check uses: hashing rate per corpus, and the check a command makes on the default
calibration text, in a cache without the check's entries (first run) and with them (every later run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tcal.data import overlap as O  # noqa: E402
from tcal.data.corpora import BUILTIN_CORPORA, load_corpus, split_of  # noqa: E402
from tcal.utils.command_config import DEFAULT_CALIB  # noqa: E402


def python_package(name: str) -> dict[str, list[str]]:
    import importlib.util

    root = Path(list(importlib.util.find_spec(name).submodule_search_locations)[0])  # found, not imported
    out: dict[str, list[str]] = {"calib": [], "eval": []}
    for p in sorted(root.rglob("*.py")):
        out[split_of(p.relative_to(root).as_posix())].append(p.read_text(errors="replace"))
    return out


def pool_source(name: str, keep: Path | None) -> list[str]:
    """A pool source's documents, fetched, or read from ``keep`` where an earlier run wrote them (so that a timed
    run reads no network)."""
    from tcal.data.pool_sources import resolve_source

    saved = keep / f"{name}.json" if keep else None
    if saved and saved.is_file():
        return json.loads(saved.read_text())
    _, docs, _ = resolve_source(name, None)
    out = [d for d in docs() if d.strip()]
    if saved:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(out))
    return out


def chars(docs) -> int:
    return sum(len(d) for d in docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ngrams", default="8,13,20")
    ap.add_argument("--pool-sources", default="")
    ap.add_argument("--pool-texts", default="", help="folder that keeps the pool sources' text between runs")
    ap.add_argument("--python-packages", default="")
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    ns = [int(x) for x in args.ngrams.split(",")]

    evals = {name: load_corpus(name).documents for name in BUILTIN_CORPORA if name.endswith(":eval")}
    data = {name: load_corpus(name).documents for name in BUILTIN_CORPORA if name.endswith(":calib")}
    wiki_eval = evals["wiki:eval"]
    data["file: all of wiki:eval"] = ["\n\n".join(wiki_eval)]
    data["file: half of wiki:eval"] = ["\n\n".join(wiki_eval[: len(wiki_eval) // 2])]
    data["wiki:calib + a tenth of wiki:eval"] = data["wiki:calib"] + wiki_eval[: len(wiki_eval) // 10]
    for s in filter(None, args.pool_sources.split(",")):
        data[f"pool source {s}"] = pool_source(s, Path(args.pool_texts) if args.pool_texts else None)
    own_eval = {}  # a package's calibration half against its own evaluation half
    for pkg in filter(None, args.python_packages.split(",")):
        halves = python_package(pkg)
        data[f"python {pkg}:calib"] = halves["calib"]
        own_eval[f"python {pkg}:calib"] = (f"python {pkg}:eval", halves["eval"])

    result = {"hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "check_n": O.NGRAM, "max_share": O.MAX_SHARE,
              "sizes": {k: {"documents": len(v), "chars": chars(v)} for k, v in {**data, **evals}.items()},
              "shares": {}, "hash_seconds": {}}
    for n in ns:
        hashed = {}
        for name, docs in {**data, **evals, **{e: d for e, d in own_eval.values()}}.items():
            t0 = time.perf_counter()
            hashed[name] = O.ngram_hashes(docs, n)
            if n == O.NGRAM:
                result["hash_seconds"][name] = time.perf_counter() - t0
        rows = {}
        for name in data:
            against = list(evals) + ([own_eval[name][0]] if name in own_eval else [])
            rows[name] = {}
            for e in against:
                shared = O.shared_count(hashed[name], hashed[e])
                rows[name][e] = [shared / max(len(hashed[name]), 1), shared / max(len(hashed[e]), 1)]
        result["shares"][n] = rows
        print(f"n={n} done", flush=True)

    # the check as a command makes it, on the default calibration text against wiki:eval: a fresh tcal cache that
    # holds the built-in packages but no check entries, then the same cache again in a "new process" (memos cleared)
    real = Path(os.environ.get("TCAL_CACHE") or Path.home() / ".cache" / "tcal").expanduser()
    with tempfile.TemporaryDirectory() as tmp:
        for sub in ("pypi", "npm"):
            if (real / sub).is_dir():
                os.symlink(real / sub, Path(tmp) / sub)
        os.environ["TCAL_CACHE"] = tmp
        timings = []
        for _ in range(2):
            O._RESULTS.clear()
            O._HASHES.clear()
            O._BUILTIN.clear()
            t0 = time.perf_counter()
            O.check_no_eval_text(DEFAULT_CALIB, ["wiki:eval"], role="calibration data")
            timings.append(time.perf_counter() - t0)
        entries = sum(p.stat().st_size for p in (Path(tmp) / "overlap").rglob("*") if p.is_file())
    result["default_check_seconds"] = {"first": timings[0], "cached": timings[1], "cache_bytes": entries}

    lines = [f"# Evaluation-text overlap ({result['hardware']}, Python {result['python']})", ""]
    for n, rows in result["shares"].items():
        cols = list(evals)
        lines += [f"## n = {n} words: share of the data's n-grams / of the evaluation text's", "",
                  "| data | " + " | ".join(cols) + " | own evaluation half |", "|---|" + "---:|" * (len(cols) + 1)]
        for name, by in rows.items():
            cells = [f"{100 * by[c][0]:.3f} / {100 * by[c][1]:.3f}" for c in cols]
            own = next((f"{100 * v[0]:.3f} / {100 * v[1]:.3f}" for e, v in by.items() if e not in cols), "")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {own} |")
        lines.append("")
    lines += [f"## Cost at n = {O.NGRAM}", "", "| text | M chars | hashing s | M chars / s |", "|---|---:|---:|---:|"]
    for name, s in result["hash_seconds"].items():
        c = chars({**data, **evals, **{e: d for e, d in own_eval.values()}}[name]) / 1e6
        lines.append(f"| {name} | {c:.2f} | {s:.2f} | {c / s:.1f} |")
    d = result["default_check_seconds"]
    lines += ["", f"Check of `{DEFAULT_CALIB}` against `wiki:eval` and every built-in evaluation split: "
                  f"{d['first']:.2f} s the first time (cache entries {d['cache_bytes'] / 2**20:.1f} MiB), "
                  f"{d['cached']:.2f} s cached.", ""]
    Path(args.md).write_text("\n".join(lines))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
