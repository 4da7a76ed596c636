"""KL-stage wall time on the real offline teacher, SmolLM2-135M 50 % converted (attention kept at 0,2,...,28).

``--compare cache`` (default): the teacher recomputed at every step, its final hidden states kept, and its
distributions kept (``KLConfig.cache_teacher``, which keeps the distributions where they fit in the stage's memory
budget and the hidden states where only those fit); copy init, 16 training and 8 held-out windows of 512 tokens of
``wiki:calib``, 10 steps of 4 windows, held-out KL every 5 steps.

``--compare heldout``: what the held-out checks cost at the ``xl`` budget (2,048 x 512 tokens of the default mixture,
64 held-out windows, steps of 8 windows, a check every 5 steps): ``taylor`` with Phase 1 and no Phase 2 steps, then,
after a warm-up, ``--steps`` steps with the checks in passes of 8 windows (``eval_tokens=4096``), in passes of
``KLConfig.eval_tokens`` (the default), and with one check at the end only. Run under the calibration's own kernel
choice (on a Hopper GPU without fla's backward: the compiled chunked path for training, the eager one for checks).

    python bench/kl_stage_speed.py --device cpu --json OUT.json
    python bench/kl_stage_speed.py --compare heldout --device cuda --steps 60 --json OUT.json
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time

import torch

import tcal.taylor.kl_stage as kl_mod
from tcal import ops
from tcal.conversion.convert import calibration_ids, convert_with_record
from tcal.conversion.surgery import build_hybrid
from tcal.data.teachers import load_teacher
from tcal.data.tokens import token_windows
from tcal.taylor.budget import CALIB_BUDGETS
from tcal.taylor.kl_stage import kl_stage
from tcal.taylor.pipeline import compile_calibration, split_calibration
from tcal.taylor.stage_config import KLConfig
from tcal.utils.command_config import DEFAULT_CALIB
from tcal.utils.runtime import tf32_matmul

KEEP = list(range(0, 30, 2))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def compare_cache(teacher, tok, args) -> dict:
    ids = token_windows("wiki:calib", tok, window=512, n_windows=24)
    train, held = ids[:16], ids[16:]
    # a memory budget with room for both sets' hidden states and not for their distributions
    hidden_room = (train.numel() + held.numel()) * teacher.config.hidden_size * 4
    out = {}
    for name, cache, room in (("recompute", False, None), ("hidden states kept", True, hidden_room),
                              ("distributions kept", True, None)):
        hybrid = build_hybrid(teacher, KEEP)
        saved = kl_mod.memory_budget
        if room is not None:
            kl_mod.memory_budget = lambda device, room=room: room
        try:
            t0 = time.perf_counter()
            rec = kl_stage(hybrid, teacher, train, held, KLConfig(steps=args.steps, batch_size=4, eval_every=5,
                                                                  patience=None, cache_teacher=cache))
            wall = time.perf_counter() - t0
        finally:
            kl_mod.memory_budget = saved
        out[name] = {"wall_s": wall, "heldout_kl": rec["heldout_kl"], "train_kl_last": rec["train_kl"][-1],
                     "teacher_cached": rec["teacher_cached"]}
        print(json.dumps({name: out[name]}), flush=True)
    return out


def compare_heldout(teacher, tok, args) -> dict:
    b = CALIB_BUDGETS["xl"]
    ids = calibration_ids(DEFAULT_CALIB, tok, b.window, args.windows or b.windows)
    conv = convert_with_record(teacher, KEEP, "taylor", calib_ids=ids, tokenizer=tok,
                               align=dataclasses.replace(b.align, steps=0), kl=dataclasses.replace(b.kl, steps=0))
    train_rows, held_rows = split_calibration(ids.shape[0], b.align.heldout_frac, b.align.heldout_max_sequences)
    train, held = ids[train_rows], ids[held_rows]
    variants = {"warm-up": {"steps": 12},
                "checks in passes of 8 windows": {"eval_tokens": 8 * b.window},
                "checks in passes of eval_tokens": {},
                "one check at the end": {"eval_every": 10**9}}
    out = {"heldout_windows": int(held.shape[0]), "train_windows": int(train.shape[0]), "variants": {}}
    dev = args.device
    for name, kw in variants.items():
        cfg = dataclasses.replace(b.kl, **{"steps": args.steps, "patience": None, **kw})
        hybrid = copy.deepcopy(conv.hybrid)
        with ops.torch_only(ops.compile_by_default(dev)), ops.compile_training(compile_calibration(dev, b.window)), \
                tf32_matmul(dev, cfg.tf32):
            _sync(dev)
            t0 = time.perf_counter()
            rec = kl_stage(hybrid, teacher, train, held, cfg)
            _sync(dev)
            wall = time.perf_counter() - t0
        out["variants"][name] = {"steps": rec["steps_run"], "wall_s": round(wall, 2),
                                 "steps_per_s": round(rec["steps_run"] / wall, 2), "heldout_kl": rec["heldout_kl"],
                                 "eval_tokens": cfg.eval_tokens, "eval_every": cfg.eval_every}
        print(name, json.dumps(out["variants"][name]), flush=True)
        del hybrid
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--compare", choices=("cache", "heldout"), default="cache")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--windows", type=int, default=0, help="heldout: calibration windows (default: the xl budget's)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    teacher, tok = load_teacher("smollm2-135m", device=args.device)
    out = (compare_cache if args.compare == "cache" else compare_heldout)(teacher, tok, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
