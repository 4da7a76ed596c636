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


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One decode token through a causal depthwise conv, its window ``state`` (B, C, W - 1) updated in place
    (so a captured CUDA graph keeps reading the same buffer). x (B, C), weight (C, W); returns (B, C).

    Same result as ``ShortConvolution.forward`` on one token with ``state`` as the prefix: the window is
    the last W - 1 inputs then x, summed against the taps in fp32 and rounded once to x's dtype.
    """
    window = torch.cat([state, x.unsqueeze(-1).to(state.dtype)], dim=-1)  # (B, C, W)
    y = (window.float() * weight.float()).sum(-1).to(x.dtype)
    state.copy_(window[..., 1:])
    return y


def causal_conv(x: torch.Tensor, window: torch.Tensor, taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ShortConvolution.forward`` with ``window`` as the prefix, written element-wise: x (B, T, C),
    window (B, C, W - 1) (the last W - 1 inputs before x), taps (C, W) -> (y (B, T, C), new window
    (B, C, W - 1)). A sum of W shifted products in fp32 rounded once to x's dtype, as ``conv_step`` sums
    its window, so that compiled it fuses with the element-wise work around it (FastDecoder's prefill)."""
    T, W = x.shape[1], taps.shape[-1]
    full = torch.cat([window.transpose(1, 2).to(x.dtype), x], dim=1)  # (B, W - 1 + T, C)
    acc = full[:, :T].float() * taps[:, 0].float()
    for j in range(1, W):
        acc = acc + full[:, j : j + T].float() * taps[:, j].float()
    return acc.to(x.dtype), full[:, T:].transpose(1, 2)
