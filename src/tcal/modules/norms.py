"""Norms of the GDN layer: the l2 norm of q and k, and a per-head RMSNorm with an optional SiLU gate."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same epsilon placement as fla's in-kernel l2norm.
    return x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + eps).to(x.dtype)


def head_norm(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension times ``weight``, optionally gated by SiLU(gate): ``HeadRMSNorm`` as a
    function of its weight, so the fast path can compile it."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if gate is not None:
        x = x * F.silu(gate.float())
    return x.to(dtype)


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last (head) dimension, optionally gated by SiLU(gate)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return head_norm(x, gate, self.weight, self.eps)


