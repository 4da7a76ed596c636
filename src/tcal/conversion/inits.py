"""The init strategies, as typed specs: what each needs and which Taylor-Calibrate stages it runs.

Plain data (no torch), so ``import tcal`` lists every init and ``tcal --help`` shows them at
once. :func:`tcal.conversion.apply_init.initialise` carries a spec out.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tcal.utils.errors import TcalError
from tcal.utils.flags import Reader


@dataclass(frozen=True)
class InitSpec:
    name: str
    summary: str  # one line, shown by --help and in docs
    calibrated: bool = False  # reads calibration tokens (and so the teacher's activations)
    phase1: str | None = None  # Phase-1 variant: "reference" | "exact" | "exact-silent", or None
    phase2: bool = False  # Phase-2 layer-local alignment after Phase 1
    zero_gate: bool = False  # W_g = 0 after the copy: every GDN layer starts silent
    # How Phase 2 fits the layers (tcal.taylor.pipeline): "local" (teacher-forced, each layer on its
    # own: the reference), "sequential" (bottom-up on the hybrid's own inputs, teacher attention
    # output as target), "residual" (sequential, target = the output that puts the hybrid's
    # residual stream back onto the teacher's).
    align: str = "local"
    kl: bool = False  # a short whole-model KL stage after Phase 2 (tcal.taylor.kl_stage)
    # A strategy that is not a combination of the stages above: fn(hybrid, teacher, calibration)
    # -> JSON-able record; ``calibration`` is a tcal.taylor.pipeline.Calibration (None if not calibrated).
    apply: Callable | None = None

    def __post_init__(self):
        if (self.phase1 is not None or self.phase2 or self.kl) and not self.calibrated:
            raise TcalError(f"init {self.name!r} runs Phase 1, Phase 2 or the KL stage, so it must be calibrated=True")
        if self.align not in ALIGN_MODES:
            raise TcalError(f"init {self.name!r}: align must be one of {', '.join(ALIGN_MODES)}, got {self.align!r}")


ALIGN_MODES = ("local", "sequential", "residual")


INITS: dict[str, InitSpec] = {}
_BUILTIN_NAMES: frozenset[str] = frozenset()  # filled once the built-ins below are registered


def register_init(spec: InitSpec) -> InitSpec:
    """Add ``spec`` to :data:`INITS` (replacing a user init of the same name; built-ins stay)."""
    if spec.name in _BUILTIN_NAMES:
        raise TcalError(f"init {spec.name!r} is a built-in baseline and cannot be replaced; register another name")
    INITS[spec.name] = spec
    return spec


def get_init(name: str) -> InitSpec:
    if isinstance(name, InitSpec):
        return name
    if name not in INITS:
        raise TcalError(f"unknown init {name!r}; choose one of {', '.join(INITS)}")
    return INITS[name]


def parse_inits(spec: str) -> list[str]:
    """'copy,taylor' -> ['copy', 'taylor']: known inits, none twice (the --inits of ablate and recover)."""
    inits = [s.strip() for s in spec.split(",") if s.strip()]
    if not inits:
        raise TcalError("--inits is empty; e.g. --inits copy,taylor")
    if len(set(inits)) != len(inits):
        raise TcalError(f"--inits lists an init twice: {spec}")
    for init in inits:
        get_init(init)
    return inits


# the calibration flags (tcal.taylor.budget.CalibArgs) each stage of an init reads, and how messages name the inits
# that have the stage
STAGE_FLAGS = {"calibrated": ("calib", "calib_budget", "calib_window", "calib_windows"),
               "phase2": ("align_steps", "fit_matmul"),
               "kl": ("kl_steps", "kl_recall_frac", "kl_data", "fit_matmul")}
STAGE_NAMES = {"calibrated": "the calibrated inits", "phase2": "the inits with Phase 2",
               "kl": "the inits with a KL stage"}


def init_readers(chosen, *, recall: bool = False, chat: bool = False) -> list[Reader]:
    """Who reads each calibration flag (:mod:`tcal.utils.flags`): the inits of each stage, active where one of the
    ``chosen`` inits has it; the KL stage's recall mix (``recall``: it is on) and its chat windows (``chat``:
    ``--kl-data chat:CODE`` without the recall mix) read their own."""
    specs = [get_init(i) for i in chosen]
    out = [Reader(f"{STAGE_NAMES[stage]} ({', '.join(n for n, s in INITS.items() if getattr(s, stage))})", flags,
                  any(getattr(s, stage) for s in specs)) for stage, flags in STAGE_FLAGS.items()]
    kl = any(s.kl for s in specs)
    return out + [Reader("the KL stage's recall mix (--kl-recall-frac above 0, or the long budget)", ("kl_recall_span",),
                         kl and recall),
                  Reader("the KL stage on chat windows (--kl-data chat:CODE)", ("kl_windows",), kl and chat)]


for _spec in (
    InitSpec("copy", "copied projections (W_q, W_o; W_k, W_v per GQA group), fla's default init for the rest"),
    InitSpec("zero-gate", "copy + W_g = 0: every GDN layer starts silent", zero_gate=True),
    InitSpec("phase1", "copy + Phase 1 as published (reference)", calibrated=True, phase1="reference"),
    InitSpec("phase1-exact", "copy + exact Phase 1 (targets realised exactly, output-space least squares)",
             calibrated=True, phase1="exact"),
    InitSpec("phase2", "copy + Phase 2 only (layer-local alignment)", calibrated=True, phase2=True),
    InitSpec("taylor-reference", "the paper's recipe: reference Phase 1 + layer-local Phase 2", calibrated=True,
             phase1="reference", phase2=True),
    InitSpec("taylor", "tcal's best Taylor-Calibrate: exact decay and write gate, near-silent output gate, "
             "layer-local Phase 2, then a short whole-model KL stage on the calibration tokens", calibrated=True,
             phase1="exact-silent", phase2=True, kl=True),
    InitSpec("taylor-exact", "exact Phase 1 + layer-local Phase 2", calibrated=True, phase1="exact", phase2=True),
    InitSpec("taylor-exact-silent", "exact decay and write gate, near-silent output gate, + layer-local Phase 2",
             calibrated=True, phase1="exact-silent", phase2=True),
):
    register_init(_spec)
_BUILTIN_NAMES = frozenset(INITS)
