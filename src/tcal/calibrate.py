"""Taylor-Calibrate Phase 1 (DESIGN.md §3 steps 1-4) and the init strategies built on it.

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
                 over the calibration tokens equals logit(beta*_h) exactly.
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
                 like a ~t/2-token memory (SmolLM2 layer 25: median d_h 94 -> 12 without it).
    half_life_cap  (exact: 0.5) longest half-life, in head_dims: a d x d delta-rule state holds
                 at most d independent keys, so a much longer memory mostly adds interference.

``exact-silent``: exact's decay and write gate, the reference's near-silent gate (1 % damping),
no value scale. The better start for Phase 2; ``exact`` is the better init when no Phase 2
follows. Measured on SmolLM2-135M (calib 4 x 256 wiki:calib, PPL on 64 x 512 wiki:eval, teacher
16.5; half / three quarters of the layers converted): copy 8,680 / 23,085; phase1 (reference)
7,091 / 19,441; phase1-exact 536 / 1,910; phase2 37.3 / 57.1; taylor (reference) 55.8 / 120.3;
taylor-exact 36.7 / 57.1; taylor-exact-silent 36.1 / 55.5. Why the reference Phase 1 hurts
Phase 2: sigma scales W_v up to 10x (the clip, on a third of the heads), so W_v's fixed learning
rate becomes a 10x smaller relative step, and the long sink-inflated half-lives; the held-out
best step comes at ~60 of 300 steps instead of ~130. A fitted, non-silent gate or o_norm.weight
(fit_norm) also slows Phase 2: AdamW's steps are absolute, so a large W_g moves slowly, and a
small frozen o_norm.weight scales every update's effect down.

Least squares in output space. Let u_t (H*d) be the normed recurrent output times the gate,
RMSNorm_h(o_t) * SiLU(W_g x_t), all heads, without o_norm.weight; m (H*d) the scale per
(head, dim), here m = sigma (x) w (per-head scale times the shared norm weight); r_t = y*_t -
b_o the teacher's attention output minus W_o's bias. Then y_t = W_o (m * u_t) + b_o and

    L(m) = sum_t ||r_t - W_o (m * u_t)||^2 = R - 2 m.P + m^T Q m,
    R = sum_t ||r_t||^2,  P = sum_t u_t * (W_o^T r_t),  Q = (W_o^T W_o) * (sum_t u_t u_t^T).

Fixing sigma, m = S w is linear in w (S stacks sigma_h I_d), so w = (S^T Q S)^-1 S^T P; fixing w,
m = W sigma is linear in sigma and likewise solved. The three sums are one pass over the tokens.
For sigma_where="g_proj" u_t itself depends on the head scale (through SiLU); each refinement
fits sigma on the current u_t, multiplies it into the gate rows and recomputes u_t exactly, and
the lowest real loss is kept.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tcal.errors import TcalError
from tcal.gdn import GatedDeltaNet, inverse_softplus
from tcal.stats import (
    LayerIO,
    LayerStats,
    capture_teacher_io,
    collect_stats,
    sum_per_head,
)

log = logging.getLogger(__name__)

__all__ = [
    "PHASE1_VARIANTS",
    "STRATEGIES",
    "OutputLSStats",
    "Phase1Options",
    "apply_phase1",
    "calibrate_layer",
    "decay_rate",
    "dt_bias_for_distance",
    "exact_b_bias",
    "fit_head_scales",
    "fit_norm_weight",
    "init_phase1",
    "init_phase2",
    "init_taylor",
    "inverse_softplus",
    "layer_output",
    "logit",
    "ols_scale",
    "output_fit",
    "output_loss",
    "output_ls_stats",
    "reference_b_weight",
    "reference_gate_alpha",
    "register_strategies",
    "split_calibration",
    "target_beta",
]

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------
# Pure formulas
# ---------------------------------------------------------------------------------------------


def decay_rate(distance, lo: float = 1e-3, hi: float = 5.0) -> torch.Tensor:
    """Per-token decay rate r_h = ln 2 / d_h clipped to [lo, hi]: exp(-r d) = 1/2."""
    d = torch.as_tensor(distance, dtype=torch.float32)
    return (LN2 / d.clamp_min(1e-6)).clamp(lo, hi)


def dt_bias_for_distance(distance, lo: float = 1e-3, hi: float = 5.0) -> torch.Tensor:
    """dt_bias that gives g = -softplus(dt_bias) = -ln2/d_h (clipped) when A_log = 0 and W_a x = 0."""
    return inverse_softplus(decay_rate(distance, lo, hi))


def target_beta(concentration, base: float = 0.3, span: float = 0.4) -> torch.Tensor:
    """beta*_h = 0.3 + 0.4 c_h: sharper heads overwrite more of their memory per token."""
    return base + span * torch.as_tensor(concentration, dtype=torch.float32)


def logit(p) -> torch.Tensor:
    p = torch.as_tensor(p, dtype=torch.float32)
    return torch.log(p) - torch.log1p(-p)


def reference_b_weight(w_b: torch.Tensor, target_logit: torch.Tensor) -> torch.Tensor:
    """The reference's W_b rescaling: row_h * (logit(beta*_h) / sqrt(fan_in)) / mean|row_h|.

    Only the rows' size (and sign) change, so for inputs uncorrelated with a row the mean
    logit stays about 0: the realised beta does not follow beta* (DESIGN §4).
    """
    w = w_b.float()
    fan_in = w.shape[1]
    w_abs = w.abs().mean(dim=1, keepdim=True).clamp_min(1e-8)
    return (target_logit.float().to(w.device) / math.sqrt(fan_in)).unsqueeze(1) * w / w_abs


def exact_b_bias(w_b: torch.Tensor, x_mean: torch.Tensor, target_logit: torch.Tensor) -> torch.Tensor:
    """b_b with mean_t (W_b x_t + b_b) = logit(beta*): b_b = logit(beta*) - W_b mean_t(x_t)."""
    return target_logit.float().to(w_b.device) - w_b.float() @ x_mean.float().to(w_b.device)


def ols_scale(target: torch.Tensor, pred: torch.Tensor, clip: tuple[float, float] | None = (0.1, 10.0)):
    """Per-head least-squares scale of ``pred`` onto ``target``, both (..., H, d).

    Returns (raw, clipped), each (H,): raw_h = <target_h, pred_h> / <pred_h, pred_h> summed over
    every token and dimension.
    """
    t, p = target.float(), pred.float()
    num, den = sum_per_head(t * p), sum_per_head(p * p)
    raw = num / den.clamp_min(1e-12)
    return raw, (raw.clamp(*clip) if clip is not None else raw)


def reference_gate_alpha(ctx_vec_rms: float, silu_v_rms: float, damping: float = 0.01) -> float:
    """alpha_l = damping * RMS(teacher per-head output) / RMS(SiLU(W_v x)): W_g = alpha_l W_v."""
    return damping * float(ctx_vec_rms) / max(float(silu_v_rms), 1e-8)


# ---------------------------------------------------------------------------------------------
# Least squares in the layer's output space
# ---------------------------------------------------------------------------------------------


@dataclass
class OutputLSStats:
    """Sufficient statistics of min ||r - W_o (m * u)||^2 over m (see the module docstring)."""

    Q: torch.Tensor  # (H*d, H*d) = (W_o^T W_o) * sum_t u_t u_t^T
    P: torch.Tensor  # (H*d,) = sum_t u_t * (W_o^T r_t)
    R: float  # sum_t ||r_t||^2
    num_heads: int
    head_dim: int


def output_ls_stats(u: torch.Tensor, w_o: torch.Tensor, r: torch.Tensor, chunk: int = 8192) -> OutputLSStats:
    """u (..., H, d) gated normed outputs, w_o (D, H*d), r (..., D) targets minus W_o's bias."""
    H, d = u.shape[-2:]
    uf = u.reshape(-1, H * d).double()
    rf = r.reshape(-1, r.shape[-1]).double()
    wo = w_o.double().to(uf.device)
    U2 = torch.zeros(H * d, H * d, dtype=torch.float64, device=uf.device)
    P = torch.zeros(H * d, dtype=torch.float64, device=uf.device)
    R = 0.0
    for s in range(0, uf.shape[0], chunk):
        ub, rb = uf[s : s + chunk], rf[s : s + chunk]
        U2 += ub.T @ ub
        P += (ub * (rb @ wo)).sum(0)
        R += float(rb.pow(2).sum())
    return OutputLSStats(Q=(wo.T @ wo) * U2, P=P, R=R, num_heads=H, head_dim=d)


