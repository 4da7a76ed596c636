"""Phase 1: every formula on constructed inputs with a known answer, then the variants on tiny teachers."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_teacher

from tcal.conversion.surgery import build_hybrid
from tcal.modules.gdn import GatedDeltaNet, inverse_softplus
from tcal.modules.gdn_shape import GDNShape
from tcal.ops import naive_recurrent_gated_delta_rule
from tcal.taylor.capture import LayerIO, capture_teacher_io
from tcal.taylor.formulas import (
    decay_rate,
    dt_bias_for_distance,
    exact_b_bias,
    exact_b_weight,
    logit,
    ols_scale,
    reference_b_weight,
    reference_gate_alpha,
    target_beta,
)
from tcal.taylor.layer_fit import layer_output, output_fit
from tcal.taylor.output_ls import fit_head_scales, fit_norm_weight, output_loss, output_ls_stats
from tcal.taylor.phase1 import PHASE1_VARIANTS, Phase1Options, apply_phase1, calibrate_layer
from tcal.taylor.statistics import LayerStats, collect_stats
from tcal.utils.errors import TcalError

H, d, D = 3, 8, 24


def gdn_layer(seed=0, **over):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(GDNShape(hidden_size=D, num_heads=H, head_dim=d, **over), layer_idx=0)
    with torch.no_grad():  # copied-projection scale rather than fla's 0.02
        for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            lin.weight.normal_(0, 0.3)
    return layer.eval()


def layer_stats(distance=(2.0, 7.0, 40.0), entropy=(0.5, 1.0, 2.5), nosink=None):
    ent = torch.tensor(entropy)
    conc = (1 - (ent - ent.min()) / (ent.max() - ent.min())).tolist()
    return LayerStats(layer=0, num_heads=H, head_dim=d, tokens=100, distance=list(distance), entropy=list(entropy),
                      entropy_normalised=[0.2, 0.4, 0.9], concentration_minmax=conc,
                      concentration_absolute=[0.8, 0.6, 0.1], ctx_rms=[0.5] * H, ctx_vec_rms=0.5, out_rms=1.0,
                      x_rms=1.0, distance_nosink=list(nosink or distance), sink_mass=[0.1, 0.2, 0.3])


def layer_io(N=3, T=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, T, D, generator=g) + 0.3  # a non-zero mean, so that mean(W_b x) matters
    return LayerIO(x=x, out=torch.randn(N, T, D, generator=g), ctx=0.5 * torch.randn(N, T, H, d, generator=g))


# --- pure formulas ---------------------------------------------------------------------------


def test_inverse_softplus_round_trip():
    r = torch.logspace(-3, math.log10(5.0), 40)
    torch.testing.assert_close(F.softplus(inverse_softplus(r)), r, rtol=1e-5, atol=1e-7)


def test_decay_rate_and_clip():
    torch.testing.assert_close(decay_rate([1.0, 10.0]), torch.tensor([math.log(2), math.log(2) / 10]))
    torch.testing.assert_close(decay_rate([0.01, 1e6]), torch.tensor([5.0, 1e-3]))  # clipped both ways
    torch.testing.assert_close(F.softplus(dt_bias_for_distance([4.0])), torch.tensor([math.log(2) / 4]))


def test_target_beta_and_logit():
    torch.testing.assert_close(target_beta([0.0, 0.5, 1.0]), torch.tensor([0.3, 0.5, 0.7]))
    torch.testing.assert_close(torch.sigmoid(logit([0.3, 0.5, 0.7])), torch.tensor([0.3, 0.5, 0.7]))


def test_reference_b_rows_rescaled_to_target_size():
    torch.manual_seed(0)
    w = torch.randn(3, 50)
    tl = logit(torch.tensor([0.3, 0.5, 0.7]))
    out = reference_b_weight(w, tl)
    torch.testing.assert_close(out.abs().mean(1), tl.abs() / math.sqrt(50), rtol=1e-5, atol=1e-7)
    assert torch.equal(torch.sign(out[0]), -torch.sign(w[0]))  # logit(0.3) < 0 flips the row
    assert torch.equal(torch.sign(out[2]), torch.sign(w[2]))


def test_exact_b_bias_sets_mean_logit():
    torch.manual_seed(0)
    w, x = torch.randn(3, 10), torch.randn(500, 10) + 1.0
    tl = torch.tensor([-0.8, 0.0, 0.8])
    b = exact_b_bias(w, x.mean(0), tl)
    torch.testing.assert_close((x @ w.T + b).mean(0), tl, rtol=0, atol=1e-5)


def test_exact_b_weight_is_the_biased_gate_where_x_holds_a_constant():
    """Without a bias, W_b' x reproduces W_b x + b_b exactly when some direction of x is constant, and otherwise
    is the least-squares closest linear map: nearer to the target mean logit than W_b alone."""
    torch.manual_seed(0)
    w, tl = torch.randn(3, 10), torch.tensor([-0.8, 0.0, 0.8])
    x = torch.randn(500, 10)
    x[:, 4] = 2.0  # a channel that is always 2 (LLM hidden states have such near-constant directions)
    w2 = exact_b_weight(w, x, tl, ridge=1e-9)
    torch.testing.assert_close(x @ w2.T, x @ w.T + exact_b_bias(w, x.mean(0), tl), rtol=0, atol=1e-4)
    y = torch.randn(500, 10) + 0.5  # no constant channel: the constant is held only in part
    w3 = exact_b_weight(w, y, tl)
    before, after = ((y @ w.T).mean(0) - tl).abs(), ((y @ w3.T).mean(0) - tl).abs()
    assert bool((after < before).all()), (before, after)


def test_ols_scale_recovers_planted_scale_and_clips():
    torch.manual_seed(0)
    pred = torch.randn(4, 30, 3, 8)
    planted = torch.tensor([3.7, 0.02, 25.0])
    raw, clipped = ols_scale(pred * planted[:, None], pred)
    torch.testing.assert_close(raw, planted, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clipped, torch.tensor([3.7, 0.1, 10.0]), rtol=1e-5, atol=1e-6)
    noise = torch.randn_like(pred)  # independent noise: the estimate is still close
    raw, _ = ols_scale(pred * 2.0 + 0.1 * noise, pred)
    assert (raw - 2.0).abs().max() < 0.05


def test_reference_gate_alpha():
    assert reference_gate_alpha(0.5, 2.0) == pytest.approx(0.01 * 0.5 / 2.0)
    assert reference_gate_alpha(0.5, 2.0, damping=0.1) == pytest.approx(0.1 * 0.5 / 2.0)


def test_output_least_squares_recovers_planted_scales():
    torch.manual_seed(0)
    u, w_o = torch.randn(5, 16, H, d), torch.randn(D, H * d)
    w_true, s_true = torch.rand(d) + 0.5, torch.tensor([0.5, 2.0, -1.5])
    m = (s_true[:, None] * w_true[None, :]).reshape(-1)
    r = (u.reshape(5, 16, -1) * m) @ w_o.T
    st = output_ls_stats(u, w_o, r)
    torch.testing.assert_close(fit_norm_weight(st, s_true), w_true, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fit_head_scales(st, w_true), s_true, rtol=1e-4, atol=1e-5)
    assert output_loss(st, w_true, s_true) < 1e-8 * st.R
    w, s = torch.randn(d), torch.randn(H)  # the closed-form loss is the direct loss
    mm = (s[:, None] * w[None, :]).reshape(-1)
    direct = float((r - (u.reshape(5, 16, -1) * mm) @ w_o.T).pow(2).sum())
    assert output_loss(st, w, s) == pytest.approx(direct, rel=1e-6)


# --- one layer ---------------------------------------------------------------------------------


def test_calibrated_decay_halves_the_state_after_d_tokens():
    gdn, io, st = gdn_layer(), layer_io(T=48), layer_stats(distance=(99.0, 99.0, 99.0), nosink=(2.0, 7.0, 40.0))
    calibrate_layer(gdn, st, io, Phase1Options.for_variant("exact", half_life_cap=0))  # the sink-free d_h, no cap
    assert torch.all(gdn.a_proj.weight == 0) and torch.all(gdn.A_log == 0)
    with torch.no_grad():
        g, _ = gdn.gates(io.x)
    for h, dh in enumerate((2, 7, 40)):
        torch.testing.assert_close(g[:, :dh, h].sum(1).exp(), torch.full((3,), 0.5), rtol=0, atol=1e-5)
    # and the recurrence itself: with no writes (beta = 0) the state is exactly halved after d_h tokens
    S0 = torch.randn(3, H, d, d)
    k = F.normalize(torch.randn(3, 40, H, d), dim=-1)
    zeros = torch.zeros(3, 40, H)
    for h, dh in enumerate((2, 7, 40)):
        _, S = naive_recurrent_gated_delta_rule(k[:, :dh], k[:, :dh], k[:, :dh], g[:, :dh], zeros[:, :dh],
                                                initial_state=S0, output_final_state=True)
        torch.testing.assert_close(S[:, h], 0.5 * S0[:, h], rtol=1e-5, atol=1e-5)
    # the reference leaves W_a random: the realised decay is only about right
    ref = gdn_layer()
    calibrate_layer(ref, layer_stats(distance=(2.0, 7.0, 40.0)), io, Phase1Options.for_variant("reference"))
    with torch.no_grad():
        g_ref, _ = ref.gates(io.x)
    assert (g_ref[:, :2, 0].sum(1).exp() - 0.5).abs().max() > 1e-3


def test_half_life_cap_in_head_dims():
    gdn, io = gdn_layer(), layer_io(T=48)
    st = layer_stats(distance=(2.0, 7.0, 40.0))
    rec = calibrate_layer(gdn, st, io, Phase1Options.for_variant("exact", distance="raw", half_life_cap=1.0))
    cap = d  # 1.0 head_dim = 8 tokens: the 40-token head is held to a half-life of 8
    with torch.no_grad():
        g, _ = gdn.gates(io.x)
    torch.testing.assert_close(g[:, :cap, 2].sum(1).exp(), torch.full((3,), 0.5), rtol=0, atol=1e-5)
    torch.testing.assert_close(g[:, :7, 1].sum(1).exp(), torch.full((3,), 0.5), rtol=0, atol=1e-5)  # under the cap
    assert rec["rate"][2] == pytest.approx(math.log(2) / cap)


def test_exact_beta_mean_logit_equals_target():
    gdn, io, st = gdn_layer(), layer_io(), layer_stats()
    rec = calibrate_layer(gdn, st, io, Phase1Options.for_variant("exact"))
    target = logit(target_beta(st.concentration_minmax))
    with torch.no_grad():
        mean_logit = gdn.b_proj(io.x).reshape(-1, H).mean(0)
    torch.testing.assert_close(mean_logit, target, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(rec["beta_logit_mean"]), target, rtol=0, atol=1e-5)
    # the absolute concentration drives beta* when asked
    gdn2 = gdn_layer()
    calibrate_layer(gdn2, st, io, Phase1Options.for_variant("exact", concentration="absolute"))
    with torch.no_grad():
        mean_logit = gdn2.b_proj(io.x).reshape(-1, H).mean(0)
    torch.testing.assert_close(mean_logit, logit(target_beta(st.concentration_absolute)), rtol=0, atol=1e-5)


def test_exact_beta_without_a_bias_folds_it_into_the_weights():
    gdn, io, st = gdn_layer(beta_bias=False), layer_io(), layer_stats()
    assert gdn.b_proj.bias is None
    x = io.x.clone()
    x[..., 0] = 1.0  # a constant direction: the fold is then exact
    calibrate_layer(gdn, st, LayerIO(x=x, out=io.out, ctx=io.ctx), Phase1Options.for_variant("exact"))
    with torch.no_grad():
        mean_logit = gdn.b_proj(x).reshape(-1, H).mean(0)
    torch.testing.assert_close(mean_logit, logit(target_beta(st.concentration_minmax)), rtol=0, atol=1e-3)


def test_reference_variant_follows_the_recipe():
    gdn, io, st = gdn_layer(), layer_io(), layer_stats()
    orig = copy.deepcopy(gdn)
    rec = calibrate_layer(gdn, st, io, Phase1Options.for_variant("reference"))
    assert torch.all(gdn.A_log == 0)
    torch.testing.assert_close(gdn.dt_bias.data, dt_bias_for_distance(st.distance))
    assert torch.equal(gdn.a_proj.weight, orig.a_proj.weight)  # W_a left random
    tl = logit(target_beta(st.concentration_minmax))
    torch.testing.assert_close(gdn.b_proj.weight.data, reference_b_weight(orig.b_proj.weight, tl))
    assert torch.equal(gdn.b_proj.bias, orig.b_proj.bias)
    sigma = torch.tensor(rec["sigma"])
    assert ((sigma >= 0.1) & (sigma <= 10)).all()
    torch.testing.assert_close(gdn.v_proj.weight.data, orig.v_proj.weight * sigma.repeat_interleave(d)[:, None])
    with torch.no_grad():
        silu_v_rms = float(F.silu(gdn.v_proj(io.x)).pow(2).mean().sqrt())
    ctx_vec_rms = float(io.ctx.pow(2).mean(-1).sqrt().mean())
    assert rec["alpha"] == pytest.approx(0.01 * ctx_vec_rms / silu_v_rms, rel=1e-5)
    torch.testing.assert_close(gdn.g_proj.weight.data, rec["alpha"] * gdn.v_proj.weight.data)
    assert torch.equal(gdn.o_proj.weight, orig.o_proj.weight) and torch.all(gdn.o_norm.weight == 1)


def test_reference_sigma_with_the_reference_codes_unscaled_query():
    io, st = layer_io(), layer_stats()
    a, b = gdn_layer(), gdn_layer()
    ra = calibrate_layer(a, st, io, Phase1Options.for_variant("reference", sigma_clip=(1e-9, 1e9)))
    rb = calibrate_layer(b, st, io, Phase1Options.for_variant("reference", sigma_clip=(1e-9, 1e9), sigma_q_scale=False))
    torch.testing.assert_close(torch.tensor(rb["sigma_raw"]) * math.sqrt(d), torch.tensor(ra["sigma_raw"]), rtol=1e-4,
                               atol=1e-6)


def test_exact_recovers_planted_output_scales():
    """Teacher = this very layer with known o_norm.weight, per-head W_o scales and gate: Phase 1 finds them."""
    io, st = layer_io(N=4, T=24), layer_stats()
    opts = Phase1Options.for_variant("exact", gate_rms_grid=(1.0,), sigma_where="o_proj", fit_norm=True)
    teacher = gdn_layer()
    # same decay / beta as the student will get; W_o and o_norm left alone
    calibrate_layer(teacher, st, io, Phase1Options.for_variant("exact", sigma_where="none", ols_gate=False))
    w_true, s_true = torch.rand(d) + 0.5, torch.tensor([0.5, 2.0, 1.5])
    with torch.no_grad():
        pre_rms = F.linear(io.x, teacher.v_proj.weight).pow(2).mean().sqrt()
        teacher.g_proj.weight.copy_(teacher.v_proj.weight / pre_rms)
        teacher.o_norm.weight.copy_(w_true)
        teacher.o_proj.weight.mul_(s_true.repeat_interleave(d)[None, :])
        target = teacher(io.x)[0]
    student = gdn_layer()
    rec = calibrate_layer(student, st, LayerIO(io.x, target, io.ctx), opts)
    assert rec["rel_mse"] < 1e-6 and rec["cos"] > 0.9999
    got = student.o_norm.weight[None, :] * torch.tensor(rec["sigma"])[:, None]
    torch.testing.assert_close(got, s_true[:, None] * w_true[None, :], rtol=1e-3, atol=1e-4)
    assert rec["rel_mse_before"] > 0.1


def test_exact_gate_recovers_planted_per_head_gate_scales():
    """Teacher = this layer with W_g = alpha diag(s) W_v (a small gate): the g_proj fit finds s."""
    io, st = layer_io(N=4, T=24), layer_stats()
    teacher = gdn_layer()
    calibrate_layer(teacher, st, io, Phase1Options.for_variant("exact", sigma_where="none", ols_gate=False))
    s_true = torch.tensor([0.5, 2.0, 1.5])
    with torch.no_grad():
        pre_rms = F.linear(io.x, teacher.v_proj.weight).pow(2).mean().sqrt()
        alpha = 0.05 / pre_rms
        teacher.g_proj.weight.copy_(alpha * s_true.repeat_interleave(d)[:, None] * teacher.v_proj.weight)
        target = teacher(io.x)[0]
    student = gdn_layer()
    opts = Phase1Options.for_variant("exact", gate_rms_grid=(0.05,), gate_rounds=6)
    rec = calibrate_layer(student, st, LayerIO(io.x, target, io.ctx), opts)
    assert rec["rel_mse"] < 1e-4
    torch.testing.assert_close(torch.tensor(rec["sigma"]), s_true, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(student.g_proj.weight.data, teacher.g_proj.weight.data, rtol=3e-2, atol=1e-5)
    assert torch.all(student.o_norm.weight == 1)  # nothing frozen in Phase 2 was touched
    assert torch.equal(student.o_proj.weight, gdn_layer().o_proj.weight)


def test_exact_silent_is_exact_dynamics_with_the_reference_gate():
    io, st = layer_io(), layer_stats()
    orig, g = gdn_layer(), gdn_layer()
    rec = calibrate_layer(g, st, io, Phase1Options.for_variant("exact-silent"))
    assert torch.all(g.a_proj.weight == 0)
    for name in ("v_proj", "o_proj", "q_proj", "k_proj"):
        assert torch.equal(getattr(g, name).weight, getattr(orig, name).weight)
    assert torch.all(g.o_norm.weight == 1)
    torch.testing.assert_close(g.g_proj.weight.data, rec["alpha_reference"] * g.v_proj.weight.data)


def test_exact_is_never_worse_than_silence_on_its_tokens():
    io, st = layer_io(), layer_stats()
    rec = calibrate_layer(gdn_layer(), st, io, Phase1Options.for_variant("exact"))
    assert rec["rel_mse"] <= 1.0 + 1e-4
    assert rec["ls_rel_mse"] == pytest.approx(rec["rel_mse"], rel=1e-3, abs=1e-5)  # closed form == forward pass


def test_switches_are_independent():
    io, st = layer_io(), layer_stats()
    orig = gdn_layer()
    g = gdn_layer()
    calibrate_layer(g, st, io, Phase1Options.for_variant("exact", zero_wa=False, exact_beta=False,
                                                         sigma_where="none", ols_gate=False))
    assert torch.equal(g.a_proj.weight, orig.a_proj.weight)
    assert torch.equal(g.b_proj.bias, orig.b_proj.bias) and not torch.equal(g.b_proj.weight, orig.b_proj.weight)
    assert torch.equal(g.v_proj.weight, orig.v_proj.weight) and torch.equal(g.o_proj.weight, orig.o_proj.weight)
    assert torch.all(g.o_norm.weight == 1)
    g2 = gdn_layer()
    rec = calibrate_layer(g2, st, io, Phase1Options.for_variant("exact", sigma_where="o_proj", ols_gate=False))
    torch.testing.assert_close(g2.g_proj.weight.data, rec["alpha_reference"] * g2.v_proj.weight.data)
    assert torch.all(g2.o_norm.weight == 1)
    torch.testing.assert_close(g2.o_proj.weight.data,
                               orig.o_proj.weight * torch.tensor(rec["sigma"]).repeat_interleave(d)[None, :])


def test_bad_options_and_inputs():
    with pytest.raises(TcalError, match="variant"):
        Phase1Options.for_variant("nope")
    with pytest.raises(TcalError, match="option"):
        Phase1Options.for_variant("exact", zero_wb=True)
    with pytest.raises(TcalError, match="sigma_where"):
        Phase1Options.for_variant("exact", sigma_where="o_norm")
    st = layer_stats()
    st.num_heads = 5
    with pytest.raises(TcalError, match="heads"):
        calibrate_layer(gdn_layer(), st, layer_io(), Phase1Options())
    io = layer_io()
    with pytest.raises(TcalError, match="with_ctx=True"):
        calibrate_layer(gdn_layer(), layer_stats(), LayerIO(io.x, io.out), Phase1Options())
    assert set(PHASE1_VARIANTS) == {"reference", "exact", "exact-silent"}


def test_layer_fit_of_the_layer_itself_is_perfect():
    gdn, io = gdn_layer(), layer_io()
    with torch.no_grad():
        y = gdn(io.x)[0]
    torch.testing.assert_close(layer_output(gdn, io.x, batch_size=2), y, rtol=1e-5, atol=1e-6)
    rel, cos = output_fit(y, y)
    assert rel == pytest.approx(0.0, abs=1e-12) and cos == pytest.approx(1.0, abs=1e-6)


# --- whole hybrids -----------------------------------------------------------------------------

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=128)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("variant", ["reference", "exact"])
def test_apply_phase1_on_a_hybrid(family, variant):
    teacher = tiny_teacher(family, **CFG)
    hybrid = build_hybrid(teacher, keep=[1])
    ids = torch.randint(0, CFG["vocab_size"], (3, 16))
    stats = collect_stats(teacher, ids, [0, 2], progress=False)
    captured = capture_teacher_io(teacher, ids, [0, 2])
    recs = apply_phase1(hybrid, stats, captured, variant=variant)
    assert sorted(recs) == [0, 2]
    for i, gdn in hybrid.gdn_modules().items():
        assert all(torch.isfinite(p).all() for p in gdn.parameters())
        assert recs[i]["variant"] == variant
        if variant == "exact":
            assert recs[i]["rel_mse"] <= 1.0 + 1e-4
    with torch.no_grad():
        assert torch.isfinite(hybrid(ids).logits).all()


def test_apply_phase1_needs_statistics_of_every_converted_layer():
    teacher = tiny_teacher("llama", **CFG)
    hybrid = build_hybrid(teacher, keep=[1])
    ids = torch.randint(0, CFG["vocab_size"], (2, 8))
    stats = collect_stats(teacher, ids, [0], progress=False)
    with pytest.raises(TcalError, match="no layer 2"):
        apply_phase1(hybrid, stats, capture_teacher_io(teacher, ids, [0, 2]), "exact")
    with pytest.raises(TcalError, match="unknown Phase 1 option 'zero_wb'"):
        apply_phase1(hybrid, collect_stats(teacher, ids, [0, 2], progress=False),
                     capture_teacher_io(teacher, ids, [0, 2]), "exact", zero_wb=True)
