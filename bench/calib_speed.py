"""Wall time of Taylor-Calibrate (capture + statistics + Phase 1 + Phase 2 [+ KL stage]) at a
borrowed shape with random weights: what a conversion costs on this device, stage by stage.

  python bench/calib_speed.py --shape qwen2.5-1.5b --keep uniform:25% --windows 32 --window 512 \
      --init taylor --json out.json

Random weights: the timing does not depend on the values (the fit's quality does, so no PPL here).
"""
from __future__ import annotations

import argparse
import json
import time

from tcal.models.shapes import SHAPES, random_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--keep", default="uniform:25%")
    p.add_argument("--init", default="taylor")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="Phase 2 sequences per step")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--kl-steps", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-layers", type=int, default=0, help="override the depth (CPU smoke runs)")
    p.add_argument("--group-bytes", type=float, default=None,
                   help="bytes of x + out one lazy teacher pass may hold (1 = one pass per layer; default: by device)")
    p.add_argument("--concurrent", default="auto", choices=("auto", "on", "off"),
                   help="Phase 2 with the layers of a teacher pass side by side (auto: on CUDA)")
    p.add_argument("--tf32", default="auto", choices=("auto", "on", "off"),
                   help="TF32 matrix products in Phase 2 and the KL stage (auto: on CUDA)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    from tcal.conversion.convert import convert_with_record
    from tcal.conversion.inits import get_init
    from tcal.conversion.policy import parse_keep, parse_policy, uniform_layers
    from tcal.taylor import pipeline
    from tcal.taylor.pipeline import prepare
    from tcal.taylor.stage_config import AlignConfig, KLConfig

    if args.group_bytes is not None:
        pipeline.LAZY_GROUP_BYTES = int(args.group_bytes)
    teacher = random_model(args.shape, device=args.device, num_layers=args.num_layers, attn_implementation="sdpa")
    L = teacher.config.num_hidden_layers
    policy = parse_policy(parse_keep(args.keep), num_layers=L)
    if policy.kind not in ("list", "uniform"):
        raise SystemExit("--keep: a list or uniform:K (ar/ga/niah score a real teacher)")
    keep = policy.layers if policy.kind == "list" else uniform_layers(policy.k, L)
    gdn = [i for i in range(L) if i not in keep]
    spec = get_init(args.init)
    ids = torch.randint(0, teacher.config.vocab_size, (args.windows, args.window),
                        generator=torch.Generator().manual_seed(0))
    switch = {"auto": None, "on": True, "off": False}
    align = AlignConfig(steps=args.steps, batch_size=args.batch_size, eval_every=args.eval_every,
                        schedule="cosine", warmup_steps=10, concurrent=switch[args.concurrent], tf32=switch[args.tf32])
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    cal = prepare(teacher, ids, gdn, heldout_frac=align.heldout_frac, statistics=spec.phase1 is not None,
                  device=args.device)
    sync()
    prepare_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    conv = convert_with_record(teacher, keep, spec.name, calib_ids=cal, align=align,
                               kl=KLConfig(steps=args.kl_steps, batch_size=8, tf32=switch[args.tf32]) if spec.kl else None)
    sync()
    total = time.perf_counter() - t0
    d = conv.record["detail"]
    row = {"shape": args.shape, "keep": keep, "gdn_layers": len(gdn), "init": spec.name,
           "tokens": args.windows * args.window, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "capture_and_stats_s": prepare_s, "convert_s": time.perf_counter() - t1,
           "phase1_s": sum(r.get("wall_s", 0) for r in (d.get("phase1") or {}).values()),
           "phase1_layer_s": [round(r.get("wall_s", 0), 3) for r in (d.get("phase1") or {}).values()],
           "phase2_s": sum(r["wall_s"] for r in (d.get("phase2") or {}).values()),
           "kl_s": (d.get("kl") or {}).get("wall_s"), "lazy_teacher_passes": cal.passes,
           "phase2_groups": sorted({tuple(r.get("group", [r["layer"]])) for r in (d.get("phase2") or {}).values()}),
           "concurrent": args.concurrent, "tf32": args.tf32, "steps": args.steps, "window": args.window,
           "total_s": total}
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
