"""Phase 2 with layers fitted side by side (align_group) gives what fitting them one by one gives."""
import copy
import logging

import pytest
import torch
from helpers import assert_close, tiny_teacher

from tcal.conversion.surgery import build_hybrid
from tcal.modules.gdn import GatedDeltaNet
from tcal.modules.gdn_shape import GDNShape
from tcal.taylor import pipeline
from tcal.taylor.capture import LayerIO
from tcal.taylor.phase2 import AlignConfig, align_group, align_layer, concurrent_groups, fit_bytes

D, H, d = 16, 2, 8


def layer(seed, **over):
    torch.manual_seed(seed)
    return GatedDeltaNet(GDNShape(hidden_size=D, num_heads=H, head_dim=d, **over), layer_idx=seed).eval()


def task(seed, N=8, T=20, sign_heldout=1.0, **over):
    """Inputs and targets from another GDN layer; the last 2 sequences held out (negated: a task whose
    held-out fit only gets worse, so that layer stops early by its patience)."""
    src = layer(100 + seed, **over)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        src.g_proj.weight.normal_(0, 0.5, generator=g)
        src.dt_bias.add_(1.0)
        x = torch.randn(N, T, D, generator=g)
        y = src(x)[0]
    y[N - 2 :] *= sign_heldout
    return LayerIO(x[: N - 2], y[: N - 2]), LayerIO(x[N - 2 :], y[N - 2 :])


def one_by_one_and_together(cfg, signs=(1.0, -1.0, 1.0), heldout=True, **over):
    tasks = {i: task(i, sign_heldout=s, **over) for i, s in enumerate(signs)}
    alone = {i: layer(i, **over) for i in tasks}
    together = copy.deepcopy(alone)
    rec1 = {i: align_layer(alone[i], tr, ho if heldout else None, cfg, progress=False, layer=i)
            for i, (tr, ho) in tasks.items()}
    rec2 = align_group(together, {i: t[0] for i, t in tasks.items()},
                       {i: t[1] for i, t in tasks.items()} if heldout else None, cfg, progress=False)
    return alone, together, rec1, rec2


def assert_same_fit(alone, together, rec1, rec2, layers=None):
    for i in layers or alone:
        for (n, p), q in zip(alone[i].named_parameters(), together[i].parameters()):
            assert_close(q, p, 1e-5, f"layer {i} {n}")
        a, b = rec1[i], rec2[i]
        assert (a["steps_run"], a["best_step"]) == (b["steps_run"], b["best_step"]), i
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert [s for s, _ in b["heldout_curve"]] == [s for s, _ in a["heldout_curve"]]
        assert [r for _, r in b["heldout_curve"]] == pytest.approx([r for _, r in a["heldout_curve"]], rel=1e-4)
        for k in ("train_rel_mse", "train_cos", "heldout_rel_mse", "heldout_cos", "heldout_rel_mse_before"):
            assert (b[k] is None) == (a[k] is None) and (a[k] is None or b[k] == pytest.approx(a[k], rel=1e-4, nan_ok=True)), k
        assert b["train_tokens"] == a["train_tokens"] and b["heldout_tokens"] == a["heldout_tokens"]


@pytest.mark.parametrize("over", [dict(), dict(use_short_conv=True, qk_norm=True, qkv_bias=True)],
                         ids=["default", "conv+qknorm+bias"])
def test_side_by_side_equals_one_by_one(over):
    # minibatches, a cosine schedule with warm-up, held-out checks every 3 steps, and patience: the layers
    # stop at different steps (layer 1's held-out fit only worsens), each by its own count
    cfg = AlignConfig(steps=12, lr_qkv=1e-3, lr_gate=1e-2, batch_size=3, eval_every=3, schedule="cosine",
                      warmup_steps=2, patience=2)
    alone, together, rec1, rec2 = one_by_one_and_together(cfg, **over)
    assert len({r["steps_run"] for r in rec1.values()}) > 1  # the case is the one meant
    assert_same_fit(alone, together, rec1, rec2)
    assert rec2[0]["group"] == [0, 1, 2] and rec2[0]["wall_s"] > 0


