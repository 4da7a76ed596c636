"""Phase 2: parameter groups, held-out best state, NaN guard, one teacher pass for all layers."""
import copy
import logging

import pytest
import torch
from helpers import tiny_teacher

from tcal.conversion.surgery import build_hybrid
from tcal.modules.gdn import GatedDeltaNet
from tcal.modules.gdn_shape import GDNShape
from tcal.taylor.capture import LayerIO, capture_teacher_io
from tcal.taylor.phase2 import AlignConfig, align_layer, align_layers, param_groups
from tcal.taylor.pipeline import split_calibration
from tcal.utils.errors import TcalError

D, H, d = 16, 2, 8


def gdn_layer(seed=0, **over):
    torch.manual_seed(seed)
    return GatedDeltaNet(GDNShape(hidden_size=D, num_heads=H, head_dim=d, **over), layer_idx=3).eval()


def planted(N=6, T=12, seed=1, sign_heldout=1.0):
    """Inputs and targets from another GDN layer (so the task is learnable); last 2 sequences held out."""
    teacher = gdn_layer()  # the students are gdn_layer() too: same q/k/v/o, other gate and decay
    with torch.no_grad():
        teacher.g_proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
        teacher.dt_bias.add_(1.0)
        x = torch.randn(N, T, D, generator=torch.Generator().manual_seed(seed))
        y = teacher(x)[0]
    y[N - 2 :] *= sign_heldout
    return LayerIO(x[: N - 2], y[: N - 2]), LayerIO(x[N - 2 :], y[N - 2 :])


def test_defaults_are_the_reference():
    c = AlignConfig()
    assert (c.steps, c.lr_qkv, c.lr_gate, c.weight_decay, c.grad_clip, c.batch_size) == (300, 1e-4, 1e-3, 0.01, 1.0, None)
    assert c.heldout_frac == 0.25
    with pytest.raises(TcalError, match="heldout_frac must be in \\[0, 1\\), got 1.0"):
        AlignConfig(heldout_frac=1.0)
    with pytest.raises(TcalError, match="on_nonfinite must be 'stop' or 'skip', got 'ignore'"):
        AlignConfig(on_nonfinite="ignore")


@pytest.mark.parametrize("field", ["lr_qkv", "lr_gate"])
@pytest.mark.parametrize("value", [0.0, -1e-4, float("nan"), float("inf"), "1e-3"])
def test_learning_rates_must_be_finite_and_positive(field, value):
    with pytest.raises(TcalError, match=f"align {field} must be a finite number > 0"):
        AlignConfig(**{field: value})


def test_other_bad_settings():
    for kw, msg in ((dict(weight_decay=float("nan")), "weight_decay"), (dict(grad_clip=-1.0), "grad_clip"),
                    (dict(steps=-1), "steps"), (dict(eval_every=0), "eval_every")):
        with pytest.raises(TcalError, match=msg):
            AlignConfig(**kw)
    AlignConfig(weight_decay=0.0, grad_clip=0.0, steps=0)  # zero is fine where it means "off"


def test_param_groups():
    gdn = gdn_layer(use_short_conv=True, qk_norm=True, qkv_bias=True)
    qkv, gate, frozen = param_groups(gdn)
    names = {id(p): n for n, p in gdn.named_parameters()}
    assert {names[id(p)] for p in qkv} == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
        "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "q_norm.weight", "k_norm.weight"}
    assert {names[id(p)] for p in gate} == {
        "a_proj.weight", "b_proj.weight", "b_proj.bias", "A_log", "dt_bias", "g_proj.weight"}
    assert set(frozen) == {"o_proj.weight", "o_norm.weight"}


def test_alignment_improves_heldout_and_freezes_wo_and_norm():
    train, held = planted()
    gdn = gdn_layer()
    gdn.dt_bias.requires_grad_(False)  # the caller's flags come back afterwards
    before = copy.deepcopy(gdn.state_dict())
    rec = align_layer(gdn, train, held, AlignConfig(steps=25, lr_qkv=3e-3, lr_gate=3e-2), progress=False)
    assert rec["heldout_rel_mse"] < rec["heldout_rel_mse_before"]
    assert rec["heldout_cos"] > rec["heldout_cos_before"]
    assert rec["steps_run"] == 25 and len(rec["train_loss"]) == 25 and rec["best_step"] > 0
    assert rec["train_loss"][-1] < rec["train_loss"][0]
    assert torch.equal(gdn.o_proj.weight, before["o_proj.weight"])
    assert torch.equal(gdn.o_norm.weight, before["o_norm.weight"])
    assert not torch.equal(gdn.q_proj.weight, before["q_proj.weight"])
    assert not gdn.dt_bias.requires_grad and gdn.q_proj.weight.requires_grad
    best = min(rec["heldout_curve"], key=lambda s: s[1])
    assert best[0] == rec["best_step"] and abs(best[1] - rec["heldout_rel_mse"]) < 1e-5


