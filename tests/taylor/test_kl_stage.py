"""The whole-model KL stage: it lowers the held-out KL, keeps the best held-out state (never a worse
one), trains GDN parameters only, and refuses to run without held-out sequences."""
import pytest
import torch
from helpers import tiny_teacher

from tcal.conversion.surgery import build_hybrid
from tcal.taylor.kl_stage import KLConfig, kl_stage, mean_kl
from tcal.taylor.phase2 import AlignConfig
from tcal.taylor.pipeline import calibrate
from tcal.utils.errors import TcalError

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=128)


def ids(n, t=16, seed=0):
    return torch.randint(0, CFG["vocab_size"], (n, t), generator=torch.Generator().manual_seed(seed))


def test_kl_stage_lowers_heldout_kl_and_touches_only_gdn_layers():
    teacher = tiny_teacher("llama", **CFG)
    hybrid = build_hybrid(teacher, [0])
    train, held = ids(8), ids(4, seed=1)
    before_state = {k: v.clone() for k, v in hybrid.state_dict().items()}
    flags = {n: p.requires_grad for n, p in hybrid.named_parameters()}
    rec = kl_stage(hybrid, teacher, train, held, KLConfig(steps=30, lr=3e-3, eval_every=3, patience=None))
    assert rec["heldout_kl"] < rec["heldout_kl_before"]
    assert rec["heldout_kl"] == pytest.approx(mean_kl(hybrid, teacher, held, 4), rel=1e-5)  # the kept state
    changed = {k for k, v in hybrid.state_dict().items() if not torch.equal(v, before_state[k])}
    assert changed and all(".self_attn." in k and k.split(".")[2] in ("1", "2") for k in changed)
    assert flags == {n: p.requires_grad for n, p in hybrid.named_parameters()}


def test_kl_stage_never_returns_a_worse_state():
    teacher = tiny_teacher("llama", **CFG)
    hybrid = build_hybrid(teacher, [0])
    train, held = ids(4), ids(2, seed=1)
    start = mean_kl(hybrid, teacher, held, 4)
    rec = kl_stage(hybrid, teacher, train, held, KLConfig(steps=6, lr=50.0, eval_every=1, patience=None))
    assert rec["heldout_kl"] <= start + 1e-6
    assert mean_kl(hybrid, teacher, held, 4) == pytest.approx(rec["heldout_kl"], rel=1e-5)


def test_stale_limit_is_the_patience_or_a_tenth_of_the_run():
    assert KLConfig(steps=300, eval_every=5).stale_limit() == 6
    assert KLConfig(steps=1200, eval_every=5).stale_limit() == 24
    assert KLConfig(steps=40, eval_every=5).stale_limit() == 4  # short runs keep the patience
    assert KLConfig(steps=1200, eval_every=5, patience_frac=0.0).stale_limit() == 4
    assert KLConfig(steps=1200, patience=None).stale_limit() is None


def test_kl_stage_stops_by_its_stale_limit():
    # lr 3 unclipped makes the held-out KL worse than the start at every check (best step 0), so the stage
    # runs exactly stale_limit checks
    teacher = tiny_teacher("llama", **CFG)
    train, held = ids(4), ids(2, seed=1)
    for frac, want in ((0.0, 2), (0.5, 10)):
        hybrid = build_hybrid(teacher, [0])
        cfg = KLConfig(steps=20, lr=3.0, grad_clip=0.0, eval_every=1, patience=2, patience_frac=frac)
        assert kl_stage(hybrid, teacher, train, held, cfg)["steps_run"] == want


