"""Gated delta rule implementations, side by side:

    naive.py     fp32 token loop: the reference every other path is tested against
    chunk.py     chunked pure PyTorch (WY form): the CPU default and the GPU training fallback; its state
                 passed between chunks by a loop, or by a parallel scan (backend "scan")
    dispatch.py  gated_delta_rule(): picks naive / chunk / fla (flash-linear-attention on CUDA)
    fused.py     fla's fused inference kernels (one-token GDN step with in-kernel gating, gated RMSNorm)
"""
from tcal.ops.chunk import chunk_gated_delta_rule_torch, chunk_scan_gated_delta_rule_torch
from tcal.ops.dispatch import (
    BACKENDS,
    compile_by_default,
    compile_training,
    fla_available,
    fla_backward_ok,
    gated_delta_rule,
    resolve_backend,
    set_compile,
    torch_only,
)
from tcal.ops.fused import fused_gdn_step, fused_gdn_step_available, norm_gated_available, rms_norm_gated
from tcal.ops.naive import naive_recurrent_gated_delta_rule

__all__ = [
    "BACKENDS",
    "chunk_gated_delta_rule_torch",
    "chunk_scan_gated_delta_rule_torch",
    "compile_by_default",
    "compile_training",
    "fla_available",
    "fla_backward_ok",
    "fused_gdn_step",
    "fused_gdn_step_available",
    "gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "norm_gated_available",
    "resolve_backend",
    "rms_norm_gated",
    "set_compile",
    "torch_only",
]
