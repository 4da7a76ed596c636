"""Least squares in output space. Let u_t (H*d) be the normed recurrent output times the gate,
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

from dataclasses import dataclass

import torch


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


