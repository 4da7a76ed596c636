"""Where one KL-stage step goes, part by part, at a teacher's shape with random weights, and what the fits' reduced-
precision matrix products (``--fit-matmul fast``: bf16 products on a CPU with AMX / AVX-512 BF16, TF32 on CUDA)
change of it.

One step of the KL stage as ``tcal convert`` runs it (:func:`tcal.taylor.kl_stage.kl_stage`): the teacher's final
hidden states (no grad; the stage keeps them where they fit, so this part is paid once per sequence, not per step),
the student's decoder forward, the chunked loss over the whole vocabulary (the LM heads and softmaxes), and the
backward into the GDN layers. Then a Phase 2 step of one GDN layer (:mod:`tcal.taylor.phase2`'s fit: the layer's
forward on the teacher's inputs, the MSE to the attention output, the backward). Random weights: the timing does not
depend on the values.

    python bench/kl_step_parts.py --shape qwen2.5-0.5b --keep uniform:50% --batch 2 --window 512 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tcal.conversion.policy import parse_keep, parse_policy, uniform_layers
from tcal.conversion.surgery import build_hybrid
from tcal.models.shapes import SHAPES, random_model
from tcal.modules.distill_loss import chunked_distill_loss, final_hidden, lm_parts, rows_per_chunk
from tcal.utils.runtime import fit_matmul_kind, tf32_matmul


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call; the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def kl_parts(teacher, hybrid, ids, repeats: int) -> dict:
    base_t, head_t = lm_parts(teacher)
    base_s, head_s = lm_parts(hybrid)
    params = [p for m in hybrid.gdn_modules().values() for p in m.parameters()]
    for p in hybrid.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    chunk = rows_per_chunk(head_s.weight.shape[0])
    with torch.no_grad():
        teacher_s, ht = timed(lambda: final_hidden(base_t, ids), repeats)
    ht = ht.reshape(-1, ht.shape[-1])

    def forward():
        return final_hidden(base_s, ids)

    student_s, hs = timed(forward, repeats)

    def loss_only():
        with torch.no_grad():
            return chunked_distill_loss(hs.detach().reshape(-1, hs.shape[-1]), head_s, ht, head_t, chunk_rows=chunk,
                                        use_checkpoint=False)

    loss_s, _ = timed(loss_only, repeats)

    def whole_step():
        h = final_hidden(base_s, ids)
        loss, _, _ = chunked_distill_loss(h.reshape(-1, h.shape[-1]), head_s, ht, head_t, chunk_rows=chunk,
                                          use_checkpoint=ids.numel() > chunk)
        loss.backward()
        for p in params:
            p.grad = None
        return None

    step_s, _ = timed(whole_step, repeats)
    return {"teacher_forward_s": teacher_s, "student_forward_s": student_s, "vocab_loss_forward_s": loss_s,
            "step_s": step_s, "backward_s": max(0.0, step_s - student_s - loss_s)}


def phase2_step(hybrid, teacher, layer: int, ids, repeats: int) -> float:
    """Seconds of one Phase 2 step of GDN layer ``layer``: its forward on the teacher's layer input, MSE to the
    teacher attention's output, backward (the inputs captured once, as Phase 2 keeps them)."""
    captured = {}
    attn = teacher.model.layers[layer].self_attn

    def hook(mod, args, kwargs, out):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured["x"], captured["y"] = x.detach(), out[0].detach()

    h = attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        teacher(input_ids=ids, use_cache=False)
    h.remove()
    gdn = hybrid.gdn_modules()[layer]
    for p in gdn.parameters():
        p.requires_grad_(True)

    def step():
        out = gdn(captured["x"])
        out = out[0] if isinstance(out, tuple) else out
        torch.nn.functional.mse_loss(out, captured["y"]).backward()
        for p in gdn.parameters():
            p.grad = None

    return timed(step, repeats)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--keep", default="uniform:50%")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (the medium budget's 2)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-layers", type=int, default=0, help="override the depth (smoke runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    teacher = random_model(args.shape, device=args.device, num_layers=args.num_layers, attn_implementation="sdpa")
    L = teacher.config.num_hidden_layers
    policy = parse_policy(parse_keep(args.keep), num_layers=L)
    keep = policy.layers if policy.kind == "list" else uniform_layers(policy.k, L)
    hybrid = build_hybrid(teacher, keep, share_weights=True).to(args.device).eval()
    teacher.eval()
    gdn_layer = next(i for i in range(L) if i not in keep)
    ids = torch.randint(0, teacher.config.vocab_size, (args.batch, args.window),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = {}
    for mode, on in (("fp32", False), ("fast", True)):
        with tf32_matmul(args.device, on):
            row = kl_parts(teacher, hybrid, ids, args.repeats)
            row["phase2_layer_step_s"] = phase2_step(hybrid, teacher, gdn_layer, ids, args.repeats)
        row["matmul"] = fit_matmul_kind(args.device, on)
        rows[mode] = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(mode, json.dumps(rows[mode]), flush=True)
    result = {"shape": args.shape, "keep": keep, "gdn_layers": L - len(keep), "batch": args.batch,
              "window": args.window, "device": args.device, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows,
              "speedup": {k: round(rows["fp32"][k] / rows["fast"][k], 2) for k in rows["fp32"]
                          if k.endswith("_s") and rows["fast"][k] > 0}}
    print(json.dumps(result["speedup"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
