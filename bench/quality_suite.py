"""One process, every quality axis, for a list of models: held-out PPL on several domains, RULER-style
retrieval and the offline lm-evaluation-harness tasks.

    python bench/quality_suite.py --models teacher=smollm2-135m,taylor=runs/recover/taylor \
        --ppl wiki:eval,shakespeare:eval,sotu:eval --ppl-windows 32 \
        --niah single,multikey,multivalue,vt --lengths 512,1024,2048,4096 --samples 12 \
        --lm-eval tcal_lastword,tcal_cloze --lm-eval-limit 200 --out runs/quality

Each model loads once (``tcal eval`` would load it once per axis). Every model is scored on the very
same prompts and windows (same seed, same tokenizer). Results: OUT/quality.json (every cell and its
wall time, rewritten after each cell so a killed run keeps what it finished; a rerun skips finished
cells) and OUT/quality.md (tables). Data roles: the PPL domains are evaluation splits; the retrieval
haystack (``--haystack``, default sotu:eval) and the lm-eval source (shakespeare:eval) are read by
nothing that calibrates or trains.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from tcal.data.teachers import load_teacher
from tcal.evaluate import perplexity_report
from tcal.evaluate.tasks.niah.ruler import accuracy_interval, check_lengths, niah_cell
from tcal.utils.atomic import write_json
from tcal.utils.runtime import resolve_device, resolve_dtype


def _models(spec: str) -> list[tuple[str, str]]:
    pairs = []
    for part in spec.split(","):
        name, _, path = part.partition("=")
        pairs.append((name.strip(), (path or name).strip()))
    return pairs


def _cells(args):
    ppl = [d for d in args.ppl.split(",") if d]
    tasks = [t for t in args.niah.split(",") if t]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    lm = [t for t in args.lm_eval.split(",") if t]
    return ppl, tasks, lengths, lm


def run_model(name, path, args, state, save):
    ppl, tasks, lengths, lm_tasks = _cells(args)
    done = state.setdefault(name, {"path": path, "ppl": {}, "niah": {}, "lm_eval": {}})
    wanted = ([("ppl", d) for d in ppl] + [("niah", f"{t}@{n}") for t in tasks for n in lengths]
              + [("lm_eval", t) for t in lm_tasks])
    if all(key in done[axis] for axis, key in wanted):
        print(f"{name}: finished earlier", flush=True)
        return
    t0 = time.perf_counter()
    model, tok = load_teacher(path, dtype=resolve_dtype(args.dtype), device=resolve_device(args.device))
    done["load_s"] = time.perf_counter() - t0
    for d in ppl:
        if d in done["ppl"]:
            continue
        rep = perplexity_report(model, tok, d, window=512, windows=args.ppl_windows, progress=False)
        done["ppl"][d] = {"ppl": rep["ppl"], "seconds": rep["seconds"], "windows": args.ppl_windows, "window": 512}
        print(f"{name} ppl {d}: {rep['ppl']:.3f}", flush=True)
        save()
    for n in check_lengths(model, lengths) if tasks else []:
        for t in tasks:
            key = f"{t}@{n}"
            if key in done["niah"]:
                continue
            done["niah"][key] = niah_cell(model, tok, task=t, length=n, samples=args.samples, seed=args.seed,
                                          haystack=args.haystack, batch_size=args.batch_size)
            print(f"{name} {key}: {done['niah'][key]['accuracy']:.2f} ({done['niah'][key]['seconds']:.1f} s)", flush=True)
            save()
    if lm_tasks:
        try:
            from tcal.evaluate.tasks.lm_eval.harness import harness_lm, plan, run_task

            logging.getLogger("lm_eval").setLevel(logging.WARNING)
            hp = plan(lm_tasks, limit=args.lm_eval_limit, seed=args.seed)
            lm = harness_lm(model, tok, batch_size=args.batch_size)
            for t in lm_tasks:
                if t in done["lm_eval"]:
                    continue
                res = run_task(lm, hp, t)
                done["lm_eval"][t] = {"rows": res["rows"], "seconds": res["seconds"]}
                print(f"{name} {t}: " + ", ".join(f"{r['metric']} {r['value']:.4g}" for r in res["rows"]
                                                  if r["value"] is not None), flush=True)
                save()
        except Exception as e:  # the harness is an optional extra: keep the other axes
            done["lm_eval_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            print(f"{name} lm-eval failed: {done['lm_eval_error']}", flush=True)
            save()
    done["seconds"] = time.perf_counter() - t0
    save()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def markdown(state, args) -> str:
    ppl, tasks, lengths, lm_tasks = _cells(args)
    names = list(state)
    lines = []
    if ppl:
        lines += ["| model | " + " | ".join(ppl) + " |", "|---|" + "---:|" * len(ppl)]
        for m in names:
            lines.append(f"| {m} | " + " | ".join(f"{state[m]['ppl'][d]['ppl']:.2f}" if d in state[m]["ppl"] else "-"
                                                 for d in ppl) + " |")
        lines.append("")
    for t in tasks:
        lines += [f"**{t}** (accuracy, {args.samples} prompts per length)", "",
                  "| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for m in names:
            cells = [state[m]["niah"].get(f"{t}@{n}") for n in lengths]
            lines.append(f"| {m} | " + " | ".join(f"{c['accuracy']:.2f}" if c else "-" for c in cells) + " |")
        lines.append("")
    if tasks:
        n = args.samples
        k = round(0.9 * n)
        lo, hi = accuracy_interval([1.0] * k + [0.0] * (n - k))
        lines += [f"One prompt is {1 / n:.2f} of a cell: over {n} prompts the 95 % interval (Wilson) of {k}/{n} is "
                  f"{lo:.2f}-{hi:.2f}; each cell's own interval is in quality.json", ""]
    if lm_tasks:
        lines += ["| model | task | metric | value | stderr |", "|---|---|---|---:|---:|"]
        for m in names:
            for t in lm_tasks:
                for r in state[m]["lm_eval"].get(t, {}).get("rows", []):
                    v, s = r.get("value"), r.get("stderr")
                    lines.append(f"| {m} | {t} | {r['metric']} | {'-' if v is None else f'{v:.4f}'} | "
                                 f"{'-' if s is None else f'{s:.4f}'} |")
        lines.append("")
    lines.append("wall time per model (s): " + ", ".join(f"{m} {state[m].get('seconds', 0):.0f}" for m in names))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", required=True, help="name=path-or-spec, comma-separated")
    p.add_argument("--ppl", default="wiki:eval,shakespeare:eval,sotu:eval")
    p.add_argument("--ppl-windows", type=int, default=32)
    p.add_argument("--niah", default="single,multikey,multivalue,vt")
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--haystack", default="sotu:eval")
    p.add_argument("--lm-eval", default="tcal_lastword,tcal_cloze")
    p.add_argument("--lm-eval-limit", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f = out / "quality.json"
    state = json.loads(f.read_text())["models"] if f.is_file() else {}

    def save():
        write_json(f, {"settings": vars(args), "models": state})
        (out / "quality.md").write_text(markdown(state, args))

    t0 = time.perf_counter()
    for name, path in _models(args.models):
        try:
            run_model(name, path, args, state, save)
        except Exception as e:  # one model that fails to load must not lose the others
            state.setdefault(name, {"path": path, "ppl": {}, "niah": {}, "lm_eval": {}})["error"] = \
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            print(f"{name}: {state[name]['error']}", flush=True)
        save()
    print(markdown(state, args))
    print(f"suite wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
