"""`tcal.convert`: teacher + which layers to keep -> initialised hybrid."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tcal.errors import TcalError
from tcal.hybrid import HybridForCausalLM, build_hybrid

# name -> function(hybrid, teacher, **context) that initialises the GDN layers in place.
INITS: dict[str, Callable] = {}


def register_init(name: str):
    def deco(fn):
        INITS[name] = fn
        return fn

    return deco


@register_init("copy")
def _init_copy(hybrid: HybridForCausalLM, teacher, **_):
    """Copied projections, fla-default init for the rest (done by build_hybrid)."""


@register_init("zero-gate")
@torch.no_grad()
def _init_zero_gate(hybrid: HybridForCausalLM, teacher, **_):
    """Copy + W_g = 0: SiLU(0) = 0, so every GDN layer starts silent."""
    for gdn in hybrid.gdn_modules().values():
        if not gdn.shape.output_gate:
            raise TcalError("init 'zero-gate' needs the output gate; drop output_gate=False")
        gdn.g_proj.weight.zero_()


def convert(
    teacher,
    keep: Sequence[int] | str,
    init: str = "copy",
    *,
    seed: int = 0,
    **options,
) -> HybridForCausalLM:
    """Build a hybrid of ``teacher`` keeping ``keep`` as softmax attention, GDN elsewhere.

    ``init`` picks how the GDN layers start: one of ``tcal.convert.INITS``.
    GDN construction options (``use_short_conv``, ``output_gate``, ``backend``...) pass through.
    """
    if init not in INITS:
        raise TcalError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    if isinstance(keep, str):
        keep = [int(x) for x in keep.split(",") if x.strip()] if keep.replace(",", "").strip().isdigit() else keep
        if isinstance(keep, str):
            raise TcalError(f"keep {keep!r} is not a list of layer indices like '0,4,8'")
    hybrid = build_hybrid(teacher, keep, seed=seed, **options)
    INITS[init](hybrid, teacher)
    hybrid.config.tcal_init = init
    return hybrid
