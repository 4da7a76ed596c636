"""Construction options of a GatedDeltaNet layer (plain data, no torch).

The one declaration of the GDN options: ``HybridConfig`` stores each option after the size fields as
``gdn_<name>`` (:data:`GDN_OPTIONS`), and rebuilds a GDNShape from them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class GDNShape:
    # sizes: the teacher's
    hidden_size: int
    num_heads: int
    head_dim: int
    # options
    use_short_conv: bool = False
    conv_size: int = 4
    qkv_bias: bool = False
    # a bias on b_proj (the write gate's logit): Phase 1's exact write gate sets it; the serving layout has none
    beta_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False
    output_gate: bool = True
    norm_eps: float = 1e-5
    backend: str = "auto"
    chunk_size: int = 64




SIZES = ("hidden_size", "num_heads", "head_dim")
GDN_OPTIONS = tuple(f for f in fields(GDNShape) if f.name not in SIZES)
