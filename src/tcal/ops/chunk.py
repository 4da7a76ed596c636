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

``chunk_gated_delta_rule_torch`` passes S from chunk to chunk in a loop; ``chunk_scan_gated_delta_rule_torch``
computes the same states with a parallel scan (log2 N rounds for N chunks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunk_terms(q, k, v, g, beta, scale, chunk_size):
    """The state-free terms of the chunked form, every chunk at once, in (B, H, N, C, D) layout (heads and
    chunks are batch dimensions of every matmul): q exp(G), U, W, the causal intra-chunk products, each
    chunk's total decay exp(G_C) and its keys decayed to the chunk end."""
    B, T, H, K = q.shape
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    # Padding with g = 0, beta = 0 leaves the state untouched, so the tail chunk is exact.
    pad = (C - T % C) % C
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    N = (T + pad) // C

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

    intra = (q @ k.transpose(-1, -2)) * decay  # (B,H,N,C,C), causal incl. diagonal
    G_last = G[..., -1]  # (B, H, N)
    k_tail = k * (G_last[..., None] - G).exp()[..., None]  # keys decayed to the chunk end
    return q * G.exp()[..., None], U, W, intra, G_last.exp(), k_tail


def _output(o: torch.Tensor, T: int, dtype) -> torch.Tensor:
    B, H, N, C, V = o.shape  # (B, H, N, C, V) -> (B, T, H, V)
    return o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2).to(dtype)


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
    B, T, H, K = q.shape
    V = v.shape[-1]
    qg, U, W, intra, decay_last, k_tail = _chunk_terms(q, k, v, g, beta, scale, chunk_size)
    S = qg.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for n in range(qg.shape[2]):
        v_new = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, V)
        outs.append(qg[:, :, n] @ S + intra[:, :, n] @ v_new)
        S = S * decay_last[:, :, n, None, None] + k_tail[:, :, n].transpose(-1, -2) @ v_new
    return _output(torch.stack(outs, dim=2), T, v.dtype), (S if output_final_state else None)


def chunk_scan_gated_delta_rule_torch(
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
    """The chunked form with the state passed between chunks by a parallel scan instead of a loop.

    Across a chunk the state moves affinely, S' = M S + R with M = exp(G_C) I - k_tail^T W (K x K) and
    R = k_tail^T U (K x V), and maps of that form compose associatively, (M2, R2) after (M1, R1) =
    (M2 M1, M2 R1 + R2). An inclusive scan over the N chunks in log2 N doubling rounds gives every chunk's
    entering state, then every output at once. It multiplies more (N log N K x K products against the
    loop's N) but launches a number of kernels that grows with log N, not N: for long sequences on a GPU,
    where the loop's small per-chunk kernels leave the device waiting on the host."""
    B, T, H, K = q.shape
    qg, U, W, intra, decay_last, k_tail = _chunk_terms(q, k, v, g, beta, scale, chunk_size)
    N = qg.shape[2]
    k_tail_t = k_tail.transpose(-1, -2)  # (B, H, N, K, C)
    eye = torch.eye(K, dtype=qg.dtype, device=qg.device)
    M = decay_last[..., None, None] * eye - k_tail_t @ W  # (B, H, N, K, K)
    R = k_tail_t @ U  # (B, H, N, K, V)
    shift = 1
    while shift < N:  # after the round, chunk n's map covers chunks max(0, n - 2 shift + 1) .. n
        M, R = (torch.cat([M[:, :, :shift], M[:, :, shift:] @ M[:, :, :-shift]], dim=2),
                torch.cat([R[:, :, :shift], M[:, :, shift:] @ R[:, :, :-shift] + R[:, :, shift:]], dim=2))
        shift *= 2
    after = R if initial_state is None else M @ initial_state.float()[:, :, None] + R  # state after chunk n
    first = qg.new_zeros(B, H, 1, K, after.shape[-1]) if initial_state is None else initial_state.float()[:, :, None]
    before = torch.cat([first, after[:, :, :-1]], dim=2)  # (B, H, N, K, V): the state entering chunk n
    v_new = U - W @ before
    o = qg @ before + intra @ v_new
    return _output(o, T, v.dtype), (after[:, :, -1] if output_final_state else None)
