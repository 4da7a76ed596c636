"""Where the last prompt token of a passkey prompt looks, in every attention layer a hybrid keeps: the
attention mass its heads put on the needle's value tokens, for the teacher and the hybrid on the same
prompts, by needle depth. A retrieval head of the teacher that still finds near needles in the hybrid but
not far ones says the attention path, not the answer's decoding, is what distance breaks.

  python bench/needle_attention.py HYBRID --length 2048 --samples 10 --out DIR

Data roles: the quality suite's passkey prompts (haystack `sotu:eval`, seed 0); nothing is trained.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def value_positions(tok, prompt: str, value: str) -> list[int]:
    """Token positions of the needle's value (its only occurrence in the prompt)."""
    start = prompt.index(value)
    end = start + len(value)
    enc = tok(prompt, add_special_tokens=False, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]


def needle_mass(model, ids, layers, positions):
    """{layer: (H,) attention mass of the last token on ``positions``}, eager attention, one forward."""
    import torch

    from tcal.taylor.capture import decoder_layers, eager_attention, hooks

    out, handles = {}, []
    for i in layers:
        def keep(_m, _a, res, i=i):
            out[i] = res[1][0, :, -1, positions].sum(-1).float().cpu()  # (H,)
        handles.append(decoder_layers(model)[i].self_attn.register_forward_hook(keep))
    with torch.no_grad(), hooks(handles), eager_attention(model):
        model(ids)
    return out


def prompt_args(p) -> None:
    """The arguments :func:`load_pair` reads, added to the parser ``p``."""
    p.add_argument("hybrid")
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--haystack", default="sotu:eval")


def load_pair(args):
    """(teacher, tokenizer, hybrid, the passkey prompts) as the quality suite builds them (``args``: teacher,
    hybrid, length, samples, haystack)."""
    from transformers import AutoModelForCausalLM

    import tcal  # noqa: F401  (registers the hybrid classes)
    from tcal.data.corpora import as_corpus
    from tcal.data.teachers import load_teacher
    from tcal.evaluate.niah import make_samples

    teacher, tok = load_teacher(args.teacher, device="cpu")
    hybrid = AutoModelForCausalLM.from_pretrained(args.hybrid).eval()
    samples = make_samples("single", tok, args.length, args.samples, documents=as_corpus(args.haystack).documents)
    return teacher, tok, hybrid, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt_args(p)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    teacher, tok, hybrid, samples = load_pair(args)
    kept = hybrid.config.attention_layers
    rows = []
    for s in samples:
        pos = value_positions(tok, s.prompt, s.answers[0])
        ids = torch.tensor([tok(s.prompt, add_special_tokens=False)["input_ids"]])
        t, h = needle_mass(teacher, ids, kept, pos), needle_mass(hybrid, ids, kept, pos)
        rows.append({"depth": round(s.depth, 2), "tokens": ids.shape[1], "value_tokens": len(pos),
                     "teacher": {i: t[i].tolist() for i in kept}, "hybrid": {i: h[i].tolist() for i in kept}})
        best = max(kept, key=lambda i: float(t[i].max()))
        print(f"depth {s.depth:.2f}: teacher's strongest layer {best} head {int(t[best].argmax())} "
              f"{float(t[best].max()):.2f}, hybrid there {float(h[best][t[best].argmax()]):.2f}; "
              "max per kept layer teacher/hybrid " +
              " ".join(f"{i}:{float(t[i].max()):.2f}/{float(h[i].max()):.2f}" for i in kept), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "needle_attention.json").write_text(json.dumps({"settings": vars(args), "kept": kept, "rows": rows}))


if __name__ == "__main__":
    main()
