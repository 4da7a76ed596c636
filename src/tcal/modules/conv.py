"""Causal depthwise short convolution over time, with its state for incremental decoding."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ShortConvolution(nn.Conv1d):
    """Causal depthwise conv over time. Input/output (B, T, C); state = last (W - 1) inputs (B, C, W - 1)."""

    def __init__(self, channels: int, width: int):
        super().__init__(channels, channels, width, groups=channels, bias=False, padding=0)

    def forward(self, x: torch.Tensor, prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        W = self.kernel_size[0]
        x = x.transpose(1, 2)  # (B, C, T)
        if prefix is None:
            prefix = x.new_zeros(x.shape[0], x.shape[1], W - 1)
        full = torch.cat([prefix.to(x.dtype), x], dim=-1)
        y = F.conv1d(full, self.weight, groups=self.groups)
        return y.transpose(1, 2), full[..., -(W - 1) :]


