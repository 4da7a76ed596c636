"""Carry out an init spec on a freshly built hybrid (see :mod:`tcal.conversion.inits`)."""
from __future__ import annotations

import dataclasses

import torch

from tcal.conversion.inits import InitSpec, get_init
from tcal.taylor.budget import CALIB_BUDGETS
from tcal.taylor.kl_stage import KLData
from tcal.taylor.pipeline import Calibration, calibrate, prepare
from tcal.taylor.stage_config import AlignConfig, KLConfig
from tcal.utils.errors import TcalError


@torch.no_grad()
def zero_gates(hybrid) -> None:
    """W_g = 0: SiLU(0) = 0, so every GDN layer's output is 0 until W_g learns."""
    for gdn in hybrid.gdn_modules().values():
        if not gdn.shape.output_gate:
            raise TcalError("init 'zero-gate' needs the output gate; drop output_gate=False")
        gdn.g_proj.weight.zero_()


ALIGN_INPUTS = {"local": ("teacher", "attn"), "sequential": ("student", "attn"), "residual": ("student", "residual")}


def stage_configs(spec: InitSpec, align: AlignConfig | None, kl: KLConfig | None) -> tuple[AlignConfig, KLConfig | None]:
    """The Phase-2 and KL-stage settings an init runs with: the caller's budget (steps, batch,
    schedule...) with the init's own choice of how Phase 2 fits the layers."""
    inputs, target = ALIGN_INPUTS[spec.align]
    align = dataclasses.replace(align or AlignConfig(), inputs=inputs, target=target)
    return align, ((kl or CALIB_BUDGETS["reference"].kl) if spec.kl else None)


def initialise(hybrid, teacher, init: str | InitSpec, calibration: Calibration | torch.Tensor | None = None, *,
               align: AlignConfig | None = None, kl: KLConfig | None = None, progress: bool = False,
               kl_data: KLData | None = None, **switches) -> dict:
    """Initialise the GDN layers of ``hybrid`` in place as ``init`` says; returns its record.

    ``calibration``: calibration token ids (N, T) or a prepared :class:`Calibration`, needed by
    calibrated inits. ``align`` / ``kl``: Phase-2 and KL-stage budgets (how Phase 2 fits the
    layers is the init's); ``kl_data``: the KL stage's own sequences (default: the calibration's). ``switches`` are Phase-1 options (see tcal.taylor.phase1.Phase1Options).
    """
    spec = get_init(init)
    if not spec.calibrated and (switches or align is not None or kl is not None):
        given = sorted(switches) + (["align"] if align is not None else []) + (["kl"] if kl is not None else [])
        raise TcalError(f"init {spec.name!r} takes no options; got {', '.join(given)}")
    if spec.calibrated and calibration is None:
        raise TcalError(f"init {spec.name!r} needs calibration tokens: pass calib_ids= or a corpus and tokenizer")
    record: dict = {}
    if spec.zero_gate:
        zero_gates(hybrid)
    if spec.apply is not None:
        if spec.calibrated and not isinstance(calibration, Calibration):
            device = next(iter(hybrid.gdn_modules().values())).q_proj.weight.device
            calibration = prepare(teacher, calibration, sorted(hybrid.gdn_modules()),
                                  heldout_frac=(align or AlignConfig()).heldout_frac, device=device, progress=progress)
        record["custom"] = spec.apply(hybrid, teacher, calibration if spec.calibrated else None) or {}
    elif spec.calibrated:
        align, kl = stage_configs(spec, align, kl)
        with torch.enable_grad():
            record.update(calibrate(hybrid, teacher, calibration, phase1=spec.phase1, phase2=spec.phase2,
                                    align=align, kl=kl, progress=progress,
                                    kl_data=kl_data if spec.kl else None, **switches))
    return record
