"""The `niah:K` policy's layer ranking at several prompt lengths: which layers a teacher's retrieval needs
as its context grows, and whether the K layers kept change with it.

    python bench/niah_rank.py --lengths 2048,4096 --k 15 --samples 8 --device cuda --out rank.json \
        --keep-out niah15-4k.keep

For each length, every layer's attention output is zeroed in turn and the teacher's mean NLL of the needle's
answer (teacher-forced, `tcal.conversion.select.niah_scores`) is measured on prompts with a calibration-side
haystack (sotu:calib, seed 1: never the evaluation prompts). --keep-out writes the K layers of the last
length as a comma list, for `bench/calib_sweep.py run --keep-file NAME=FILE`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tcal.conversion.policy import top_k
from tcal.conversion.select import SelectionConfig, niah_length_for, niah_scores
from tcal.data.teachers import load_teacher
from tcal.utils.runtime import resolve_device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True)
    p.add_argument("--keep-out", default=None)
    args = p.parse_args()

    device = resolve_device(args.device)
    teacher, tok = load_teacher(args.teacher, device=device)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        cfg = SelectionConfig(niah_length=niah_length_for(teacher, length), niah_samples=args.samples)
        t0 = time.perf_counter()
        scores = niah_scores(teacher, tok, cfg, progress=False)
        keep = top_k(scores, args.k, largest=True)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        rank = {i: r + 1 for r, i in enumerate(order)}
        rows.append({"length": cfg.niah_length, "samples": args.samples, "scores": scores, "keep": keep,
                     "rank": rank, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{cfg.niah_length} tokens ({rows[-1]['seconds']} s): keep {','.join(map(str, keep))}")
        print("  layer:rank(score) " + " ".join(f"{i}:{rank[i]}({s:.2f})" for i, s in enumerate(scores)))
    for a, b in zip(rows, rows[1:]):
        print(f"{a['length']} -> {b['length']}: in {sorted(set(b['keep']) - set(a['keep']))}, "
              f"out {sorted(set(a['keep']) - set(b['keep']))}")
    Path(args.out).write_text(json.dumps({"teacher": args.teacher, "k": args.k, "rows": rows}, indent=1))
    if args.keep_out:
        Path(args.keep_out).write_text(",".join(map(str, rows[-1]["keep"])))


if __name__ == "__main__":
    main()
