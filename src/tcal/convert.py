"""`tcal.convert`: teacher + which layers to keep -> initialised hybrid."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from tcal.errors import TcalError
from tcal.hybrid import HybridConfig, HybridForCausalLM, build_hybrid

log = logging.getLogger(__name__)

# name -> function(hybrid, teacher, **context) that initialises the GDN layers in place and
# returns a JSON-able record of what it did. Taylor-Calibrate strategies register from calibrate.py.
INITS: dict[str, Callable] = {}
# Inits that need no calibration tokens; every other init reads the calibration corpus.
UNCALIBRATED = ("copy", "zero-gate")


def register_init(name: str):
    def deco(fn):
        INITS[name] = fn
        return fn

    return deco


@register_init("copy")
def _init_copy(hybrid: HybridForCausalLM, teacher, **_):
    """Copied projections, fla-default init for the rest (done by build_hybrid)."""
    return {}


@register_init("zero-gate")
@torch.no_grad()
def _init_zero_gate(hybrid: HybridForCausalLM, teacher, **_):
    """Copy + W_g = 0: SiLU(0) = 0, so every GDN layer starts silent."""
    for gdn in hybrid.gdn_modules().values():
        if not gdn.shape.output_gate:
            raise TcalError("init 'zero-gate' needs the output gate; drop output_gate=False")
        gdn.g_proj.weight.zero_()
    return {}


def ensure_strategies() -> None:
    if "taylor" not in INITS:
        from tcal.calibrate import register_strategies

        register_strategies()


def init_function(init: str) -> Callable:
    """The registered init ``init`` (the Taylor-Calibrate ones register on first use)."""
    ensure_strategies()
    if init not in INITS:
        raise TcalError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    return INITS[init]


def parse_inits(spec: str) -> list[str]:
    """'copy,taylor' -> ['copy', 'taylor']: known inits, none twice (the --inits of ablate and recover)."""
    inits = [s.strip() for s in spec.split(",") if s.strip()]
    if not inits:
        raise TcalError("--inits is empty; e.g. --inits copy,taylor")
    if len(set(inits)) != len(inits):
        raise TcalError(f"--inits lists an init twice: {spec}")
    for init in inits:
        init_function(init)
    return inits


def _split_options(options: dict) -> tuple[dict, dict]:
    """GDN construction options (HybridConfig gdn_* fields) vs init switches."""
    fields = HybridConfig.__dataclass_fields__
    gdn, rest = {}, {}
    for k, v in options.items():
        (gdn if (k if k.startswith("gdn_") else f"gdn_{k}") in fields else rest)[k] = v
    return gdn, rest


def calibration_ids(calib, tokenizer, window: int, windows: int) -> torch.Tensor:
    """(windows, window) token ids of the calibration corpus (the first windows, a fixed protocol)."""
    from tcal.data import token_windows

    if tokenizer is None:
        raise TcalError("calibrated inits read text: pass tokenizer= (the teacher's) or calib_ids=")
    return token_windows(calib, tokenizer, window=window, n_windows=windows)


def convert(
    teacher,
    keep: Sequence[int] | str,
    init: str = "copy",
    *,
    calib="wiki:calib",
    tokenizer=None,
    calib_ids: torch.Tensor | None = None,
    calib_window: int = 256,
    calib_windows: int = 4,
    seed: int = 0,
    progress: bool = False,
    selection=None,
    **options,
) -> HybridForCausalLM:
    """Build a hybrid of ``teacher`` keeping ``keep`` as softmax attention, GDN elsewhere.

    - ``keep``: a list of layer indices, ``"0,4,8"``, or a policy ``"uniform:K"``, ``"ar:K"``,
      ``"ga:K"`` (K a count or a percentage); policies ar/ga score layers on a validation slice of
      the calibration corpus (``tcal.select``).
    - ``init``: one of ``tcal.INITS`` (copy, zero-gate, phase1, phase2, taylor, ...).
    - Calibrated inits (Taylor-Calibrate) take ``calib_ids`` directly, or tokenise ``calib``
      (default ``wiki:calib``, disjoint from ``wiki:eval``) with ``tokenizer`` into
      ``calib_windows`` windows of ``calib_window`` tokens (reference: 4 x 256).
    - Remaining keyword options: GDN construction (``use_short_conv``, ``output_gate``, ``backend``...)
      or init switches (``phase1="exact"``, ``align=AlignConfig(...)``, ``stats=...``...).

    The returned model carries ``model.tcal_record`` (what the init did, timings).
    """
    init_fn = init_function(init)
    gdn_options, init_options = _split_options(options)
    record: dict = {"init": init, "timings": {}}
    t0 = time.perf_counter()
    if isinstance(keep, str) or selection is not None:
        from tcal.select import SelectionConfig, select_layers, selection_record

        # ga scores its one-attention students with the init being asked for
        cfg = selection or SelectionConfig(data=str(calib), init=init)
        sel = select_layers(teacher, keep, tokenizer=tokenizer, cfg=cfg, progress=progress)
        keep = sel.layers
        record["selection"] = selection_record(sel)
    record["timings"]["select_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    hybrid = build_hybrid(teacher, keep, seed=seed, **gdn_options)
    record["timings"]["build_s"] = time.perf_counter() - t0
    context = {}
    if init not in UNCALIBRATED:
        if calib_ids is None:
            t0 = time.perf_counter()
            calib_ids = calibration_ids(calib, tokenizer, calib_window, calib_windows)
            record["timings"]["tokenise_s"] = time.perf_counter() - t0
        context = {"calib_ids": calib_ids, "progress": progress}
        record["calibration"] = {"data": str(calib), "sequences": int(calib_ids.shape[0]), "tokens_per_sequence": int(calib_ids.shape[1])}
    elif init_options:
        raise TcalError(f"init {init!r} takes no options; got {', '.join(sorted(init_options))}")
    t0 = time.perf_counter()
    with torch.enable_grad():
        record["detail"] = init_fn(hybrid, teacher, **context, **init_options) or {}
    record["timings"]["init_s"] = time.perf_counter() - t0
    hybrid.config.tcal_init = init
    hybrid.tcal_record = record
    return hybrid
