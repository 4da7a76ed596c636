"""Phase 1's formulas as pure functions of the teacher's statistics (docs/method.md)."""
from __future__ import annotations

import math

import torch

from tcal.modules.gdn import inverse_softplus
from tcal.taylor.statistics import sum_per_head

LN2 = math.log(2.0)


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
    logit stays about 0: the realised beta does not follow beta* (docs/method.md).
    """
    w = w_b.float()
    fan_in = w.shape[1]
    w_abs = w.abs().mean(dim=1, keepdim=True).clamp_min(1e-8)
    return (target_logit.float().to(w.device) / math.sqrt(fan_in)).unsqueeze(1) * w / w_abs


def exact_b_bias(w_b: torch.Tensor, x_mean: torch.Tensor, target_logit: torch.Tensor) -> torch.Tensor:
    """b_b with mean_t (W_b x_t + b_b) = logit(beta*): b_b = logit(beta*) - W_b mean_t(x_t)."""
    return target_logit.float().to(w_b.device) - w_b.float() @ x_mean.float().to(w_b.device)


def exact_b_weight(w_b: torch.Tensor, x: torch.Tensor, target_logit: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """W_b' for a b_proj without a bias: the linear map closest, by least squares over the calibration
    inputs x (N, D), to the exact write gate W_b x + b_b of :func:`exact_b_bias`.

    W_b' = W_b + c s^T with c = logit(beta*) - W_b mean(x) (H,) and s (D,) the ridge regression of the
    constant 1 on x, s = (X^T X + lambda I)^-1 X^T 1 (lambda = ``ridge`` times the mean eigenvalue of X^T X):
    one solve serves every head, since each head adds its own multiple of the same constant. The mean
    logit then equals logit(beta*) as far as a linear function of x can hold a constant; the realised
    mean is measured by the caller.
    """
    X = x.reshape(-1, x.shape[-1]).double()
    gram = X.T @ X
    lam = ridge * float(gram.diagonal().mean().clamp_min(1e-30))
    s = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device), X.sum(0))
    c = exact_b_bias(w_b, X.mean(0), target_logit).double()
    return (w_b.double() + c[:, None] * s[None, :].to(c.device)).to(w_b.dtype)


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