def output_loss(st: OutputLSStats, w: torch.Tensor, sigma: torch.Tensor) -> float:
    """L(m) for m = sigma (x) w, in closed form from the sufficient statistics."""
    m = (sigma.double().to(st.P.device)[:, None] * w.double().to(st.P.device)[None, :]).reshape(-1)
    return float(st.R - 2 * (m @ st.P) + m @ st.Q @ m)


def _solve(A: torch.Tensor, b: torch.Tensor, ridge: float) -> torch.Tensor:
    lam = ridge * float(A.diagonal().abs().mean().clamp_min(1e-30))
    return torch.linalg.solve(A + lam * torch.eye(A.shape[0], dtype=A.dtype, device=A.device), b)


def fit_norm_weight(st: OutputLSStats, sigma: torch.Tensor | None = None, ridge: float = 1e-6) -> torch.Tensor:
    """The o_norm.weight (d,) minimising the output loss, per-head scales ``sigma`` held fixed (CPU fp32)."""
    H, d = st.num_heads, st.head_dim
    sigma = torch.ones(H, dtype=torch.float64) if sigma is None else sigma.double()
    sigma = sigma.to(st.P.device)
    Q4 = st.Q.reshape(H, d, H, d)
    A = torch.einsum("h,hikj,k->ij", sigma, Q4, sigma)
    b = (st.P.reshape(H, d) * sigma[:, None]).sum(0)
    return _solve(A, b, ridge).float().cpu()


