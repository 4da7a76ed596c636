"""Distillation and recovery on a tiny random Llama teacher (CPU, no downloads)."""

import argparse
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_teacher
from safetensors.torch import load_file

import tcal
from tcal.config import add_dataclass_args, from_args
from tcal.distill import (
    CURVE_FIELDS, DistillConfig, WindowOrder, _load_model, batch_for_step, chunked_distill_loss, distill, eval_due,
    lr_at, partial_dir, read_curve, run_distill,
)
from tcal.errors import TcalError
from tcal.recover import RecoverConfig, replot, run_recover, table_markdown, target_table, tokens_to_target

VOCAB = 97
SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: one thread is fastest, and a fixed count keeps runs bit-identical
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    teacher = tiny_teacher("llama")
    teacher.save_pretrained(root / "teacher")
    hybrid = tcal.convert(teacher, keep=[0, 2], init="copy")
    hybrid.save_pretrained(root / "hybrid")
    rng = np.random.default_rng(0)
    np.save(root / "train.npy", rng.integers(0, VOCAB, 8000).astype(np.uint16))
    np.save(root / "eval.npy", rng.integers(0, VOCAB, 2048).astype(np.uint16))
    return root


def make_cfg(assets, out, **over):
    kw = dict(hybrid=str(assets / "hybrid"), teacher=str(assets / "teacher"), data=str(assets / "train.npy"),
              eval=str(assets / "eval.npy"), eval_window=32, eval_windows=2, tokens=24 * TPS, seq_len=SEQ,
              batch_size=BATCH, lr=3e-3, eval_every=4 * TPS, eval_early=0, save_every=8 * TPS, kl_chunk=24,
              out=str(out), progress=False)
    kw.update(over)
    return DistillConfig(**kw)


