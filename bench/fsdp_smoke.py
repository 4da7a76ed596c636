"""GPU smoke test of multi-process distillation on ONE GPU (docs/results.md, *Multi-process training*).

The multi-process path (FSDP2 student, sharded teacher, gradient checkpointing, micro-batches,
bf16 autocast, torch.compile of the GDN path, gathered checkpoints) forced onto a mesh of one GPU
and compared with the plain path; then a pause in the FSDP path resumed in the plain one. Run from
the repository root on a GPU machine:

    PYTHONPATH=src:tests python3 -m torch.distributed.run --nproc_per_node 1 bench/fsdp_smoke.py

Prints one JSON line per precision (losses and eval PPL of both paths, the largest weight
difference) and writes $OUT/fsdp_smoke.json.
"""
import json
import os
import sys
import time

sys.path[:0] = ["src", "tests"]
from pathlib import Path

import numpy as np
import torch
from helpers import write_distill_assets

from tcal.train import distributed as D
from tcal.train.checkpoint import load_model
from tcal.train.options import TrainOptions
from tcal.train.trainer import distill


class Forced(D.World):
    distributed = True  # the multi-process code path with a world of 1: FSDP2 over a mesh of one GPU

root = Path("/tmp/a")
root.mkdir(exist_ok=True)
write_distill_assets(root)
w = D.init_from_env("cuda", 5.0)
print("world", w, "torch", torch.__version__, flush=True)
W = Forced(**{f: getattr(w, f) for f in ("rank", "world_size", "local_rank", "device", "initialised", "owner")})
train = np.load(root / "train.npy")
ev = torch.from_numpy(np.load(root / "eval.npy")[:128].astype(np.int64).reshape(4, 32))
out = {}
for prec in ("fp32", "bf16"):
    kw = dict(eval="e", eval_window=32, eval_windows=4, seq_len=32, batch_size=4, lr=3e-3, eval_every=2 * 128,
              eval_early=0, save_every=10 ** 9, kl_chunk=48, progress=False, device="cuda", precision=prec)
    t = time.time()
    r1, s1 = distill(load_model(root / "hybrid"), load_model(root / "teacher"), TrainOptions(**kw), tokens=8 * 128,
                     train_tokens=train, eval_ids=ev, partial=root / f"plain-{prec}", world=w)
    t1 = time.time() - t
    t = time.time()
    r2, s2 = distill(load_model(root / "hybrid"), load_model(root / "teacher"),
                     TrainOptions(**kw, gradient_checkpointing=True, teacher_placement="shard", micro_batch=2),
                     tokens=8 * 128, train_tokens=train, eval_ids=ev, partial=root / f"fsdp-{prec}", world=W)
    t2 = time.time() - t
    a, b = s1.state_dict(), s2.state_dict()
    out[prec] = {"plain_loss": [r["train_loss"] for r in r1["curve"]], "fsdp_loss": [r["train_loss"] for r in r2["curve"]],
                 "plain_ppl": [r["eval_ppl"] for r in r1["curve"]], "fsdp_ppl": [r["eval_ppl"] for r in r2["curve"]],
                 "max_weight_diff": max((a[k].float() - b[k].float().to(a[k].device)).abs().max().item() for k in a),
                 "compile": [r1["gdn_compile"], r2["gdn_compile"]], "s": [t1, t2], "placement": r2["teacher_placement"]}
    print(prec, json.dumps(out[prec]), flush=True)
# pause in the FSDP path, resume in the plain one
kw = dict(eval="e", eval_window=32, eval_windows=4, seq_len=32, batch_size=4, lr=3e-3, eval_every=2 * 128,
          eval_early=0, save_every=10 ** 9, kl_chunk=48, progress=False, device="cuda", precision="fp32")
r, _ = distill(load_model(root / "hybrid"), load_model(root / "teacher"), TrainOptions(**kw, stop_after_tokens=3 * 128),
               tokens=8 * 128, train_tokens=train, eval_ids=ev, partial=root / "pause", world=W)
r3, s3 = distill(None, load_model(root / "teacher"), TrainOptions(**kw), tokens=8 * 128, train_tokens=train,
                 eval_ids=ev, partial=root / "pause", world=w)
out["resume"] = {"status": [r["status"], r3["status"]], "loss": [x["train_loss"] for x in r3["curve"]]}
print("resume", json.dumps(out["resume"]), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "fsdp_smoke.json"), "w"), indent=1)
D.destroy(w)