def fit_head_scales(st: OutputLSStats, w: torch.Tensor | None = None, ridge: float = 1e-6) -> torch.Tensor:
    """The per-head scales sigma (H,) minimising the output loss, o_norm.weight ``w`` held fixed (CPU fp32)."""
    H, d = st.num_heads, st.head_dim
    w = torch.ones(d, dtype=torch.float64) if w is None else w.double()
    w = w.to(st.P.device)
    Q4 = st.Q.reshape(H, d, H, d)
    A = torch.einsum("i,hikj,j->hk", w, Q4, w)
    b = (st.P.reshape(H, d) * w[None, :]).sum(1)
    return _solve(A, b, ridge).float().cpu()


# ---------------------------------------------------------------------------------------------
# Phase 1 on one layer
# ---------------------------------------------------------------------------------------------

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


def gdn_device_dtype(gdn: GatedDeltaNet) -> tuple[torch.device, torch.dtype]:
    p = gdn.q_proj.weight
    return p.device, p.dtype


@torch.no_grad()
def _recurrent_output(gdn: GatedDeltaNet, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The layer's per-head recurrent output o (N, T, H, d), fp32, computed in batches of sequences."""
    dev, dt = gdn_device_dtype(gdn)
    outs = []
    for s in range(0, x.shape[0], batch_size):
        o, _, _ = gdn.recurrent(x[s : s + batch_size].to(dev, dt))
        outs.append(o.float())
    return torch.cat(outs)


def _normed(gdn: GatedDeltaNet, o: torch.Tensor) -> torch.Tensor:
    """RMSNorm_h(o) without the weight, exactly as HeadRMSNorm computes it."""
    o = o.float()
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + gdn.o_norm.eps)