def test_side_by_side_without_heldout_keeps_each_layers_best_training_loss():
    alone, together, rec1, rec2 = one_by_one_and_together(AlignConfig(steps=6, heldout_frac=0.0), heldout=False)
    assert_same_fit(alone, together, rec1, rec2)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nonfinite_layer_leaves_the_others_alone(policy, caplog):
    tasks = {i: task(i) for i in range(3)}
    bad = LayerIO(tasks[1][0].x.clone(), tasks[1][0].out)
    bad.x[2, 5] = float("nan")  # every minibatch holding training sequence 2 is non-finite for layer 1
    tasks[1] = (bad, tasks[1][1])
    cfg = AlignConfig(steps=10, batch_size=2, on_nonfinite=policy, lr_qkv=3e-3, lr_gate=3e-2)
    alone = {i: layer(i) for i in tasks}
    together = copy.deepcopy(alone)
    rec1 = {i: align_layer(alone[i], tr, ho, cfg, progress=False, layer=i) for i, (tr, ho) in tasks.items()}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tcal.taylor.phase2"):
        rec2 = align_group(together, {i: t[0] for i, t in tasks.items()}, {i: t[1] for i, t in tasks.items()}, cfg,
                           progress=False)
    warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and "layer 1" in warnings[0]
    assert rec2[1]["nonfinite_steps"] == rec1[1]["nonfinite_steps"] and rec2[1]["nonfinite_steps"]
    assert all(torch.isfinite(p).all() for g in together.values() for p in g.parameters())
    # the healthy layers fit as if alone; with "stop" the bad one too (it stops where it stopped alone)
    assert_same_fit(alone, together, rec1, rec2, layers=[0, 2] if policy == "skip" else None)


def test_groups_follow_memory_and_shape():
    a, b, c = layer(0), layer(1), layer(2, use_short_conv=True)
    gdns = {0: a, 1: b, 2: c, 3: layer(3)}
    one = fit_bytes(a, 100)
    assert concurrent_groups(gdns, [0, 1, 2, 3], 100, budget=10 * one) == [[0, 1], [2], [3]]
    assert concurrent_groups(gdns, [0, 1, 3], 100, budget=2 * one) == [[0, 1], [3]]
    assert concurrent_groups(gdns, [0, 1, 3], 100, budget=one - 1) == [[0], [1], [3]]
    more = {i: layer(i) for i in range(5)}  # at most 4 per group: 3 + 2 (one stacked shape), not 4 + 1
    assert concurrent_groups(more, list(range(5)), 100, budget=4 * one) == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("lazy", [False, True])
def test_calibrate_side_by_side_equals_one_by_one(lazy, monkeypatch):
    teacher = tiny_teacher("llama", num_hidden_layers=5)
    ids = torch.randint(0, 97, (8, 24), generator=torch.Generator().manual_seed(0))
    if lazy:  # two layers per teacher pass: groups of two, then one
        per_layer = 2 * ids.numel() * teacher.config.hidden_size * 4
        monkeypatch.setattr(pipeline, "LAZY_GROUP_BYTES", 2 * per_layer)
    results = []
    for concurrent in (False, True):
        hybrid = build_hybrid(teacher, keep=[1])
        cal = pipeline.prepare(teacher, ids, [0, 2, 3, 4], lazy=lazy)
        align = AlignConfig(steps=6, batch_size=3, eval_every=2, concurrent=concurrent)
        rec = pipeline.calibrate(hybrid, teacher, cal, phase1="exact-silent", phase2=True, align=align)
        results.append((hybrid, rec, cal.passes))
    (h1, r1, p1), (h2, r2, p2) = results
    assert p1 == p2 == (2 if lazy else 0)
    groups = sorted({tuple(r["group"]) for r in r2["phase2"].values()})
    assert groups == ([(0, 2), (3, 4)] if lazy else [(0, 2, 3, 4)])
    for (n, p), q in zip(h1.named_parameters(), h2.parameters()):
        assert_close(q, p, 1e-5, n)
    for i in (0, 2, 3, 4):
        assert r2["phase2"][i]["best_step"] == r1["phase2"][i]["best_step"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_side_by_side_on_cuda_equals_one_by_one(compiled):
    """On the GPU: the stack's training calls through the (compiled) chunked path and its held-out checks
    through fla where it is installed, against each layer alone on the same device (fp32, no TF32)."""
    from tcal import ops

    cfg = AlignConfig(steps=12, lr_qkv=1e-3, lr_gate=1e-2, batch_size=3, eval_every=3, schedule="cosine",
                      warmup_steps=2, patience=2, tf32=False)
    tasks = {i: task(i, T=130) for i in range(3)}
    tasks = {i: tuple(LayerIO(io.x.cuda(), io.out.cuda()) for io in t) for i, t in tasks.items()}
    alone = {i: layer(i).cuda() for i in tasks}
    together = copy.deepcopy(alone)
    with ops.compile_training(compiled):
        rec1 = {i: align_layer(alone[i], tr, ho, cfg, progress=False, layer=i) for i, (tr, ho) in tasks.items()}
        rec2 = align_group(together, {i: t[0] for i, t in tasks.items()}, {i: t[1] for i, t in tasks.items()}, cfg,
                           progress=False)
    for i in tasks:
        for (n, p), q in zip(alone[i].named_parameters(), together[i].parameters()):
            assert_close(q, p, 2e-4, f"cuda compiled={compiled} layer {i} {n}")
        assert rec2[i]["best_step"] == rec1[i]["best_step"]
        assert rec2[i]["heldout_rel_mse"] == pytest.approx(rec1[i]["heldout_rel_mse"], rel=1e-3)