def test_kl_stage_needs_heldout_sequences_and_valid_settings():
    teacher = tiny_teacher("llama", **CFG)
    hybrid = build_hybrid(teacher, [0])
    with pytest.raises(TcalError, match="held-out"):
        kl_stage(hybrid, teacher, ids(4), ids(4)[:0], KLConfig(steps=2))
    with pytest.raises(TcalError, match="held-out"):
        calibrate(hybrid, teacher, ids(4), phase2=False, kl=KLConfig(steps=2), align=AlignConfig(heldout_frac=0.0))
    for bad, message in ((dict(steps=-1), "steps must be >= 0, got -1"), (dict(lr=0.0), "lr must be a finite"),
                         (dict(lr=float("nan")), "lr must be a finite number > 0, got nan"),
                         (dict(batch_size=0), "batch_size must be >= 1, got 0"),
                         (dict(eval_every=0), "eval_every must be >= 1"), (dict(eval_tokens=0), "eval_tokens must be"),
                         (dict(patience=0), "patience must be >= 1"),
                         (dict(patience_frac=-0.1), "patience_frac must be a share"),
                         (dict(patience_frac=2.0), "patience_frac must be a share of the run in \\[0, 1\\], got 2.0"),
                         (dict(schedule="linear"), "schedule must be one of constant, cosine, got 'linear'"),
                         (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
                         (dict(recall_frac=1.5), "recall_frac must be a share in \\[0, 1\\], got 1.5"),
                         (dict(recall_frac=-0.1), "recall_frac must be a share"),
                         (dict(recall_span=0), "recall_span must be >= 1")):
        with pytest.raises(TcalError, match=f"^KL stage {message}"):
            KLConfig(**bad)


def test_kl_stage_recall_mix_fits_and_picks_on_the_mixed_sequences():
    from tcal.data.recall import recall_rows

    teacher = tiny_teacher("llama", **CFG)
    train, held = ids(8), ids(4, seed=1)
    mixed_held = recall_rows(held, seed=0, frac=1.0, span=4, first_sample=8)  # held-out rows follow the training rows
    assert not torch.equal(mixed_held, held)
    hybrid = build_hybrid(teacher, [0])
    start_mixed, start_plain = mean_kl(hybrid, teacher, mixed_held, 4), mean_kl(hybrid, teacher, held, 4)
    rec = kl_stage(hybrid, teacher, train, held, KLConfig(steps=6, lr=3e-3, eval_every=2, patience=None,
                                                          recall_frac=1.0, recall_span=4))
    assert rec["heldout_kl_before"] == pytest.approx(start_mixed, rel=1e-6) != pytest.approx(start_plain, rel=1e-6)
    assert rec["heldout_kl"] == pytest.approx(mean_kl(hybrid, teacher, mixed_held, 4), rel=1e-5)
    assert rec["recall"] == {"frac": 1.0, "span": 4}
    with pytest.raises(TcalError, match="windows of at least 18 tokens"):
        kl_stage(build_hybrid(teacher, [0]), teacher, train, held, KLConfig(steps=2, recall_frac=0.5, recall_span=9))


def test_calibrate_runs_the_kl_stage_after_phase2():
    teacher = tiny_teacher("llama", **CFG)
    rec = calibrate(build_hybrid(teacher, [0]), teacher, ids(8), phase1="exact-silent", phase2=True,
                    kl=KLConfig(steps=4, eval_every=2))
    assert set(rec) >= {"phase1", "phase2", "kl"} and rec["kl"]["train_tokens"] == 6 * 16
    assert rec["kl"]["heldout_tokens"] == 2 * 16


def test_a_non_finite_kl_stops_the_stage_and_restores_the_best_state(caplog):
    teacher = tiny_teacher("llama", **CFG)
    hybrid = build_hybrid(teacher, [0])
    train, held = ids(4), ids(2, seed=1)
    start = mean_kl(hybrid, teacher, held, 4)
    gdn = hybrid.gdn_modules()[1]
    calls = {"n": 0}

    def poison(_m, _a, out):  # the third training forward returns NaN
        calls["n"] += 1
        if calls["n"] == 3 and torch.is_grad_enabled():
            return (out[0] * float("nan"), *out[1:])
    handle = gdn.register_forward_hook(poison)
    with caplog.at_level("WARNING"):
        rec = kl_stage(hybrid, teacher, train, held, KLConfig(steps=10, lr=1e-3, eval_every=100, patience=None))
    handle.remove()
    assert rec["steps_run"] < 10 and "non-finite KL" in caplog.text
    after = mean_kl(hybrid, teacher, held, 4)
    assert after == pytest.approx(start, rel=1e-5)  # no held-out check ran: the start state is the best one


def test_kept_teacher_states_give_the_same_stage_for_fewer_teacher_forwards(monkeypatch):
    import tcal.taylor.kl_stage as kl_mod

    teacher = tiny_teacher("llama", **CFG)
    train, held = ids(8), ids(4, seed=1)
    cfg = dict(steps=12, lr=3e-3, batch_size=2, eval_every=3, patience=None)
    runs = {}
    # bytes of the 4 x 16 held-out rows: hidden states 32 floats a row, targets 61 + 1; room for the held-out
    # targets (and their hidden states while they are made) but nothing of the training rows, or for the held-out
    # hidden states only
    held_targets, held_hidden = 64 * 62 * 4 + 64 * 32 * 4, 64 * 32 * 4
    for name, cache, budget in (("recompute", False, None), ("kept", True, None), ("held targets", True, held_targets),
                                ("held hidden", True, held_hidden), ("no room", True, 0)):
        if budget is not None:
            monkeypatch.setattr(kl_mod, "memory_budget", lambda device: budget)
        calls = {"n": 0}
        handle = teacher.model.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
        hybrid = build_hybrid(teacher, [0])
        rec = kl_stage(hybrid, teacher, train, held, KLConfig(cache_teacher=cache, **cfg))
        handle.remove()
        runs[name] = (rec, calls["n"], [p.detach().clone() for p in hybrid.parameters()])
    # per step one teacher forward, per evaluation (5: before the first step, then every 3rd) one pass over the 4
    # held-out sequences (eval_tokens holds them all)
    assert runs["recompute"][1] == 12 + 5 and runs["no room"][1] == 12 + 5
    assert runs["kept"][1] == 1 + 4  # each sequence once: the held-out ones in one pass, the training ones in 2s
    assert runs["held targets"][1] == 1 + 12 and runs["held hidden"][1] == 1 + 12
    assert runs["kept"][0]["teacher_cached"] == {"heldout": "targets", "train": "targets"}
    assert runs["held targets"][0]["teacher_cached"] == {"heldout": "targets", "train": None}
    assert runs["held hidden"][0]["teacher_cached"] == {"heldout": "hidden", "train": None}
    assert runs["no room"][0]["teacher_cached"] == {"heldout": None, "train": None}
    ref_rec, _, ref_params = runs["recompute"]
    for name in ("kept", "held targets", "held hidden", "no room"):
        rec, _, params = runs[name]
        assert rec["train_kl"] == pytest.approx(ref_rec["train_kl"], rel=1e-4), name
        assert [k for _, k in rec["heldout_curve"]] == pytest.approx([k for _, k in ref_rec["heldout_curve"]], rel=1e-4)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(params, ref_params)), name


