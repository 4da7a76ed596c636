"""How much of a passkey score is the answer's room: the same prompts, scored on the first 12 generated tokens
(tcal's budget up to session 18) and on RULER's 128 (the default since).

    python bench/answer_room.py smollm2-135m HYBRID --lengths 2048,4096 --samples 20 --out bench/results/X

The prompts are built with 12 tokens of room (the old prompts exactly), then each is continued greedily for up
to 128 tokens, a row stopping once it holds its answer. Greedy decoding makes the first 12 tokens of that
continuation the old 12-token output, so both scores come from one generation. Writes answer_room.json (every
output, with the generated-token count at which the answer was complete) and answer_room.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="teacher specs or saved hybrid directories")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack", default="sotu:eval")
    p.add_argument("--short", type=int, default=12, help="the old room, in tokens")
    p.add_argument("--long", type=int, default=128, help="RULER's room, in tokens")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from transformers import StoppingCriteriaList

    from tcal.data.teachers import load_teacher
    from tcal.evaluate.niah import AnswersFound, haystack_documents, left_padded, make_samples, score
    from tcal.utils.runtime import model_device

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = {}
    for spec in args.models:
        model, tok = load_teacher(spec, dtype=torch.float32, device="cpu" if not torch.cuda.is_available() else "cuda")
        model.eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        for n in lengths:
            t0 = time.perf_counter()
            items = make_samples("single", tok, n, args.samples, seed=args.seed,
                                 documents=haystack_documents("single", args.haystack), max_new_tokens=args.short)
            cell = []
            for s in range(0, len(items), args.batch_size):
                batch = items[s:s + args.batch_size]
                ids, mask = left_padded(tok, [i.prompt for i in batch], pad)
                width = ids.shape[1]
                stop = StoppingCriteriaList([AnswersFound(tok, width, [i.answers for i in batch])])
                dev = model_device(model)
                with torch.no_grad():
                    gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=False,
                                         max_new_tokens=args.long, pad_token_id=pad,
                                         stopping_criteria=stop)[:, width:].cpu()
                for i, g in zip(batch, gen):
                    short = tok.decode(g[:args.short], skip_special_tokens=True)
                    full = tok.decode(g, skip_special_tokens=True)
                    found_at = next((k for k in range(1, len(g) + 1)
                                     if score(tok.decode(g[:k], skip_special_tokens=True), i.answers) == 1.0), None)
                    cell.append({"depth": i.depth, "answers": i.answers, "output": full, "found_at": found_at,
                                 "short": score(short, i.answers), "long": score(full, i.answers)})
            rows[f"{spec}@{n}"] = {"model": spec, "length": n, "seconds": time.perf_counter() - t0, "samples": cell}
            r = rows[f"{spec}@{n}"]
            print(f"{spec} @ {n}: {sum(c['short'] for c in cell) / len(cell):.2f} in {args.short} tokens, "
                  f"{sum(c['long'] for c in cell) / len(cell):.2f} in {args.long} ({r['seconds']:.0f} s)", flush=True)
            (out / "answer_room.json").write_text(json.dumps({"settings": vars(args), "cells": rows}, indent=1))
        del model
    lines = [f"# Passkey scored on {args.short} and on {args.long} generated tokens, the same prompts", "",
             f"- `single`, {args.samples} prompts per length built with {args.short} tokens of room, seed {args.seed}, "
             f"haystack `{args.haystack}`; greedy; a row stops once it holds its answer", "",
             f"| model | length | {args.short} tokens | {args.long} tokens | found after token {args.short} |",
             "|---|---:|---:|---:|---|"]
    for r in rows.values():
        c = r["samples"]
        late = sorted(x["found_at"] for x in c if x["found_at"] and x["found_at"] > args.short)
        lines.append(f"| {r['model']} | {r['length']:,} | {sum(x['short'] for x in c) / len(c):.2f} | "
                     f"{sum(x['long'] for x in c) / len(c):.2f} | {', '.join(map(str, late)) or '-'} |")
    (out / "answer_room.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