@torch.no_grad()
def layer_output(gdn: GatedDeltaNet, x: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    dev, dt = gdn_device_dtype(gdn)
    return torch.cat([gdn(x[s : s + batch_size].to(dev, dt))[0].float() for s in range(0, x.shape[0], batch_size)])


def output_fit(pred: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """(relative MSE ||pred - target||^2 / ||target||^2, mean per-token cosine)."""
    pred, target = pred.float(), target.float().to(pred.device)
    rel = float((pred - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-30))
    cos = float(F.cosine_similarity(pred.reshape(-1, pred.shape[-1]), target.reshape(-1, target.shape[-1]), dim=-1).mean())
    return rel, cos


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
    n = _normed(gdn, _recurrent_output(gdn, x, opts.batch_size))
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
    x = io.x.to(dev)
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
        gdn.dt_bias.copy_(inverse_softplus(rate).to(gdn.dt_bias))
    if opts.zero_wa:
        gdn.a_proj.weight.zero_()
    rec["distance"] = distance.tolist()
    rec["rate"] = rate.tolist()

    # 2. write gate
    conc = torch.tensor(stats.concentration(opts.concentration), dtype=torch.float32)
    beta_star = target_beta(conc, opts.beta_base, opts.beta_span)
    tl = logit(beta_star)
    if opts.exact_beta:
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
        o = _recurrent_output(gdn, x, opts.batch_size)
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
    teacher,
    calib_ids: torch.Tensor | None = None,
    stats: Mapping[int, LayerStats] | None = None,
    variant: str = "reference",
    *,
    captured: Mapping[int, LayerIO] | None = None,
    batch_size: int = 4,
    progress: bool = False,
    **switches,
) -> dict[int, dict]:
    """Phase 1 on every GDN layer of ``hybrid``; returns {layer: record}.

    ``stats`` (from :func:`tcal.stats.collect_stats`, or loaded from disk) is collected on
    ``calib_ids`` when not given; ``captured`` (from :func:`tcal.stats.capture_teacher_io`
    with ctx) likewise. ``switches`` override the variant's defaults (see :class:`Phase1Options`).
    """
    opts = Phase1Options.for_variant(variant, **switches)
    gdns = hybrid.gdn_modules()
    layers = sorted(gdns)
    if (stats is None or captured is None) and calib_ids is None:
        raise TcalError("Phase 1 needs calibration tokens (calib_ids) or precomputed stats and captured activations")
    if stats is None:
        stats = collect_stats(teacher, calib_ids, layers, batch_size=batch_size, progress=progress)
    _check_stats(stats, layers)
    if captured is None:
        dev = gdn_device_dtype(gdns[layers[0]])[0]
        captured = capture_teacher_io(teacher, calib_ids, layers, batch_size=batch_size, device=dev, progress=progress)
    records = {}
    it = layers
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(layers, desc=f"phase 1 ({variant})", unit="layer", leave=False)
    for i in it:
        records[i] = calibrate_layer(gdns[i], stats[i], captured[i], opts)
        log.info("phase 1 (%s) layer %d: relative MSE %.3f -> %.3f on the calibration tokens", variant, i,
                 records[i]["rel_mse_before"], records[i]["rel_mse"])
        records[i]["variant"] = variant
        records[i]["options"] = asdict(opts)
    return records


# ---------------------------------------------------------------------------------------------
# Strategies (registered into tcal.convert.INITS)
# ---------------------------------------------------------------------------------------------


def split_calibration(n: int, heldout_frac: float) -> tuple[slice, slice]:
    """(train rows, held-out rows) of ``n`` calibration sequences: the last ``heldout_frac`` are held out."""
    if heldout_frac <= 0:
        return slice(0, n), slice(0, 0)
    k = max(1, int(round(n * heldout_frac)))
    if k >= n:
        raise TcalError(
            f"{n} calibration sequence(s) cannot be split into training and held-out parts "
            f"(held-out fraction {heldout_frac}); give at least 2 sequences or set heldout_frac=0"
        )
    return slice(0, n - k), slice(n - k, n)


def _calib(calib_ids) -> torch.Tensor:
    if calib_ids is None:
        raise TcalError("this init needs calibration tokens: pass calib_ids (sequences x tokens)")
    calib_ids = torch.as_tensor(calib_ids)
    if calib_ids.dim() == 1:
        calib_ids = calib_ids[None]
    return calib_ids


def _capture_all(hybrid, teacher, calib_ids, batch_size, progress, with_ctx=True):
    gdns = hybrid.gdn_modules()
    dev = gdn_device_dtype(next(iter(gdns.values())))[0]
    return capture_teacher_io(teacher, calib_ids, sorted(gdns), batch_size=batch_size, with_ctx=with_ctx,
                              device=dev, progress=progress)


def init_phase1(hybrid, teacher, *, calib_ids=None, stats=None, phase1: str = "reference", align=None,
                batch_size: int = 4, progress: bool = False, **switches) -> dict:
    """copy + Phase 1. Phase 1 sees only the training part of ``calib_ids`` (as in ``taylor``)."""
    from tcal.align import AlignConfig

    calib_ids = _calib(calib_ids)
    align = align or AlignConfig()
    train, _ = split_calibration(calib_ids.shape[0], align.heldout_frac)
    ids = calib_ids[train]
    captured = _capture_all(hybrid, teacher, ids, batch_size, progress)
    records = apply_phase1(hybrid, teacher, ids, stats, phase1, captured=captured, batch_size=batch_size,
                           progress=progress, **switches)
    return {"phase1": records}


def init_phase2(hybrid, teacher, *, calib_ids=None, stats=None, phase1: str = "reference", align=None,
                batch_size: int = 4, progress: bool = False, **switches) -> dict:
    """copy + Phase 2 (layer-local alignment from the copy init)."""
    from tcal.align import AlignConfig, align_layers

    calib_ids = _calib(calib_ids)
    captured = _capture_all(hybrid, teacher, calib_ids, batch_size, progress, with_ctx=False)
    records = align_layers(hybrid, captured, align or AlignConfig(), progress=progress)
    return {"phase2": records}


def init_taylor(hybrid, teacher, *, calib_ids=None, stats=None, phase1: str = "reference", align=None,
                batch_size: int = 4, progress: bool = False, **switches) -> dict:
    """Phase 1 (on the training part of ``calib_ids``) then Phase 2, from one teacher pass."""
    from tcal.align import AlignConfig, align_layers

    calib_ids = _calib(calib_ids)
    align = align or AlignConfig()
    train, _ = split_calibration(calib_ids.shape[0], align.heldout_frac)
    captured = _capture_all(hybrid, teacher, calib_ids, batch_size, progress)
    train_io = {i: io.select(train) for i, io in captured.items()}
    p1 = apply_phase1(hybrid, teacher, calib_ids[train], stats, phase1, captured=train_io,
                      batch_size=batch_size, progress=progress, **switches)
    p2 = align_layers(hybrid, captured, align, progress=progress)
    return {"phase1": p1, "phase2": p2}


def _with_phase1(fn, variant: str):
    """``fn`` with another default Phase 1 variant; keeps fn's full signature (callers inspect it)."""
    strategy = functools.partial(fn, phase1=variant)
    strategy.__name__ = f"{fn.__name__}_{variant.replace('-', '_')}"
    strategy.__doc__ = f"{fn.__doc__} Phase 1 variant defaults to {variant!r}."
    return strategy


STRATEGIES = {
    "phase1": init_phase1,
    "phase2": init_phase2,
    "taylor": init_taylor,
    "phase1-exact": _with_phase1(init_phase1, "exact"),
    "taylor-exact": _with_phase1(init_taylor, "exact"),
    "taylor-exact-silent": _with_phase1(init_taylor, "exact-silent"),
}


def register_strategies() -> None:
    """Add phase1 / phase2 / taylor (+ phase1-exact / taylor-exact / taylor-exact-silent) to ``tcal.convert.INITS``.

    Each is fn(hybrid, teacher, *, calib_ids, stats=None, phase1="reference", align=AlignConfig(),
    batch_size=4, progress=False, **switches) -> report dict; it needs calib_ids.
    """
    from tcal.convert import INITS

    for name, fn in STRATEGIES.items():
        INITS[name] = fn
