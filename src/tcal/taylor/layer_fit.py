"""A GDN layer's output on teacher-forced inputs, and how well it matches the teacher's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tcal.modules.gdn import GatedDeltaNet


def gdn_device_dtype(gdn: GatedDeltaNet) -> tuple[torch.device, torch.dtype]:
    p = gdn.q_proj.weight
    return p.device, p.dtype


@torch.no_grad()
def recurrent_output(gdn: GatedDeltaNet, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The layer's per-head recurrent output o (N, T, H, d), fp32, computed in batches of sequences."""
    dev, dt = gdn_device_dtype(gdn)
    outs = []
    for s in range(0, x.shape[0], batch_size):
        o, _, _ = gdn.recurrent(x[s : s + batch_size].to(dev, dt))
        outs.append(o.float())
    return torch.cat(outs)


def normed(gdn: GatedDeltaNet, o: torch.Tensor) -> torch.Tensor:
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


