"""KL-stage wall time with and without the kept teacher states (``KLConfig.cache_teacher``), on the real
offline teacher: 50 % converted (attention kept at 0,2,...,28, copy init), 16 training and 8 held-out
windows of 512 tokens of ``wiki:calib``, 10 steps of 4 windows, held-out KL every 5 steps.

    python bench/kl_stage_speed.py --device cpu --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tcal.conversion.surgery import build_hybrid
from tcal.data.teachers import load_teacher
from tcal.data.tokens import token_windows
from tcal.taylor.config import KLConfig
from tcal.taylor.kl_stage import kl_stage


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    teacher, tok = load_teacher("smollm2-135m", device=args.device)
    ids = token_windows("wiki:calib", tok, window=512, n_windows=24)
    train, held = ids[:16], ids[16:]
    out = {}
    for cache in (False, True):
        hybrid = build_hybrid(teacher, list(range(0, 30, 2)))
        t0 = time.perf_counter()
        rec = kl_stage(hybrid, teacher, train, held, KLConfig(steps=args.steps, batch_size=4, eval_every=5,
                                                              patience=None, cache_teacher=cache))
        out["kept" if cache else "recompute"] = {
            "wall_s": time.perf_counter() - t0, "heldout_kl": rec["heldout_kl"], "train_kl_last": rec["train_kl"][-1],
            "teacher_cached": rec["teacher_cached"]}
        print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
