"""Reference gated delta rule: a plain fp32 token-by-token loop.

This is the ground truth every other implementation is tested against. It follows
the recurrence of docs/method.md literally:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T      S: (K, V)
    o_t = S_t^T (q_t * scale)
"""
from __future__ import annotations

import torch


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,  # (B, T, H, K)
    k: torch.Tensor,  # (B, T, H, K)
    v: torch.Tensor,  # (B, T, H, V)
    g: torch.Tensor,  # (B, T, H) log decay, <= 0
    beta: torch.Tensor,  # (B, T, H) write strength in [0, 1]
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # (B, H, K, V)
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        k_t = k[:, t]  # (B, H, K)
        recalled = torch.einsum("bhk,bhkv->bhv", k_t, S)  # k^T S
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V, dtype=torch.float32)
    return o.to(dtype), (S if output_final_state else None)
