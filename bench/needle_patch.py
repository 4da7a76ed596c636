"""Which side of a kept retrieval head breaks in the hybrid: the keys at the needle or the query at the question?

For each passkey prompt, the teacher's residual stream entering a kept attention layer is patched into the
hybrid's at some positions only (the needle's value tokens, the last prompt token, both, or every position),
and the attention mass that layer's heads put from the last token on the needle is read. The layer's weights
are the teacher's own, so patching every position gives the teacher's mass exactly (a check); the needle's
positions alone restore what the keys lost, the last position alone what the query lost.

  python bench/needle_patch.py HYBRID --layers 21,23 --length 2048 --samples 10 --out FILE.json

Data roles: the quality suite's passkey prompts (haystack `sotu:eval`, seed 0); nothing is trained.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from needle_attention import load_pair, prompt_args, value_positions

PATCHES = ("none", "needle", "query", "both", "all")


def masses(model, ids, layer: int, positions, patch=None):
    """(H,) attention mass from the last token on ``positions`` in ``layer``, with the layer's input rows
    ``patch = (rows, values)`` replaced first (eager attention, one forward)."""
    import torch

    from tcal.taylor.capture import decoder_layers, eager_attention, hooks

    out = {}
    block = decoder_layers(model)[layer]

    def swap(_m, args, kwargs):
        if patch is None:
            return None
        rows, values = patch
        if args:
            h = args[0].clone()
            h[0, rows] = values.to(h.dtype)
            return (h, *args[1:]), kwargs
        h = kwargs["hidden_states"].clone()
        h[0, rows] = values.to(h.dtype)
        return args, {**kwargs, "hidden_states": h}

    def keep(_m, _a, res):
        out["m"] = res[1][0, :, -1, positions].sum(-1).float()

    handles = [block.register_forward_pre_hook(swap, with_kwargs=True), block.self_attn.register_forward_hook(keep)]
    with torch.no_grad(), hooks(handles), eager_attention(model):
        model(ids)
    return out["m"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt_args(p)
    p.add_argument("--layers", default="21,23", help="kept attention layers to patch (one at a time)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    teacher, tok, hybrid, samples = load_pair(args)
    layers = [int(x) for x in args.layers.split(",")]
    bad = [i for i in layers if i not in hybrid.config.attention_layers]
    if bad:
        raise SystemExit(f"layer {bad[0]} is not a kept attention layer of {args.hybrid}")
    rows = []
    for s in samples:
        pos = value_positions(tok, s.prompt, s.answers[0])
        ids = torch.tensor([tok(s.prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            h_t = teacher(ids, output_hidden_states=True).hidden_states  # h_t[i]: layer i's input
        T = ids.shape[1]
        row = {"depth": round(s.depth, 2), "tokens": T, "value_tokens": len(pos), "layers": {}}
        for layer in layers:
            t = masses(teacher, ids, layer, pos)
            sets = {"none": None, "needle": pos, "query": [T - 1], "both": [*pos, T - 1], "all": list(range(T))}
            got = {name: (masses(hybrid, ids, layer, pos) if rows_ is None else
                          masses(hybrid, ids, layer, pos, (rows_, h_t[layer][0, rows_])))
                   for name, rows_ in sets.items()}
            head = int(t.argmax())
            row["layers"][layer] = {"teacher": t.tolist(), **{k: v.tolist() for k, v in got.items()}, "head": head}
            print(f"depth {s.depth:.2f} layer {layer} head {head}: teacher {float(t[head]):.3f} | hybrid " +
                  " ".join(f"{k} {float(v[head]):.3f}" for k, v in got.items()), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "patches": PATCHES, "rows": rows}))


if __name__ == "__main__":
    main()
