"""`taylor` with extra KL-stage terms on the kept attention layers: the residual streams entering them
(`KLConfig.attn_input_weight`), their attention distributions (`KLConfig.attn_map_weight`) or their queries
(`KLConfig.attn_query_weight`), on the CPU budget of the README's `niah:15` row, saved for the retrieval
scripts. With --weight 0 it is that row's conversion (`tcal convert --keep 0,1,2,8,... --init taylor --calib
wiki:calib+shakespeare:calib --calib-windows 8 --calib-window 512 --align-steps 100 --kl-steps 20`).

  python bench/kl_attn_input.py --weight 1 --out DIR          (inputs)
  python bench/kl_attn_input.py --weight 0 --map-weight 5 --out DIR   (attention maps)
  python bench/kl_attn_input.py --weight 0 --query-weight 5 --out DIR (queries)
  python bench/retrieval_reach.py DIR --speedups 1 ...; python bench/needle_attention.py DIR ...

Data roles: calibration `wiki:calib+shakespeare:calib` (8 x 512 tokens); PPL on the first 16 x 512 of
`wiki:eval`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NIAH15 = [0, 1, 2, 8, 15, 16, 18, 19, 20, 21, 23, 24, 27, 28, 29]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weight", type=float, default=1.0, help="KLConfig.attn_input_weight")
    p.add_argument("--map-weight", type=float, default=0.0, help="KLConfig.attn_map_weight")
    p.add_argument("--query-weight", type=float, default=0.0, help="KLConfig.attn_query_weight")
    p.add_argument("--keep", default=",".join(map(str, NIAH15)))
    p.add_argument("--kl-steps", type=int, default=20)
    p.add_argument("--align-steps", type=int, default=100)
    p.add_argument("--short-conv", action="store_true", help="GDN layers with short convs (identity taps at the start)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from tcal.conversion.convert import convert_with_record
    from tcal.data.corpora import as_corpus
    from tcal.data.teachers import load_teacher
    from tcal.evaluate.perplexity import perplexity_report
    from tcal.taylor.kl_stage import KLConfig
    from tcal.taylor.phase2 import AlignConfig
    from tcal.train.checkpoint import save_model

    teacher, tok = load_teacher("smollm2-135m", device=args.device)
    t0 = time.perf_counter()
    conv = convert_with_record(teacher, [int(i) for i in args.keep.split(",")], "taylor",
                               calib="wiki:calib+shakespeare:calib", tokenizer=tok, calib_window=512, calib_windows=8,
                               align=AlignConfig(steps=args.align_steps),
                               kl=KLConfig(steps=args.kl_steps, batch_size=3, attn_input_weight=args.weight,
                                           attn_map_weight=args.map_weight, attn_query_weight=args.query_weight),
                               use_short_conv=args.short_conv, progress=True)
    convert_s = time.perf_counter() - t0
    ppl = perplexity_report(conv.hybrid, tok, as_corpus("wiki:eval"), window=512, windows=16)["ppl"]
    out = Path(args.out)
    save_model(conv.hybrid, out)
    tok.save_pretrained(out)
    kl = conv.record["detail"]["kl"]
    row = {"settings": vars(args), "convert_s": convert_s, "wiki_eval_ppl_16x512": ppl,
           "kl": {k: kl[k] for k in ("heldout_kl_before", "heldout_kl", "best_step", "steps_run", "heldout_curve",
                                     "attn_input_layers", "train_attn_input_gap", "train_attn_map_kl",
                                     "train_attn_query_gap")}}
    (out / "kl_attn_input.json").write_text(json.dumps(row, indent=1))
    print(json.dumps({k: row[k] for k in ("convert_s", "wiki_eval_ppl_16x512")}),
          "held-out KL", round(kl["heldout_kl_before"], 4), "->", round(kl["heldout_kl"], 4),
          "gap", [round(g, 3) for g in kl["train_attn_input_gap"][:: max(1, len(kl["train_attn_input_gap"]) // 5)]],
          "map KL", [round(g, 3) for g in kl["train_attn_map_kl"][:: max(1, len(kl["train_attn_map_kl"]) // 5)]],
          "query gap", [round(g, 3) for g in kl["train_attn_query_gap"][:: max(1, len(kl["train_attn_query_gap"]) // 5)]])


if __name__ == "__main__":
    main()
