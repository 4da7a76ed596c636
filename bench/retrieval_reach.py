"""What carries a hybrid's retrieval: its passkey by needle depth as it is, and with the memory of every
GDN layer shortened (each layer's log decay multiplied by k, i.e. A_log + log k: every half-life k times
shorter), beside its held-out PPL at each k.

A hybrid whose needles are found only near the question either reads them from its GDN state or from its
kept attention layers (which are the teacher's own and see the whole context). If shortening the GDN
memory takes the near needles away while PPL moves little, the GDN state was carrying them.

  python bench/retrieval_reach.py HYBRID --lengths 1024,2048 --samples 10 --speedups 1,4,16 --out DIR

Data roles: haystack `sotu:eval` (the quality suite's prompts, seed 0), PPL on the first windows of
`wiki:eval`; neither is read by calibration or training.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hybrid")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--speedups", default="1,4,16")
    p.add_argument("--ppl-windows", type=int, default=8)
    p.add_argument("--haystack", default="sotu:eval")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tcal  # noqa: F401  (registers the hybrid classes)
    from tcal.data.corpora import as_corpus
    from tcal.evaluate.niah import niah_cell
    from tcal.evaluate.perplexity import perplexity_report

    model = AutoModelForCausalLM.from_pretrained(args.hybrid).to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.hybrid)
    gdns = model.gdn_modules()
    base = {i: g.A_log.detach().clone() for i, g in gdns.items()}
    wiki = as_corpus("wiki:eval")
    rows = []
    for k in [float(s) for s in args.speedups.split(",")]:
        with torch.no_grad():
            for i, g in gdns.items():
                g.A_log.copy_(base[i] + math.log(k))
        t0 = time.perf_counter()
        row = {"speedup": k, "ppl": perplexity_report(model, tok, wiki, window=512, windows=args.ppl_windows)["ppl"]}
        for length in [int(s) for s in args.lengths.split(",")]:
            cell = niah_cell(model, tok, task="single", length=length, samples=args.samples, haystack=args.haystack)
            row[str(length)] = {"accuracy": cell["accuracy"],
                                "by_depth": [(round(s["depth"], 2), s["score"]) for s in cell["samples"]],
                                "outputs": [s["output"][:24] for s in cell["samples"]]}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        hits = " ".join(f"{L}: " + "".join("x" if sc >= 1 else "." for _, sc in row[L]["by_depth"])
                        for L in args.lengths.split(","))
        print(f"decay x{k:g}: PPL {row['ppl']:.2f}  {hits}  ({row['seconds']:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reach.json").write_text(json.dumps({"hybrid": args.hybrid, "settings": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
