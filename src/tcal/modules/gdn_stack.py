"""Several GatedDeltaNet layers of one shape run as one: weights and inputs stacked on a leading layer axis.

Phase 2 fits every converted layer on its own teacher activations, so the fits are independent and can
run side by side: G layers' steps then take one batched GEMM per projection and one call of the gated
delta rule (layers folded into the batch), instead of G small launches of each. A layer's output in the
stack is the one ``GatedDeltaNet.forward`` computes on the same input, without a cache or padding
(tested per layer, outputs and gradients). The stack holds copies of the layers' parameters:
``write_back`` puts them back into the layers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from tcal.modules.gdn import GatedDeltaNet, gate_values
from tcal.modules.norms import head_norm, l2norm
from tcal.ops import gated_delta_rule
from tcal.utils.errors import TcalError


def _key(name: str) -> str:  # ParameterDict keys cannot hold dots
    return name.replace(".", "__")


class GDNStack(nn.Module):
    def __init__(self, layers: Sequence[GatedDeltaNet]):
        super().__init__()
        if not layers:
            raise TcalError("a GDN stack needs at least one layer")
        shape = layers[0].shape
        if any(g.shape != shape for g in layers[1:]):
            raise TcalError("the layers of a GDN stack must share one GDNShape")
        self.shape = shape
        self.num_heads, self.head_dim = layers[0].num_heads, layers[0].head_dim
        self.layers = list(layers)  # a plain list: the stack's parameters are its own copies
        self.names = [n for n, _ in layers[0].named_parameters()]
        self.params = nn.ParameterDict()
        with torch.no_grad():
            for n in self.names:
                stacked = torch.stack([g.get_parameter(n).detach() for g in layers])  # (G, *param shape)
                self.params[_key(n)] = nn.Parameter(stacked.clone(), requires_grad=layers[0].get_parameter(n).requires_grad)

    def __len__(self) -> int:
        return len(self.layers)

    def param(self, name: str) -> nn.Parameter:
        """The stacked (G, ...) tensor of the layers' parameter ``name`` (e.g. ``"q_proj.weight"``)."""
        return self.params[_key(name)]

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy each layer's slice of the stacked parameters into that layer."""
        for n in self.names:
            stacked = self.param(n)
            for i, g in enumerate(self.layers):
                g.get_parameter(n).copy_(stacked[i])

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x (G, B, T, in) through every layer's own nn.Linear ``name`` -> (G, B, T, out)."""
        G, B, T, D = x.shape
        w = self.param(f"{name}.weight")  # (G, out, in)
        y = torch.bmm(x.reshape(G, B * T, D), w.transpose(1, 2))
        if f"{name}.bias" in self.names:
            y = y + self.param(f"{name}.bias")[:, None, :]
        return y.view(G, B, T, -1)

    def _conv(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Causal depthwise conv from a zero prefix (``ShortConvolution`` without a state): x (G, B, T, C)."""
        taps = self.param(f"{name}.weight")[:, :, 0, :].float()  # (G, C, W)
        T, W = x.shape[2], taps.shape[-1]
        full = F.pad(x, (0, 0, W - 1, 0))  # (G, B, W - 1 + T, C)
        acc = full[:, :, :T].float() * taps[:, None, None, :, 0]
        for j in range(1, W):
            acc = acc + full[:, :, j : j + T].float() * taps[:, None, None, :, j]
        return acc.to(x.dtype)

    def _head_weight(self, name: str) -> torch.Tensor:  # (G, d) -> (G, 1, 1, 1, d) against (G, B, T, H, d)
        return self.param(name)[:, None, None, None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (G, B, T, hidden): each layer's normed input -> (G, B, T, hidden), each layer's attention output."""
        G, B, T, _ = x.shape
        if G != len(self.layers):
            raise TcalError(f"a stack of {len(self.layers)} GDN layers got inputs for {G}")
        H, d = self.num_heads, self.head_dim
        q, k, v = (self._linear(x, p) for p in ("q_proj", "k_proj", "v_proj"))
        if self.shape.use_short_conv:
            q, k, v = (self._conv(t, c) for t, c in ((q, "q_conv1d"), (k, "k_conv1d"), (v, "v_conv1d")))
        q, k, v = (F.silu(t).view(G, B, T, H, d) for t in (q, k, v))
        if self.shape.qk_norm:
            eps = self.layers[0].q_norm.eps
            q = head_norm(q, None, self._head_weight("q_norm.weight"), eps)
            k = head_norm(k, None, self._head_weight("k_norm.weight"), eps)
        q, k = l2norm(q), l2norm(k)
        per_head = (G, 1, 1, H)
        g, beta = gate_values(self._linear(x, "a_proj"), self._linear(x, "b_proj"),
                              self.param("A_log").view(per_head), self.param("dt_bias").view(per_head))
        o, _ = gated_delta_rule(  # layers folded into the batch: (G B, T, H, d)
            q.reshape(G * B, T, H, d), k.reshape(G * B, T, H, d), v.reshape(G * B, T, H, d),
            g.reshape(G * B, T, H), beta.reshape(G * B, T, H), scale=d**-0.5,
            backend=self.shape.backend, chunk_size=self.shape.chunk_size,
        )
        o = o.view(G, B, T, H, d)
        gate = self._linear(x, "g_proj").view(G, B, T, H, d) if self.shape.output_gate else None
        normed = head_norm(o, gate, self._head_weight("o_norm.weight"), self.layers[0].o_norm.eps)
        return self._linear(normed.reshape(G, B, T, H * d), "o_proj")
