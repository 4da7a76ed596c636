"""Chunked gated delta rule in pure PyTorch (the CPU default).

Within a chunk of C tokens the delta rule's sequential updates are folded into one
triangular solve (the WY / UT representation of Yang et al., "Gated Delta Networks"),
so the only Python loop runs over chunks, never over tokens.

With G_i the cumulative log decay inside a chunk and A the strictly lower-triangular
matrix A_ij = beta_i exp(G_i - G_j) k_i.k_j, the chunk's pseudo-values are
U = (I + A)^-1 (beta * V) and its decayed write keys W = (I + A)^-1 (beta * exp(G) * K).
Then, with S the state entering the chunk:

    V_new = U - W S
    O     = exp(G) Q S + tril(exp(G_i - G_j) Q K^T) V_new
    S'    = exp(G_C) S + (exp(G_C - G) * K)^T V_new
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,  # (B, T, H, K)
    k: torch.Tensor,  # (B, T, H, K)
    v: torch.Tensor,  # (B, T, H, V)
    g: torch.Tensor,  # (B, T, H)
    beta: torch.Tensor,  # (B, T, H)
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # (B, H, K, V)
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale

    # Padding with g = 0, beta = 0 leaves the state untouched, so the tail chunk is exact.
    pad = (C - T % C) % C
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    N = (T + pad) // C

    # (B, H, N, C, D) layout: heads and chunks are batch dimensions of every matmul below.
    def split(x):
        return x.transpose(1, 2).reshape(B, H, N, C, *x.shape[3:])

    q, k, v = split(q) * scale, split(k), split(v)
    g, beta = split(g), split(beta)  # (B, H, N, C)
    G = g.cumsum(-1)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) only where i >= j; masking before exp avoids overflow above the diagonal.
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B,H,N,C,C)

    k_beta = k * beta[..., None]
    A = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    IA = A + eye
    U = torch.linalg.solve_triangular(IA, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(IA, k_beta * G.exp()[..., None], upper=False, unitriangular=True)

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    intra = (q @ k.transpose(-1, -2)) * decay  # (B,H,N,C,C), causal incl. diagonal
    G_last = G[..., -1]  # (B, H, N)
    k_tail = k * (G_last[..., None] - G).exp()[..., None]  # keys decayed to the chunk end

    outs = []
    for n in range(N):
        v_new = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, V)
        o = (q[:, :, n] * G[:, :, n, :, None].exp()) @ S + intra[:, :, n] @ v_new
        outs.append(o)
        S = S * G_last[:, :, n, None, None].exp() + k_tail[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(dtype), (S if output_final_state else None)
