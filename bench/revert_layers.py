"""Which converted layers cost a hybrid its retrieval: each GDN layer put back to the teacher's attention, one at
a time, scored on passkey prompts by how well the hybrid predicts the teacher's own answer.

For every prompt the teacher answers greedily once; each variant of the hybrid (as converted, and with one GDN
layer swapped back for the teacher's attention layer, weights and all) then reads prompt + that answer in one
forward. The score is the mean log-probability of the answer's tokens and whether every one of them is the
argmax (teacher-forced exact match). A layer whose return lifts the score is one whose attention the retrieval
needed; `tcal convert --keep` can then keep it.

  python bench/revert_layers.py HYBRID --length 2048 --samples 10 --out FILE.json

Data roles: the quality suite's passkey prompts (haystack `sotu:eval`, seed 0); nothing is trained.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from needle_attention import load_pair, prompt_args


@contextlib.contextmanager
def reverted(hybrid, teacher, layers):
    """``hybrid`` with its GDN mixers at ``layers`` swapped for the teacher's attention modules."""
    blocks, saved = hybrid.model.layers, {}
    try:
        for i in layers:
            saved[i] = blocks[i].self_attn
            blocks[i].self_attn = teacher.model.layers[i].self_attn
        yield hybrid
    finally:
        for i, m in saved.items():
            blocks[i].self_attn = m


def answer_score(model, ids, n_prompt: int) -> tuple[float, bool]:
    """(mean log-probability of tokens ``n_prompt:`` of ``ids`` (1, T), whether each is the argmax)."""
    import torch

    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, n_prompt - 1 : -1].float()  # (A, V)
    target = ids[0, n_prompt:]
    logp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
    return float(logp.mean()), bool((logits.argmax(-1) == target).all())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt_args(p)
    p.add_argument("--answer-tokens", type=int, default=8, help="tokens of the teacher's greedy answer scored")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    teacher, tok, hybrid, samples = load_pair(args)
    gdn = list(hybrid.config.gdn_layers)
    variants = {"hybrid": [], **{f"revert {i}": [i] for i in gdn}}
    scores = {name: [] for name in ["teacher", *variants]}
    rows = []
    for n, s in enumerate(samples):
        prompt = torch.tensor([tok(s.prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            full = teacher.generate(prompt, max_new_tokens=args.answer_tokens, do_sample=False,
                                    pad_token_id=tok.eos_token_id)
        P = prompt.shape[1]
        row = {"depth": round(s.depth, 2), "answer": s.answers[0],
               "teacher_says": tok.decode(full[0, P:]), "scores": {}}
        row["scores"]["teacher"] = answer_score(teacher, full, P)
        for name, layers in variants.items():
            with reverted(hybrid, teacher, layers) as m:
                row["scores"][name] = answer_score(m, full, P)
        for name, sc in row["scores"].items():
            scores[name].append(sc)
        rows.append(row)
        print(f"prompt {n + 1}/{len(samples)} depth {s.depth:.2f}: hybrid {row['scores']['hybrid'][0]:.2f}, best "
              f"revert {max(gdn, key=lambda i: row['scores'][f'revert {i}'][0])}", flush=True)
    summary = {name: {"mean_logp": sum(v for v, _ in sc) / len(sc), "exact": sum(e for _, e in sc) / len(sc)}
               for name, sc in scores.items()}
    for name, v in sorted(summary.items(), key=lambda kv: -kv[1]["mean_logp"]):
        print(f"{name:>10}: answer log-prob {v['mean_logp']:7.3f}  exact {v['exact']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