def test_heldout_checks_in_larger_passes_score_and_choose_the_same():
    # eval_tokens only changes how many held-out sequences one no-grad pass takes, never the score or the state kept
    teacher = tiny_teacher("llama", **CFG)
    held = ids(6, seed=1)
    hybrid = build_hybrid(teacher, [0])
    assert mean_kl(hybrid, teacher, held, 1) == pytest.approx(mean_kl(hybrid, teacher, held, 6), rel=1e-5)
    recs = []
    for eval_tokens in (1, 10**6):
        h = build_hybrid(teacher, [0])
        recs.append(kl_stage(h, teacher, ids(8), held, KLConfig(steps=12, lr=3e-3, batch_size=2, eval_every=2,
                                                                 patience=None, eval_tokens=eval_tokens)))
    assert recs[0]["best_step"] == recs[1]["best_step"]
    assert [s for s, _ in recs[0]["heldout_curve"]] == [s for s, _ in recs[1]["heldout_curve"]]
    for (_, a), (_, b) in zip(recs[0]["heldout_curve"], recs[1]["heldout_curve"]):
        assert a == pytest.approx(b, rel=1e-4)


def test_eval_tokens_must_be_positive():
    with pytest.raises(TcalError, match="eval_tokens"):
        KLConfig(steps=1, eval_tokens=0)
