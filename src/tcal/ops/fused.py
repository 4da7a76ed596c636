"""flash-linear-attention's fused inference kernels, where the installed fla has them.

    fused_gdn_step   one decode token of the gated delta rule with the q/k l2 norm, the decay
                     -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) computed inside the
                     recurrent kernel (fla >= 0.5: use_gate_in_kernel / use_beta_sigmoid_in_kernel)
    rms_norm_gated   the GDN output norm RMSNorm(o) * w * silu(gate) as one kernel

Each has an ``*_available(device)`` check; callers keep their PyTorch path for everything else
(CPU, no fla, an fla without the keyword), so these never change what is computed, only how many
kernels it takes.
"""
from __future__ import annotations

import functools
import inspect

import torch

from tcal.ops.dispatch import _fla_ops

_STEP_KWARGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "A_log", "dt_bias")


@functools.lru_cache(maxsize=1)
def _fused_recurrent():
    ops = _fla_ops()
    if ops is None:
        return None
    fn = ops[1]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return fn if all(p in params for p in _STEP_KWARGS) else None


@functools.lru_cache(maxsize=1)
def _norm_gated():
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated
    except Exception:  # ImportError, or triton failing to initialise without a GPU
        return None
    return rms_norm_gated


def fused_gdn_step_available(device: torch.device) -> bool:
    return device.type == "cuda" and _fused_recurrent() is not None


def norm_gated_available(device: torch.device) -> bool:
    return device.type == "cuda" and _norm_gated() is not None


def fused_gdn_step(
    q: torch.Tensor,  # (B, 1, H, K) before the l2 norm
    k: torch.Tensor,  # (B, 1, H, K) before the l2 norm
    v: torch.Tensor,  # (B, 1, H, V)
    a: torch.Tensor,  # (B, 1, H) a_proj output (pre-softplus)
    b: torch.Tensor,  # (B, 1, H) b_proj output (pre-sigmoid)
    A_log: torch.Tensor,  # (H,)
    dt_bias: torch.Tensor,  # (H,)
    scale: float,
    state: torch.Tensor,  # (B, H, K, V) fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o (B, 1, H, V) in v's dtype, new state (B, H, K, V) fp32)."""
    fn = _fused_recurrent()
    o, new_state = fn(
        q=q, k=k, v=v.to(q.dtype), g=a, beta=b, scale=scale, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
    )
    return o.to(v.dtype), new_state


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x, times weight, times silu(gate); in x's dtype."""
    return _norm_gated()(x, gate, weight, None, activation="swish", eps=eps)