def test_best_state_is_chosen_on_heldout_not_training_loss():
    # held-out targets are the negation: everything that helps training hurts the held-out fit
    train, held = planted(sign_heldout=-1.0)
    gdn = gdn_layer()
    before = copy.deepcopy(gdn.state_dict())
    rec = align_layer(gdn, train, held, AlignConfig(steps=10, lr_qkv=3e-3, lr_gate=3e-2), progress=False)
    assert rec["train_loss"][-1] < rec["train_loss"][0]
    assert rec["best_step"] == 0
    for k, v in gdn.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert rec["heldout_rel_mse"] == pytest.approx(rec["heldout_rel_mse_before"])


def test_without_heldout_best_training_loss_is_kept():
    train, _ = planted()
    gdn = gdn_layer()
    rec = align_layer(gdn, train, None, AlignConfig(steps=6, heldout_frac=0.0), progress=False)
    best = min(range(6), key=lambda i: rec["train_loss"][i])
    assert rec["best_step"] == best  # loss i was measured on the weights after i steps
    assert rec["heldout_tokens"] == 0


class _NaNAt:
    """Forward hook that turns the layer's output to NaN on the given training steps (grad-enabled calls)."""

    def __init__(self, calls):
        self.calls, self.n = set(calls), 0

    def __call__(self, _mod, _args, out):
        if not torch.is_grad_enabled():
            return out
        self.n += 1
        if self.n in self.calls:
            return out * float("nan")
        return out


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nonfinite_guard(policy, caplog):
    train, held = planted()
    gdn = gdn_layer()
    hook = gdn.o_proj.register_forward_hook(_NaNAt({3, 5}))
    with caplog.at_level(logging.WARNING, logger="tcal.taylor.phase2"):
        rec = align_layer(gdn, train, held, AlignConfig(steps=8, on_nonfinite=policy), progress=False)
    hook.remove()
    warnings = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and "layer 3" in warnings[0].getMessage() and "step 3" in warnings[0].getMessage()
    assert all(torch.isfinite(p).all() for p in gdn.parameters())
    if policy == "stop":
        assert rec["nonfinite_steps"] == [3] and rec["steps_run"] == 2
    else:
        assert rec["nonfinite_steps"] == [3, 5]
        assert rec["steps_run"] == 6


def test_align_layers_one_capture_minibatches_and_limits():
    teacher = tiny_teacher("llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3)
    hybrid = build_hybrid(teacher, keep=[1])
    ids = torch.randint(0, 61, (5, 10))
    captured = capture_teacher_io(teacher, ids, [0, 2], with_ctx=False)
    cfg = AlignConfig(steps=4, batch_size=2, seq_len=8, train_sequences=3, heldout_frac=0.4)
    rows, held_rows = split_calibration(5, cfg.heldout_frac)  # the caller (the pipeline) splits
    train = {i: io.select(rows) for i, io in captured.items()}
    held = {i: io.select(held_rows) for i, io in captured.items()}
    recs = align_layers(hybrid, train, held, cfg, progress=True)
    assert sorted(recs) == [0, 2]
    for r in recs.values():
        assert r["train_tokens"] == 3 * 8 and r["heldout_tokens"] == 2 * 8 and r["steps_run"] == 4
        assert r["wall_s"] > 0
    with pytest.raises(TcalError, match="not a GDN layer"):
        align_layers(hybrid, train, held, cfg, layers=[1])
    with pytest.raises(TcalError, match="no captured teacher activations for layer 2"):
        align_layers(hybrid, {0: train[0]}, None, cfg)
    recs = align_layers(hybrid, train, None, AlignConfig(steps=2, heldout_frac=0.0), layers=[2], progress=False)
    assert list(recs) == [2] and recs[2]["heldout_tokens"] == 0 and recs[2]["train_tokens"] == 3 * 10
