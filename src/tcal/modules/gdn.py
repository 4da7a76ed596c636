"""The Gated DeltaNet layer that replaces a softmax-attention layer (docs/method.md).

Parameter names follow flash-linear-attention so weights move between the two:
q_proj k_proj v_proj a_proj b_proj g_proj o_proj A_log dt_bias o_norm
(+ q_conv1d k_conv1d v_conv1d with short convs, q_norm k_norm with q/k norm).

The module is called exactly like the teacher's attention module (same keyword
arguments, returns ``(output, None)``), so the teacher's own decoder layers drive it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tcal.modules.config import GDNShape
from tcal.modules.conv import ShortConvolution
from tcal.modules.norms import HeadRMSNorm, l2norm
from tcal.ops import gated_delta_rule
from tcal.utils import compat


def inverse_softplus(r) -> torch.Tensor:
    """softplus^-1(r) = r + log(-expm1(-r)) = log(exp(r) - 1), stable for small and large r > 0."""
    r = torch.as_tensor(r, dtype=torch.float32)
    return r + torch.log(-torch.expm1(-r))


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: GDNShape, layer_idx: int):
        super().__init__()
        self.shape = shape
        self.layer_idx = layer_idx
        H, d, D = shape.num_heads, shape.head_dim, shape.hidden_size
        self.num_heads, self.head_dim = H, d
        self.q_proj = nn.Linear(D, H * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(D, H * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(D, H * d, bias=shape.qkv_bias)
        self.a_proj = nn.Linear(D, H, bias=False)
        self.b_proj = nn.Linear(D, H, bias=True)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H))
        if shape.use_short_conv:
            self.q_conv1d = ShortConvolution(H * d, shape.conv_size)
            self.k_conv1d = ShortConvolution(H * d, shape.conv_size)
            self.v_conv1d = ShortConvolution(H * d, shape.conv_size)
        if shape.qk_norm:
            self.q_norm = HeadRMSNorm(d, shape.norm_eps)
            self.k_norm = HeadRMSNorm(d, shape.norm_eps)
        if shape.output_gate:
            self.g_proj = nn.Linear(D, H * d, bias=False)
        self.o_norm = HeadRMSNorm(d, shape.norm_eps)
        self.o_proj = nn.Linear(H * d, D, bias=shape.o_bias)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """fla's default initialisation (what `init="copy"` leaves on non-copied parameters)."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.o_proj,
                    getattr(self, "g_proj", None)):
            if lin is None:
                continue
            lin.weight.normal_(0.0, std, generator=generator)
            if lin.bias is not None:
                lin.bias.zero_()
        H = self.num_heads
        dev = self.A_log.device
        self.A_log.copy_(torch.empty(H, device=dev).uniform_(1, 16, generator=generator).log())
        dt = torch.empty(H, device=dev).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(inverse_softplus(dt))
        if self.shape.use_short_conv:
            # Identity taps: with copied projections the conv starts as a no-op instead of
            # mixing in random neighbours.
            for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
                conv.weight.zero_()
                conv.weight[..., -1] = 1.0
        self.o_norm.weight.fill_(1.0)
        if self.shape.qk_norm:
            self.q_norm.weight.fill_(1.0)
            self.k_norm.weight.fill_(1.0)

    # -- pieces reused by calibration (tcal.taylor.phase1 / phase2) --------------------------------

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta), each (B, T, H): log decay and write strength."""
        beta = torch.sigmoid(self.b_proj(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        return g, beta

    def qkv(
        self, x: torch.Tensor, keep: torch.Tensor | None = None, conv_state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k (l2-normalised) and v, each (B, T, H, d), and the new conv state."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if keep is not None:  # padded positions read as zeros, exactly like an unpadded start
            q, k, v = (t * keep[..., None].to(t.dtype) for t in (q, k, v))
        new_conv_state = None
        if self.shape.use_short_conv:
            n = q.shape[-1]
            prefix = [None] * 3 if conv_state is None else conv_state.split(n, dim=1)
            (q, sq), (k, sk), (v, sv) = (
                conv(t, p) for conv, t, p in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (q, k, v), prefix)
            )
            new_conv_state = torch.cat([sq, sk, sv], dim=1)
        q, k, v = (F.silu(t).view(B, T, self.num_heads, self.head_dim) for t in (q, k, v))
        if self.shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return l2norm(q), l2norm(k), v, new_conv_state

    def mix(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Per-head norm, output gate and W_o: (B, T, H, d) recurrent output -> (B, T, hidden)."""
        B, T = o.shape[:2]
        gate = self.g_proj(x).view(B, T, self.num_heads, self.head_dim) if self.shape.output_gate else None
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))

    def recurrent(self, x: torch.Tensor, keep: torch.Tensor | None = None, initial_state=None, conv_state=None,
                  output_final_state: bool = False):
        """Per-head recurrent output before norm/gate: (o (B, T, H, d), final state, conv state)."""
        q, k, v, new_conv = self.qkv(x, keep, conv_state)
        g, beta = self.gates(x)
        if keep is not None:  # no decay and no write on padding: the state passes through untouched
            g = g * keep[..., None]
            beta = beta * keep[..., None]
        o, state = gated_delta_rule(
            q, k, v, g, beta, scale=self.head_dim**-0.5, initial_state=initial_state,
            output_final_state=output_final_state, backend=self.shape.backend, chunk_size=self.shape.chunk_size,
        )
        return o, state, new_conv

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, hidden): the teacher layer's normed input
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        cache = compat.cache_from_kwargs(kwargs)
        keep = kwargs.get("tcal_keep")  # (B, T) fp32, 0 at padded positions; set by HybridForCausalLM
        conv_state, state = compat.get_gdn_state(cache, self.layer_idx) if cache is not None else (None, None)
        o, state, conv_state = self.recurrent(
            hidden_states, keep, state, conv_state, output_final_state=cache is not None
        )
        if cache is not None:
            compat.set_gdn_state(cache, self.layer_idx, conv_state, state)
        return self.mix(hidden_states, o), None
