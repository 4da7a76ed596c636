"""How far a 2-process distillation's weights land from one process's (tests/train/test_distributed.py's runs),
over teacher and data seeds, under the CPU kernels ATEN_CPU_CAPABILITY picks (native, avx2, default = scalar).

    ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 python spread.py 0,1,2,3 [--train all|gdn] [--wrong]

One JSON line per seed: the largest |difference| of any weight (``max_diff``, the test's measure) and where, and
the largest per-tensor ||difference|| / ||training update|| (``rel``); ``--wrong`` adds the same two numbers for a
one-process run on the training tokens shifted by one (``wrong_max``, ``wrong_rel``): what a data-order bug gives.
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "train")]
import numpy as np  # noqa: E402
import test_distributed as T  # noqa: E402
import torch  # noqa: E402
from multiproc import run_ranks  # noqa: E402


def assets_for(root: Path, seed: int) -> Path:
    """write_distill_assets's teacher, hybrid and tokens, with ``seed`` for the teacher and the tokens (0: the
    test's own)."""
    from helpers import TINY, tiny_teacher

    import tcal

    teacher = tiny_teacher("llama", seed=seed)
    teacher.save_pretrained(root / "teacher")
    tcal.convert(teacher, keep=[0, 2], init="copy", target="native").save_pretrained(root / "hybrid")
    rng = np.random.default_rng(seed)
    np.save(root / "train.npy", rng.integers(0, TINY["vocab_size"], 8000).astype(np.uint16))
    np.save(root / "eval.npy", rng.integers(0, TINY["vocab_size"], 2048).astype(np.uint16))
    return root


def two(world, assets, root, train):
    _, student = T.train_run(assets, root / "two.partial", T.options(train=train), world)
    return student and {k: v.clone() for k, v in student.state_dict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seeds")
    ap.add_argument("--train", default="all", choices=("all", "gdn"))
    ap.add_argument("--wrong", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            (d / "a").mkdir()
            assets = assets_for(d / "a", seed)
            from tcal.train.checkpoint import load_model

            init = load_model(assets / "hybrid").state_dict()
            _, ref = T.train_run(assets, d / "one.partial", T.options(train=args.train))
            ref = ref.state_dict()

            def measure(w):
                diffs = {k: (w[k].float() - ref[k].float()).abs().max().item() for k in ref}
                worst = max(diffs, key=diffs.get)
                rel = max(((w[k].float() - ref[k].float()).norm() / (ref[k].float() - init[k].float()).norm()).item()
                          for k in ref if not torch.equal(ref[k], init[k]))
                return diffs[worst], worst, rel

            row = {"seed": seed, "cap": os.environ.get("ATEN_CPU_CAPABILITY", "native"), "train": args.train}
            row["max_diff"], row["at"], row["rel"] = measure(run_ranks(two, 2, assets, d, args.train)[0])
            if args.wrong:
                tokens, _ = T.distill_data(assets)
                _, other = T.train_run(assets, d / "other.partial", T.options(train=args.train),
                                       train=np.roll(tokens, 1))
                row["wrong_max"], _, row["wrong_rel"] = measure(other.state_dict())
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
