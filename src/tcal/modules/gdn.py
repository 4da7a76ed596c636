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

from tcal.modules.conv import ShortConvolution, causal_conv, conv_step
from tcal.modules.gdn_shape import GDNShape
from tcal.modules.norms import HeadRMSNorm, head_norm, l2norm
from tcal.ops import fused_gdn_step, fused_gdn_step_available, gated_delta_rule, norm_gated_available, rms_norm_gated
from tcal.utils import compat


def inverse_softplus(r) -> torch.Tensor:
    """softplus^-1(r) = r + log(-expm1(-r)) = log(exp(r) - 1), stable for small and large r > 0."""
    r = torch.as_tensor(r, dtype=torch.float32)
    return r + torch.log(-torch.expm1(-r))


def gate_values(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), each (B, T, H) fp32, from the a / b projections (B, T, H): log decay
    g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b). With ``keep`` (B, T),
    0 at padded positions: no decay and no write there, so the state passes through untouched."""
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    if keep is not None:
        g = g * keep[..., None]
        beta = beta * keep[..., None]
    return g, beta


def prefill_inputs(
    y: torch.Tensor,  # (B, T, 3 n (+ n) + 2 H): packed projections q k v (g) a b, n = H d
    conv_window: torch.Tensor | None,  # (B, 3 n, W - 1): the last W - 1 conv inputs before this call
    taps: torch.Tensor | None,  # (3 n, W) conv filters of q, k, v; None without short convs
    keep: torch.Tensor | None,  # (B, T), 0 at padded positions
    A_log: torch.Tensor,  # (H,)
    dt_bias: torch.Tensor,  # (H,)
    heads: int,
    head_dim: int,
    output_gate: bool,
    qk_norms: tuple | None = None,  # (q weight, k weight, eps) with per-head q/k RMSNorm
):
    """Everything ``GatedDeltaNet.qkv`` and ``gates`` compute, from one packed projection: q, k
    (l2-normalised) and v (B, T, H, d), g and beta (B, T, H) fp32, the output gate (B, T, H, d) or None,
    and the new conv window (B, 3 n, W - 1) or None. The conv is ``causal_conv``'s element-wise form, so
    that compiled it fuses with the SiLU and the norms."""
    B, T, _ = y.shape
    H, d = heads, head_dim
    n = H * d
    qkv = y[..., : 3 * n]
    if keep is not None:  # padded positions read as zeros, exactly like an unpadded start
        qkv = qkv * keep[..., None].to(qkv.dtype)
    window = None
    if taps is not None:
        qkv, window = causal_conv(qkv, conv_window, taps)
    qkv = F.silu(qkv).view(B, T, 3 * H, d)
    q, k, v = qkv[:, :, :H], qkv[:, :, H : 2 * H], qkv[:, :, 2 * H :]
    if qk_norms is not None:
        wq, wk, eps = qk_norms
        q, k = head_norm(q, None, wq, eps), head_norm(k, None, wk, eps)
    gate = y[..., 3 * n : 4 * n].view(B, T, H, d) if output_gate else None
    g, beta = gate_values(y[..., -2 * H : -H], y[..., -H:], A_log, dt_bias, keep)
    return l2norm(q).contiguous(), l2norm(k).contiguous(), v.contiguous(), g, beta, gate, window


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
        self.b_proj = nn.Linear(D, H, bias=shape.beta_bias)
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

    def gates(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta), each (B, T, H): log decay and write strength (``gate_values``)."""
        return gate_values(self.a_proj(x), self.b_proj(x), self.A_log, self.dt_bias, keep)

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
        g, beta = self.gates(x, keep)
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
        if getattr(cache, "is_tcal_static", False):
            return self.forward_static(hidden_states, cache, keep), None
        conv_state, state = compat.get_gdn_state(cache, self.layer_idx) if cache is not None else (None, None)
        o, state, conv_state = self.recurrent(
            hidden_states, keep, state, conv_state, output_final_state=cache is not None
        )
        if cache is not None:
            compat.set_gdn_state(cache, self.layer_idx, conv_state, state)
        return self.mix(hidden_states, o), None

    # -- inference on a static cache (tcal.models.fast) ---------------------------------------------

    def forward_static(self, x: torch.Tensor, cache, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` on a cache whose conv window and recurrent state live at fixed addresses: they are
        read as this call's initial state (zeros on a fresh cache, the same as no state) and overwritten
        in place, so the call can be captured in a CUDA graph and replayed."""
        conv_state, state = cache.gdn_state(self.layer_idx)
        packed = cache.packed.get(self.layer_idx)
        if x.shape[1] == 1 and keep is None:
            return self.decode_step(x, conv_state, state, packed, cache.fused)
        if packed is not None:
            return self.prefill_packed(x, conv_state, state, packed, keep, cache.fused, cache.glue)
        o, new_state, new_conv = self.recurrent(x, keep, state, conv_state, output_final_state=True)
        state.copy_(new_state)
        if new_conv is not None:
            conv_state.copy_(new_conv)
        return self.mix(x, o)

    def prefill_packed(self, x: torch.Tensor, conv_state: torch.Tensor | None, state: torch.Tensor, packed: dict,
                       keep: torch.Tensor | None = None, fused: bool = False, glue: dict | None = None) -> torch.Tensor:
        """A prompt (B, T, hidden) -> (B, T, hidden) through one packed projection GEMM, with conv_state and
        state updated in place; computes what ``forward`` computes. ``glue`` may hold compiled copies of
        ``prefill_inputs`` ("inputs") and ``head_norm`` ("norm"): the element-wise work between the GEMMs
        and fla's kernel is then a few fused kernels instead of one launch per op over T x H x d."""
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        glue = glue or {}
        y = F.linear(x, packed["weight"], packed["bias"])  # (B, T, P): q k v (g) a b
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.shape.qk_norm else None
        q, k, v, g, beta, gate, window = glue.get("inputs", prefill_inputs)(
            y, conv_state, packed["conv"], keep, self.A_log, self.dt_bias, H, d, self.shape.output_gate, norms)
        o, new_state = gated_delta_rule(
            q, k, v, g, beta, scale=d**-0.5, initial_state=state, output_final_state=True,
            backend=self.shape.backend, chunk_size=self.shape.chunk_size,
        )
        state.copy_(new_state)
        if window is not None:
            conv_state.copy_(window)
        if fused and gate is not None and norm_gated_available(x.device):
            normed = rms_norm_gated(o, gate, self.o_norm.weight, self.o_norm.eps)
        else:
            normed = glue.get("norm", head_norm)(o, gate, self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(normed.reshape(B, T, -1))

    def _projections(self) -> list[nn.Linear]:
        lins = [self.q_proj, self.k_proj, self.v_proj]
        if self.shape.output_gate:
            lins.append(self.g_proj)
        return lins + [self.a_proj, self.b_proj]

    @torch.no_grad()
    def packed_weights(self) -> dict[str, torch.Tensor | None]:
        """One (out, hidden) matrix for q, k, v, (g,) a, b (a decode token then takes one GEMM instead of
        five or six), its bias, and the three conv filters as one (3 H d, W) tap matrix. Copies: the
        module's own parameters, and so its checkpoint names, are untouched."""
        lins = self._projections()
        weight = torch.cat([lin.weight for lin in lins], 0)
        bias = None
        if any(lin.bias is not None for lin in lins):
            bias = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                              for lin in lins])
        conv = None
        if self.shape.use_short_conv:
            conv = torch.cat([c.weight[:, 0, :] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], 0)
        return {"weight": weight, "bias": bias, "conv": conv}

    def decode_step(self, x: torch.Tensor, conv_state: torch.Tensor | None, state: torch.Tensor,
                    packed: dict | None = None, fused: bool = False) -> torch.Tensor:
        """One token (B, 1, hidden) -> (B, 1, hidden), conv_state and state updated in place.

        ``packed`` (from ``packed_weights``) replaces the separate projections by one GEMM; ``fused`` takes
        fla's one-kernel step (l2 norm, gates and recurrence) and its gated RMSNorm where they exist.
        Without either it computes exactly what ``forward`` computes for one token.
        """
        B = x.shape[0]
        H, d = self.num_heads, self.head_dim
        n = H * d
        x2 = x.reshape(B, -1)
        if packed is not None:
            y = F.linear(x2, packed["weight"], packed["bias"])
            sizes = [lin.out_features for lin in self._projections()]
            parts = list(y.split(sizes, dim=-1))
        else:
            parts = [lin(x2) for lin in self._projections()]
        gate = parts[3] if self.shape.output_gate else None
        a, b = parts[-2:]
        qkv = y[:, : 3 * n] if packed is not None else torch.cat(parts[:3], -1)
        if self.shape.use_short_conv:
            taps = packed["conv"] if packed is not None else torch.cat(
                [c.weight[:, 0, :] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], 0)
            qkv = conv_step(qkv, conv_state, taps)
        qkv = F.silu(qkv).view(B, 1, 3 * H, d)
        q, k, v = qkv[:, :, :H], qkv[:, :, H : 2 * H], qkv[:, :, 2 * H :]
        if self.shape.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        a, b = a.view(B, 1, H), b.view(B, 1, H)
        scale = d**-0.5
        if fused and fused_gdn_step_available(x.device):
            o, new_state = fused_gdn_step(q, k, v, a, b, self.A_log, self.dt_bias, scale, state)
        else:
            g, beta = gate_values(a, b, self.A_log, self.dt_bias)
            o, new_state = gated_delta_rule(
                l2norm(q), l2norm(k), v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                backend=self.shape.backend, chunk_size=self.shape.chunk_size,
            )
        state.copy_(new_state)
        gate = gate.view(B, 1, H, d) if gate is not None else None
        if fused and gate is not None and norm_gated_available(x.device):
            normed = rms_norm_gated(o, gate, self.o_norm.weight, self.o_norm.eps)
        else:
            normed = self.o_norm(o, gate)
        return self.o_proj(normed.reshape(B, 1, -1))