def curve_without_time(path):
    """Rows without the wall-clock column; NaN (no training loss yet at step 0) as None so rows compare."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k != "elapsed_s"}
            for r in read_curve(path)]


def weights(path):
    return load_file(str(path / "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# (a) the loss decreases
# ---------------------------------------------------------------------------------------------


def test_loss_decreases_and_outputs(assets, tmp_path):
    out = tmp_path / "run"
    rep = run_distill(make_cfg(assets, out, tokens=32 * TPS, eval_every=8 * TPS, schedule="constant"))
    rows = read_curve(out / "curve.csv")
    assert [r["step"] for r in rows] == [0, 8, 16, 24, 32]
    losses = [r["train_loss"] for r in rows[1:]]
    assert math.isnan(rows[0]["train_loss"])
    assert losses[-1] < 0.8 * losses[0], losses
    assert rep["status"] == "done" and rep["final_ppl"] == rows[-1]["eval_ppl"]
    # final output: safetensors model, curve, plot, reports; no resume state; partial dir gone
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "curve.csv", "curve.png", "report.json", "report.md",
            "tcal_config.json"} <= names
    assert not any(p.suffix in (".pt", ".bin", ".pth") for p in out.rglob("*")) and not (out / "resume").exists()
    assert not partial_dir(out).exists()
    cfg = json.loads((out / "tcal_config.json").read_text())
    assert cfg["stage"] == "distill" and cfg["resolved"]["tokens_per_step"] == TPS
    # only the GDN layers trained: kept attention layers and everything else bit-identical
    before, after = weights(assets / "hybrid"), weights(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("model.layers.1.self_attn.", "model.layers.3.self_attn.")) for k in changed)
    reloaded = _load_model(out)
    assert type(reloaded).__name__ == "HybridForCausalLM"


# ---------------------------------------------------------------------------------------------
# (b) resume = uninterrupted, bit for bit
# ---------------------------------------------------------------------------------------------


class Killed(Exception):
    pass


def test_resume_after_kill_gives_the_same_curve_and_weights(assets, tmp_path):
    straight = tmp_path / "straight"
    run_distill(make_cfg(assets, straight))

    killed = tmp_path / "killed"

    def kill(step, tokens):
        if step == 13:  # after the checkpoint at step 8 and the evaluations at 4, 8, 12
            raise Killed

    with pytest.raises(Killed):
        run_distill(make_cfg(assets, killed), callback=kill)
    assert not killed.exists() and (partial_dir(killed) / "checkpoint" / "resume" / "state.json").is_file()
    state = json.loads((partial_dir(killed) / "checkpoint" / "resume" / "state.json").read_text())
    assert state["step"] == 8 and state["tokens"] == 8 * TPS
    with pytest.raises(TcalError, match="--resume"):
        run_distill(make_cfg(assets, killed))
    with pytest.raises(TcalError, match="settings changed"):
        run_distill(make_cfg(assets, killed, resume=True, lr=1e-3))
    rep = run_distill(make_cfg(assets, killed, resume=True))
    assert rep["segments"] == 2
    assert curve_without_time(killed / "curve.csv") == curve_without_time(straight / "curve.csv")
    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pause_and_resume_gives_the_same_curve(assets, tmp_path):
    straight = tmp_path / "straight"
    run_distill(make_cfg(assets, straight, schedule="cosine", micro_batch=2))
    paused = tmp_path / "paused"
    rep = run_distill(make_cfg(assets, paused, schedule="cosine", micro_batch=2, stop_after_tokens=10 * TPS))
    assert rep["status"] == "paused" and rep["tokens"] == 10 * TPS and not paused.exists()
    rep = run_distill(make_cfg(assets, paused, schedule="cosine", micro_batch=2, resume=True))
    assert rep["status"] == "done" and rep["tokens"] == 24 * TPS
    assert curve_without_time(paused / "curve.csv") == curve_without_time(straight / "curve.csv")
    a, b = weights(straight), weights(paused)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# (c) chunked KL = unchunked KL, values and gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ce_weight", [0.0, 0.3])
@pytest.mark.parametrize("chunk,ckpt", [(5, True), (7, False), (37, True), (1000, True)])
def test_chunked_kl_equals_unchunked(ce_weight, chunk, ckpt):
    torch.manual_seed(0)
    N, D, V = 37, 16, 50
    hs = torch.randn(N, D, requires_grad=True)
    ht = torch.randn(N, D)
    head_s = torch.nn.Linear(D, V, bias=True)
    head_t = torch.nn.Linear(D, V, bias=False)
    labels = torch.randint(0, V, (N,))
    labels[::6] = -100

    loss, kl, ce = chunked_distill_loss(hs, head_s, ht, head_t, labels, ce_weight=ce_weight, chunk_rows=chunk,
                                        use_checkpoint=ckpt)
    loss.backward()
    g_hs, g_w, g_b = hs.grad.clone(), head_s.weight.grad.clone(), head_s.bias.grad.clone()

    hs.grad = None
    head_s.zero_grad()
    logp_s = F.log_softmax(head_s(hs), -1)
    logp_t = F.log_softmax(head_t(ht), -1).detach()
    ref_kl = F.kl_div(logp_s, logp_t, log_target=True, reduction="batchmean")
    ref_ce = F.cross_entropy(head_s(hs), labels, ignore_index=-100)
    ref = (1 - ce_weight) * ref_kl + ce_weight * ref_ce
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6, rtol=1e-5)
    assert kl == pytest.approx(ref_kl.item(), rel=1e-5)
    if ce_weight:
        assert ce == pytest.approx(ref_ce.item(), rel=1e-5)
    assert torch.allclose(g_hs, hs.grad, atol=1e-7, rtol=1e-4)
    assert torch.allclose(g_w, head_s.weight.grad, atol=1e-7, rtol=1e-4)
    assert torch.allclose(g_b, head_s.bias.grad, atol=1e-7, rtol=1e-4)


def test_chunked_kl_is_zero_for_identical_models():
    torch.manual_seed(0)
    h = torch.randn(20, 8)
    head = torch.nn.Linear(8, 30)
    loss, kl, _ = chunked_distill_loss(h, head, h, head, chunk_rows=6)
    assert abs(kl) < 1e-6 and abs(loss.item()) < 1e-6
    with pytest.raises(TcalError, match="vocabular"):
        chunked_distill_loss(h, head, h, torch.nn.Linear(8, 31))


# ---------------------------------------------------------------------------------------------
# (d) token accounting and data order
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("micro", [0, 2])
def test_token_accounting_counts_every_trained_token(assets, tmp_path, micro):
    student = _load_model(assets / "hybrid")
    teacher = _load_model(assets / "teacher")
    seen = {"student": 0, "teacher": 0}

    def counter(name):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if student.training:  # evaluation forwards do not count
                seen[name] += ids.numel()
        return hook

    student.model.register_forward_pre_hook(counter("student"), with_kwargs=True)
    teacher.model.register_forward_pre_hook(counter("teacher"), with_kwargs=True)
    budget = 10 * TPS + 5  # not a whole number of steps: rounded up to 11 steps
    cfg = make_cfg(assets, tmp_path / "acc", tokens=budget, micro_batch=micro, eval_every=3 * TPS)
    train = np.load(assets / "train.npy")
    rep = distill(student, teacher, cfg, train_tokens=train, eval_ids=torch.from_numpy(
        np.load(assets / "eval.npy")[:64].astype(np.int64).reshape(2, 32)))
    assert rep["steps"] == 11 and rep["tokens"] == 11 * TPS == seen["student"] == seen["teacher"]
    assert rep["tokens"] >= budget
    rows = read_curve(tmp_path / "acc" / "curve.csv")
    assert [r["tokens"] for r in rows] == [r["step"] * TPS for r in rows]
    assert [r["step"] for r in rows] == [0, 3, 6, 9, 11]
    assert list(rows[0]) == list(CURVE_FIELDS)


def test_data_order_is_a_function_of_seed_and_step():
    tokens = np.arange(10 * SEQ, dtype=np.uint16)  # 10 windows
    order = WindowOrder(10, seed=3)
    seen = [order.window(i) for i in range(20)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))  # epochs are permutations
    assert seen[:10] != seen[10:]
    b = batch_for_step(tokens, WindowOrder(10, seed=3), SEQ, step=3, batch_size=4)
    assert torch.equal(b, batch_for_step(tokens, order, SEQ, step=3, batch_size=4))
    assert [int(r[0]) // SEQ for r in b] == seen[12:16]
    assert all(torch.equal(r, torch.arange(int(r[0]), int(r[0]) + SEQ)) for r in b)  # whole windows, no padding
    assert [WindowOrder(10, seed=4).window(i) for i in range(10)] != seen[:10]


def test_schedule_and_eval_points():
    kw = dict(peak=1.0, total_steps=100, warmup=10, min_ratio=0.1)
    assert lr_at(0, schedule="constant", **kw) == pytest.approx(0.1)
    assert lr_at(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(50, schedule="constant", **kw) == 1.0
    assert lr_at(99, schedule="cosine", **kw) == pytest.approx(0.1, abs=1e-3)
    steps = [s for s in range(1, 41) if eval_due(s, 40, 10, every=100, early=3)]
    assert steps == [2, 3, 5, 10, 20, 30, 40]  # early marks 50, 25, 12 tokens, then every 100, and the end


# ---------------------------------------------------------------------------------------------
# (e) the recovery table
# ---------------------------------------------------------------------------------------------

COPY = [(0, 1000.0), (100, 50.0), (200, 20.0), (300, 15.0)]
TAYLOR = [(0, 100.0), (100, 14.0), (200, 11.5), (300, 10.5)]


def test_tokens_to_target():
    r = tokens_to_target(COPY, 12.0)
    assert r == {"reached": False, "tokens": None, "interp": None, "budget": 300, "display": "> 300"}
    r = tokens_to_target(TAYLOR, 15.0)
    assert r["reached"] and r["tokens"] == 100 and r["display"] == "100"
    assert r["interp"] == pytest.approx((100 - 15) / (100 - 14) * 100)
    assert tokens_to_target(TAYLOR, 200.0)["tokens"] == 0  # already there before training
    # non-monotone curve: the first point at or below the target counts
    assert tokens_to_target([(0, 30.0), (10, 19.0), (20, 25.0), (30, 18.0)], 20.0)["tokens"] == 10


def test_target_table_and_ratios():
    table = target_table({"copy": COPY, "taylor": TAYLOR}, teacher_ppl=10.0)
    rows = {r["name"]: r for r in table["targets"]}
    assert list(rows) == ["1.1x teacher PPL", "1.2x teacher PPL", "1.5x teacher PPL", "2x teacher PPL",
                          "copy final PPL"]
    assert rows["1.1x teacher PPL"]["runs"]["copy"]["display"] == "> 300"
    assert rows["1.1x teacher PPL"]["runs"]["taylor"]["tokens"] == 300
    assert rows["1.2x teacher PPL"]["ratio"]["taylor"] == {"value": 1.5, "bound": ">", "display": "> 1.50x"}
    assert rows["1.5x teacher PPL"]["ratio"]["taylor"]["value"] == pytest.approx(3.0)
    assert rows["1.5x teacher PPL"]["ratio"]["taylor"]["bound"] == "="
    assert rows["2x teacher PPL"]["ratio"]["taylor"]["value"] == pytest.approx(2.0)
    assert rows["copy final PPL"]["ppl"] == 15.0 and rows["copy final PPL"]["runs"]["copy"]["tokens"] == 300
    # an init that never reaches a target the baseline reaches: an upper bound on the ratio
    worse = target_table({"copy": COPY, "slow": [(0, 900.0), (300, 40.0)]}, teacher_ppl=10.0)
    r2 = {r["name"]: r for r in worse["targets"]}["2x teacher PPL"]
    assert r2["runs"]["slow"]["display"] == "> 300" and r2["ratio"]["slow"]["bound"] == "<"
    assert r2["ratio"]["slow"]["value"] == pytest.approx(200 / 300)
    md = table_markdown(table)
    assert "> 300" in md and "copy/taylor" in md and "interp." in md and "3.00x" in md


# ---------------------------------------------------------------------------------------------
# recover end to end, and the CLI mapping
# ---------------------------------------------------------------------------------------------


def test_recover_end_to_end(assets, tmp_path):
    out = tmp_path / "rec"
    cfg = RecoverConfig(teacher=str(assets / "teacher"), keep="0,2", inits="copy,taylor", tokens=8 * TPS,
                        data=str(assets / "train.npy"), out=str(out), calib=str(assets / "train.npy"),
                        calib_window=16, calib_windows=4, align_steps=3, eval=str(assets / "eval.npy"),
                        eval_window=32, eval_windows=2, seq_len=SEQ, batch_size=BATCH, lr=3e-3, eval_every=4 * TPS,
                        eval_early=1, kl_chunk=32, progress=False, stop_after_tokens=4 * TPS)
    rep = run_recover(cfg)  # pauses in the first run
    assert rep["status"] == "paused" and not out.exists()
    cfg.stop_after_tokens, cfg.resume = 0, True
    summary = run_recover(cfg)
    assert summary["status"] == "done"
    for f in ("recovery.png", "recovery.md", "recovery.json", "report.md", "tcal_config.json",
              "copy/curve.csv", "taylor/curve.csv", "taylor/model.safetensors"):
        assert (out / f).exists(), f
    assert not partial_dir(out).exists()
    copy_c, taylor_c = read_curve(out / "copy" / "curve.csv"), read_curve(out / "taylor" / "curve.csv")
    assert [r["tokens"] for r in copy_c] == [r["tokens"] for r in taylor_c] == [0, 2 * TPS, 4 * TPS, 8 * TPS]
    assert copy_c[0]["eval_ppl"] != taylor_c[0]["eval_ppl"]  # the inits differ
    table = json.loads((out / "recovery.json").read_text())["table"]
    assert [t["name"] for t in table["targets"]][-1] == "copy final PPL"
    assert "taylor" in table["targets"][0]["ratio"]
    (out / "recovery.png").unlink()  # the results on disk are enough to redraw the plot
    assert replot(out) == str(out / "recovery.png") and (out / "recovery.png").stat().st_size > 0
    with pytest.raises(TcalError, match="recovery.json not found"):
        replot(tmp_path)


def test_recover_resume_reuses_the_saved_conversion(assets, tmp_path, monkeypatch):
    import tcal.recover as rec

    def cfg_for(out):
        return RecoverConfig(teacher=str(assets / "teacher"), keep="0,2", inits="taylor", tokens=2 * TPS,
                             data=str(assets / "train.npy"), out=str(out), calib=str(assets / "train.npy"),
                             calib_window=16, calib_windows=4, align_steps=3, eval=str(assets / "eval.npy"),
                             eval_window=32, eval_windows=2, seq_len=SEQ, batch_size=BATCH, eval_every=TPS,
                             kl_chunk=32, progress=False)

    whole = run_recover(cfg_for(tmp_path / "whole"))
    out = tmp_path / "killed"

    def killed(*args, **kwargs):
        raise RuntimeError("killed before the first checkpoint")

    real_distill = rec.distill
    monkeypatch.setattr(rec, "distill", killed)
    with pytest.raises(RuntimeError, match="killed"):
        run_recover(cfg_for(out))
    assert (partial_dir(out) / "taylor.converted" / "model.safetensors").is_file()
    monkeypatch.setattr(rec, "distill", real_distill)
    monkeypatch.setattr(rec, "convert_with", lambda *a, **k: pytest.fail("calibrated again on resume"))
    cfg = cfg_for(out)
    cfg.resume = True
    resumed = run_recover(cfg)
    assert resumed["status"] == "done" and not (out / "taylor.converted").exists()
    for key in ("zero_shot_ppl", "final_ppl"):  # the saved conversion is the same model, trained the same way
        assert resumed["runs"]["taylor"][key] == pytest.approx(whole["runs"]["taylor"][key], rel=1e-5)


def test_configs_map_to_cli_flags():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, DistillConfig)
    cfg = from_args(DistillConfig, p.parse_args(["--hybrid", "h", "--tokens", "5", "--no-progress", "--resume",
                                                 "--schedule", "constant", "--train", "all"]))
    assert (cfg.hybrid, cfg.tokens, cfg.progress, cfg.resume, cfg.schedule, cfg.train) == ("h", 5, False, True,
                                                                                            "constant", "all")
    p = argparse.ArgumentParser()
    add_dataclass_args(p, RecoverConfig)
    cfg = from_args(RecoverConfig, p.parse_args(["--inits", "copy,taylor", "--keep", "0,4"]))
    assert cfg.schedule == "constant" and cfg.inits == "copy,taylor" and cfg.calib == "wiki:calib"
    with pytest.raises(TcalError, match="contains the evaluation"):
        run_distill(DistillConfig(data="wiki", eval="wiki:eval", progress=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_distill_on_cuda_bf16_trains_and_resumes(assets, tmp_path):
    # The GPU path: bf16 autocast, GDN through fla or (where fla's backward is refused) chunked PyTorch.
    out = tmp_path / "gpu"
    rep = run_distill(make_cfg(assets, out, tokens=32 * TPS, eval_every=8 * TPS, schedule="constant",
                               device="cuda", stop_after_tokens=16 * TPS))
    assert rep["status"] == "paused"
    rep = run_distill(make_cfg(assets, out, tokens=32 * TPS, eval_every=8 * TPS, schedule="constant",
                               device="cuda", resume=True))
    rows = read_curve(out / "curve.csv")
    assert rep["status"] == "done" and rep["precision"] == "bf16 autocast" and rep["segments"] == 2
    assert [r["step"] for r in rows] == [0, 8, 16, 24, 32]
    assert rows[-1]["train_loss"] < 0.8 * rows[1]["train_loss"]
    assert rep["peak_memory"]["kind"].startswith("cuda") and rep["peak_memory"]["bytes"] > 0
