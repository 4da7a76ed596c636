"""`torchrun --nproc_per_node 2 -m tcal distill ...` end to end on the CPU (gloo): rank 0 alone writes
and prints, and the 2-process run, paused, resumes in one process to the one-process result."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from multiproc import free_port
from safetensors.torch import load_file

import tcal
from tcal.recipes.distill import DistillConfig, run
from tcal.train.checkpoint import partial_dir
from tcal.train.curve import read_curve

SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


def flags(assets, out, **over):
    kw = dict(teacher=assets / "teacher", data=assets / "train.npy", eval=assets / "eval.npy", eval_window=32,
              eval_windows=2, tokens=6 * TPS, seq_len=SEQ, batch_size=BATCH, lr=3e-3, eval_every=2 * TPS,
              eval_early=0, save_every=100 * TPS, kl_chunk=24, out=out, device="cpu")
    kw.update(over)
    return [str(assets / "hybrid"), "--no-progress"] + [a for k, v in kw.items()
                                                        for a in (f"--{k.replace('_', '-')}", str(v))]


def test_torchrun_distill_pauses_and_resumes_in_one_process(assets, tmp_path):
    src = str(Path(tcal.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "tcal", "distill",
           *flags(assets, out, stop_after_tokens=3 * TPS, dist_timeout=2)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("tcal distill: paused at 192 of 384 tokens") == 1  # rank 0 alone prints
    partial = partial_dir(out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["two.partial"]
    assert json.loads((partial / "report.partial.json").read_text())["world_size"] == 2
    # the rest in one process: the same curve and weights as one uninterrupted process
    from tcal.cli import build_parser
    from tcal.utils.command_config import from_args

    def cfg(args):
        ns = build_parser().parse_args(["distill", *args])
        ns.hybrid = ns.positional
        return from_args(DistillConfig, ns)

    rep = run(cfg(flags(assets, out) + ["--resume"]))
    assert rep["status"] == "done" and rep["segments"] == 2 and rep["world_size"] == 1
    ref = tmp_path / "one"
    run(cfg(flags(assets, ref)))
    a, b = read_curve(ref / "curve.csv"), read_curve(out / "curve.csv")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 2, 4, 6]
    for key in ("train_loss", "eval_ppl"):
        x, y = [r[key] for r in a if not math.isnan(r[key])], [r[key] for r in b if not math.isnan(r[key])]
        np.testing.assert_allclose(x, y, rtol=1e-5)
    wa, wb = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


def test_recover_keeps_the_teacher_whole(tmp_path, monkeypatch):
    import pytest

    from tcal.recipes import recover
    from tcal.utils.errors import TcalError

    # outside torchrun nothing reads --teacher-placement; under it, recover refuses to shard the teacher
    with pytest.raises(TcalError, match="--teacher-placement is read by a run under torchrun only"):
        recover.run(recover.RecoverConfig(teacher_placement="shard", out=str(tmp_path / "r"), progress=False))
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)  # a world of one process, as torchrun starts it
    with pytest.raises(TcalError, match="tcal recover keeps the teacher on every rank"):
        recover.run(recover.RecoverConfig(teacher_placement="shard", out=str(tmp_path / "r"), progress=False))
    assert not (tmp_path / "r.partial").exists()
