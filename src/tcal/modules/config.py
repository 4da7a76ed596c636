"""Construction options of a GatedDeltaNet layer (plain data, no torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GDNShape:
    hidden_size: int
    num_heads: int
    head_dim: int
    use_short_conv: bool = False
    conv_size: int = 4
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    output_gate: bool = True
    norm_eps: float = 1e-5
    backend: str = "auto"
    chunk_size: int = 64


