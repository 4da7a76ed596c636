"""Taylor-Calibrate Phase 1 (docs/method.md, steps 1-4): analytic, no gradients.

Phase 1 sets a GDN layer's decay, write gate, value scale and output gate from the teacher's
attention statistics without gradients. Two variants:

``reference``: the published recipe.
    1. A_log = 0, dt_bias = softplus^-1(clip(ln 2 / d_h, 1e-3, 5)); W_a left as it is (random).
    2. beta*_h = 0.3 + 0.4 c_h (min-max concentration); W_b's rows rescaled as the reference code
       does: row_h <- (logit(beta*_h) / sqrt(fan_in)) * row_h / mean|row_h|; b_b untouched.
    3. sigma*_h = <c, o> / <o, o> (OLS of the teacher's per-head output c on the GDN per-head
       recurrent output o, with the gates of steps 1-2), clipped to [0.1, 10], multiplies head
       h's rows of W_v.
    4. W_g = alpha_l W_v with alpha_l = 0.01 RMS(c) / RMS(SiLU(W_v x)) (after step 3).

``exact``: the same targets, realised exactly, with the value/output scale put where the
per-head RMSNorm does not cancel it and where Phase 2 can still move it. Each correction is a
switch of :class:`Phase1Options` (so each effect can be measured):
    zero_wa      W_a = 0, so g_t = -softplus(dt_bias) = -r_h for every token: the memory
                 halves after exactly d_h tokens (the reference's random W_a perturbs r_h per
                 token).
    exact_beta   W_b kept, b_b = logit(beta*_h) - mean_t(W_b x_t): the mean pre-sigmoid logit
                 over the calibration tokens equals logit(beta*_h) exactly. A b_proj without a
                 bias (the qwen3_5 target) gets the closest linear map instead (exact_b_weight).
    sigma_where  Where the per-head value scale goes. The gated RMSNorm divides o_h by its own
                 RMS, so a per-head factor on v (hence on o: the recurrence is linear in v)
                 cancels up to eps.
                 "v_proj" (reference): W_v's rows; survives only through W_g = alpha W_v and the
                 nonlinearity of SiLU(W_v x), and shrinks the relative step of W_v's fixed
                 Phase 2 learning rate (sigma reaches its clip of 10 on many heads).
                 "g_proj" (exact): W_g's rows. While the gate is small, SiLU(s z) ~ s SiLU(z),
                 so a factor s_h on head h's gate rows is a factor s_h on that head's output;
                 it is fitted by least squares in output space (below) with a few Gauss-Newton
                 refinements on the real, nonlinear gate. The gate is trained in Phase 2, so the
                 scale stays learnable.
                 "o_proj": W_o's head columns, after the norm: exact and linear, but W_o is
                 frozen in Phase 2, so the scale is too. "none".
                 (o_norm.weight is shared by the heads: it cannot hold a per-head scale.)
    ols_gate     W_g = alpha W_v with alpha picked from a grid of gate pre-activation RMS values
                 by the output-space least-squares loss, instead of the fixed 1 % damping.
    fit_norm     (off in both variants) also fit o_norm.weight (d numbers) in closed form: the
                 output is linear in it for a fixed gate. Measured to slow Phase 2 down: o_norm
                 is frozen there, and a small fitted weight scales every later update down.
    distance     "nosink" (exact): d_h with the attention parked on token 0 (the attention sink)
                 taken out. Sinks make a head that reads the previous token and the sink look
                 like a ~t/2-token memory .
    half_life_cap  (exact: 0.5) longest half-life, in head_dims: a d x d delta-rule state holds
                 at most d independent keys, so a much longer memory mostly adds interference.

``exact-silent``: exact's decay and write gate, the reference's near-silent gate (1 % damping),
no value scale. The better start for Phase 2; ``exact`` is the better init when no Phase 2
follows. Why the reference Phase 1 hurts
Phase 2: sigma scales W_v up to 10x (the clip, on a third of the heads), so W_v's fixed learning
rate becomes a 10x smaller relative step, and the long sink-inflated half-lives; Phase 2 then finds its
held-out best state early. A fitted, non-silent gate or o_norm.weight
(fit_norm) also slows Phase 2: AdamW's steps are absolute, so a large W_g moves slowly, and a
small frozen o_norm.weight scales every update's effect down.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tcal.modules.gdn import GatedDeltaNet
from tcal.taylor.capture import LayerIO
from tcal.taylor.formulas import (
    LN2,
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
from tcal.taylor.layer_fit import gdn_device_dtype, layer_output, normed, output_fit, recurrent_output
from tcal.taylor.output_ls import fit_head_scales, fit_norm_weight, output_loss, output_ls_stats
from tcal.taylor.statistics import LayerStats
from tcal.utils.errors import TcalError

log = logging.getLogger(__name__)


_EXACT_DYNAMICS = dict(zero_wa=True, exact_beta=True, distance="nosink", half_life_cap=0.5)


PHASE1_VARIANTS: dict[str, dict] = {
    # the published recipe
    "reference": dict(zero_wa=False, exact_beta=False, sigma_where="v_proj", ols_gate=False),
    # targets realised exactly; value scale and gate fitted by least squares in output space
    "exact": dict(**_EXACT_DYNAMICS, sigma_where="g_proj", ols_gate=True),
    # the same dynamics, the reference's near-silent gate and no value scale: the best start for Phase 2
    "exact-silent": dict(**_EXACT_DYNAMICS, sigma_where="none", ols_gate=False),
}


SIGMA_WHERE = ("v_proj", "o_proj", "g_proj", "none")


@dataclass
class Phase1Options:
    zero_wa: bool = False
    exact_beta: bool = False
    sigma_where: str = "v_proj"
    ols_gate: bool = False
    fit_norm: bool = False  # least-squares fit of o_norm.weight (frozen in Phase 2)
    distance: str = "raw"  # "raw" d_h (reference) or "nosink" (attention on token 0 left out)
    calibrate_decay: bool = True  # False: keep A_log / dt_bias as they are (ablation)
    concentration: str = "minmax"  # which c_h drives beta*: "minmax" (reference) or "absolute"
    rate_clip: tuple[float, float] = (1e-3, 5.0)
    # Longest half-life, in units of head_dim (None or 0: only rate_clip; for_variant ignores
    # None-valued switches, so pass 0 to lift exact's cap). A d x d delta-rule state holds at most
    # d independent keys, so memory much longer than d tokens mostly adds interference.
    half_life_cap: float | None = None
    beta_base: float = 0.3
    beta_span: float = 0.4
    sigma_clip: tuple[float, float] = (0.1, 10.0)  # |sigma| range on W_v (reference)
    # |sigma| range of the per-head scale on W_o's columns: a head the recurrence cannot
    # reproduce may be turned down towards silence, so no lower floor.
    o_sigma_clip: tuple[float, float] = (0.0, 10.0)
    # OLS of step 3 against the layer's own recurrent output (q scaled by d^-0.5, as the kernel
    # computes it). False: against S q without the scale, as the reference code's hand-written
    # recurrence does, which makes its sigma sqrt(d) times smaller.
    sigma_q_scale: bool = True
    gate_damping: float = 0.01  # reference alpha
    gate_rms_grid: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)  # ols_gate candidates: RMS of W_g x
    fit_rounds: int = 30  # most alternating least-squares rounds (w, sigma); stops once the loss settles
    gate_rounds: int = 3  # refinements of the per-head gate scale (sigma_where="g_proj")
    ridge: float = 1e-6
    batch_size: int = 8  # sequences per recurrence call

    @classmethod
    def for_variant(cls, variant: str = "reference", **switches) -> Phase1Options:
        if variant not in PHASE1_VARIANTS:
            raise TcalError(f"unknown Phase 1 variant {variant!r}; choose one of {', '.join(PHASE1_VARIANTS)}")
        names = {f for f in cls.__dataclass_fields__}
        bad = [k for k in switches if k not in names]
        if bad:
            raise TcalError(f"unknown Phase 1 option {bad[0]!r}; known: {', '.join(sorted(names))}")
        opts = cls(**{**PHASE1_VARIANTS[variant], **{k: v for k, v in switches.items() if v is not None}})
        if opts.sigma_where not in SIGMA_WHERE:
            raise TcalError(f"sigma_where must be one of {', '.join(SIGMA_WHERE)}, got {opts.sigma_where!r}")
        return opts


def _gate(pre: torch.Tensor, alpha: float, head_scale: torch.Tensor, shape) -> torch.Tensor:
    """SiLU(W_g x) for W_g = diag(alpha * head_scale_h per head rows) W_v, from pre = W_v x."""
    H = head_scale.shape[0]
    scale = (alpha * head_scale).to(pre.device)
    return F.silu(pre.reshape(*pre.shape[:-1], H, -1) * scale[:, None]).reshape(shape)


@torch.no_grad()
def _fit_output_path(gdn, x, io, pre, ref_alpha, opts, rec) -> tuple[float, torch.Tensor]:
    """Step 4 by least squares in output space: picks the gate scale (ols_gate), the per-head scale
    (sigma_where o_proj / g_proj) and o_norm.weight (fit_norm); sets W_o / o_norm, returns (alpha, head_scale)."""
    H, d = gdn.num_heads, gdn.head_dim
    dev, dt = gdn_device_dtype(gdn)
    n = normed(gdn, recurrent_output(gdn, x, opts.batch_size))
    r = io.out.to(dev).float()
    if gdn.o_proj.bias is not None:
        r = r - gdn.o_proj.bias.float()
    pre_rms = float(pre.pow(2).mean().sqrt().clamp_min(1e-12))
    alphas = [g / pre_rms for g in opts.gate_rms_grid] if opts.ols_gate else [ref_alpha]
    clip = opts.o_sigma_clip
    best = None
    for alpha in alphas:
        hs = torch.ones(H)
        st = output_ls_stats(n * _gate(pre, alpha, hs, n.shape), gdn.o_proj.weight, r)
        w, sigma, raw = torch.ones(d), torch.ones(H), torch.ones(H)
        if opts.fit_norm:
            w = fit_norm_weight(st, sigma, opts.ridge)
        loss = output_loss(st, w, sigma)
        if opts.sigma_where == "o_proj":
            # exact: the output is linear in sigma (and in w); alternate the two closed-form fits
            for _ in range(max(1, opts.fit_rounds)):
                raw = fit_head_scales(st, w, opts.ridge)
                # A head scale keeps its sign (a negative fit is a valid fit); only its size is clipped.
                sigma = torch.sign(raw) * raw.abs().clamp(*clip)
                prev = loss
                if opts.fit_norm:
                    w = fit_norm_weight(st, sigma, opts.ridge)
                loss = output_loss(st, w, sigma)
                if not opts.fit_norm or prev - loss <= 1e-10 * st.R:
                    break
        elif opts.sigma_where == "g_proj":
            # SiLU(s z) ~ s SiLU(z) while the gate is small: fit the head's output scale in closed form,
            # move it into the gate rows, recompute the real output, repeat (Gauss-Newton on the scale)
            cand = (loss, hs.clone(), w.clone())
            for _ in range(max(1, opts.gate_rounds)):
                raw = fit_head_scales(st, w, opts.ridge)
                hs = torch.sign(hs * raw) * (hs * raw).abs().clamp(*clip)
                st = output_ls_stats(n * _gate(pre, alpha, hs, n.shape), gdn.o_proj.weight, r)
                if opts.fit_norm:
                    w = fit_norm_weight(st, sigma, opts.ridge)
                loss = output_loss(st, w, sigma)
                if loss < cand[0]:
                    cand = (loss, hs.clone(), w.clone())
            loss, hs, w = cand
            raw = hs
        if best is None or loss < best[0]:
            best = (loss, alpha, w, sigma, raw, hs, st.R)
    loss, alpha, w, sigma, raw, hs, R = best
    if opts.sigma_where == "o_proj":
        gdn.o_proj.weight.mul_(sigma.to(dev).repeat_interleave(d)[None, :].to(dt))
        rec["sigma_raw"], rec["sigma"] = raw.tolist(), sigma.tolist()
    elif opts.sigma_where == "g_proj":
        rec["sigma"] = hs.tolist()
    gdn.o_norm.weight.copy_(w.to(gdn.o_norm.weight))
    rec["gate_rms"] = alpha * pre_rms
    rec["gate_rms_realised"] = float(  # RMS of W_g x
        (pre.reshape(*pre.shape[:-1], H, d) * (alpha * hs).to(pre.device)[:, None]).pow(2).mean().sqrt())
    rec["ls_rel_mse"] = loss / max(R, 1e-30)
    rec["o_norm_weight_mean"] = float(w.mean())
    return alpha, hs


@torch.no_grad()
def calibrate_layer(gdn: GatedDeltaNet, stats: LayerStats, io: LayerIO, opts: Phase1Options) -> dict:
    """Phase 1 on one GDN layer, in place. ``io`` holds the teacher's x / ctx / out for this layer.

    Returns a record of what was set and how well the layer then fits the teacher on ``io``.
    """
    t0 = time.perf_counter()
    H, d = gdn.num_heads, gdn.head_dim
    if stats.num_heads != H or stats.head_dim != d:
        raise TcalError(
            f"layer {stats.layer}: statistics have {stats.num_heads} heads of {stats.head_dim}, the GDN layer "
            f"{H} heads of {d}; were the statistics taken on another teacher?"
        )
    if io.ctx is None:
        raise TcalError("Phase 1 needs the teacher's per-head attention output (capture with with_ctx=True)")
    dev, dt = gdn_device_dtype(gdn)
    x = io.x.to(device=dev, dtype=dt)  # the teacher's activations in the layer's dtype (apply_phase1: fp32)
    xf = x.float()
    rec: dict = {"layer": stats.layer}
    rel0, cos0 = output_fit(layer_output(gdn, x, opts.batch_size), io.out.to(dev))

    # 1. decay
    distance = torch.tensor(stats.distances(opts.distance), dtype=torch.float32)
    lo, hi = opts.rate_clip
    if opts.half_life_cap:
        lo = max(lo, LN2 / (opts.half_life_cap * d))
    rate = decay_rate(distance, lo, hi)
    if opts.calibrate_decay:
        gdn.A_log.zero_()
        gdn.dt_bias.copy_(dt_bias_for_distance(distance, lo, hi).to(gdn.dt_bias))
    if opts.zero_wa:
        gdn.a_proj.weight.zero_()
    rec["distance"] = distance.tolist()
    rec["rate"] = rate.tolist()

    # 2. write gate
    conc = torch.tensor(stats.concentration(opts.concentration), dtype=torch.float32)
    beta_star = target_beta(conc, opts.beta_base, opts.beta_span)
    tl = logit(beta_star)
    if opts.exact_beta and gdn.b_proj.bias is None:  # a layout without the bias: fold it into W_b
        gdn.b_proj.weight.copy_(exact_b_weight(gdn.b_proj.weight, xf, tl.to(dev)).to(gdn.b_proj.weight))
    elif opts.exact_beta:
        x_mean = xf.reshape(-1, xf.shape[-1]).mean(0)
        gdn.b_proj.bias.copy_(exact_b_bias(gdn.b_proj.weight, x_mean, tl).to(gdn.b_proj.bias))
    else:
        gdn.b_proj.weight.copy_(reference_b_weight(gdn.b_proj.weight, tl).to(gdn.b_proj.weight))
    logits = gdn.b_proj(x).float()
    rec["beta_target"] = beta_star.tolist()
    rec["beta_logit_mean"] = logits.reshape(-1, H).mean(0).tolist()
    rec["beta_mean"] = torch.sigmoid(logits).reshape(-1, H).mean(0).tolist()

    # 3. value scale on W_v (reference)
    ctx = io.ctx.to(dev).float()
    if opts.sigma_where == "v_proj":
        o = recurrent_output(gdn, x, opts.batch_size)
        if not opts.sigma_q_scale:
            o = o * math.sqrt(d)  # the reference recurrence: S^T q without q's d^-0.5
        raw, sigma = ols_scale(ctx, o, opts.sigma_clip)
        gdn.v_proj.weight.mul_(sigma.to(dev).repeat_interleave(d)[:, None].to(dt))
        if gdn.v_proj.bias is not None:
            gdn.v_proj.bias.mul_(sigma.to(dev).repeat_interleave(d).to(dt))
        rec["sigma_raw"], rec["sigma"] = raw.tolist(), sigma.tolist()

    # 4. output gate (+ the per-head scale, in W_g's rows or W_o's columns, + o_norm.weight)
    if gdn.shape.output_gate:
        pre = F.linear(x, gdn.v_proj.weight).float()  # W_v x (no bias: g_proj has none)
        v_act = F.silu(gdn.v_proj(x).float())
        ctx_vec_rms = float(ctx.pow(2).mean(-1).sqrt().mean())
        ref_alpha = reference_gate_alpha(ctx_vec_rms, float(v_act.pow(2).mean().sqrt()), opts.gate_damping)
        rec["alpha_reference"] = ref_alpha
        head_scale = torch.ones(H)  # per-head factor on W_g's rows
        if opts.ols_gate or opts.fit_norm or opts.sigma_where in ("o_proj", "g_proj"):
            alpha, head_scale = _fit_output_path(gdn, x, io, pre, ref_alpha, opts, rec)
        else:
            alpha = ref_alpha
        rows = (alpha * head_scale).to(dev).repeat_interleave(d)[:, None]
        gdn.g_proj.weight.copy_((rows * gdn.v_proj.weight.float()).to(dt))
        rec["alpha"] = alpha
    rel1, cos1 = output_fit(layer_output(gdn, x, opts.batch_size), io.out.to(dev))
    rec.update(rel_mse_before=rel0, cos_before=cos0, rel_mse=rel1, cos=cos1, wall_s=time.perf_counter() - t0)
    return rec


def _check_stats(stats: Mapping[int, LayerStats], layers: Sequence[int]) -> None:
    missing = [i for i in layers if i not in stats]
    if missing:
        raise TcalError(f"the teacher statistics have no layer {missing[0]}; collect them for every converted layer")


def apply_phase1(
    hybrid,
    stats: Mapping[int, LayerStats],
    captured: Mapping[int, LayerIO],
    variant: str = "reference",
    *,
    progress: bool = False,
    **switches,
) -> dict[int, dict]:
    """Phase 1 on every GDN layer of ``hybrid``; returns {layer: record}.

    ``stats`` are the teacher's statistics and ``captured`` its activations (with ``ctx``) for
    every GDN layer, both taken on the calibration sequences Phase 1 may see (the caller,
    :func:`tcal.taylor.pipeline.calibrate`, decides which). ``switches`` override the variant's
    defaults (see :class:`Phase1Options`).
    """
    opts = Phase1Options.for_variant(variant, **switches)
    gdns = hybrid.gdn_modules()
    layers = sorted(gdns)
    _check_stats(stats, layers)
    records = {}
    it = layers
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(layers, desc=f"phase 1 ({variant})", unit="layer", leave=False)
    for i in it:
        dtype = gdns[i].q_proj.weight.dtype
        # the fits (least squares, logits, scales) run in fp32 whatever the hybrid's dtype, then the layer goes back
        gdns[i].float()
        try:
            records[i] = calibrate_layer(gdns[i], stats[i], captured[i], opts)
        finally:
            gdns[i].to(dtype)
        log.info("phase 1 (%s) layer %d: relative MSE %.3f -> %.3f on the calibration tokens", variant, i,
                 records[i]["rel_mse_before"], records[i]["rel_mse"])
        records[i]["variant"] = variant
        records[i]["options"] = asdict(opts)
    return records
