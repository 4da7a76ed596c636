"""Taylor-Calibrate end to end: teacher statistics -> Phase 1 -> Phase 2, the one place that chains them.

Every entry point (``tcal.convert``, every command, layer selection, the benchmarks) reaches the
stages through :func:`calibrate`, and :func:`prepare` is the one place that decides which
calibration sequences each stage sees:

- the last ``heldout_frac`` of the sequences are held out: Phase 2 uses them only to pick each
  layer's best state;
- the teacher statistics and every Phase-1 fit see the training sequences only;
- Phase 2 trains on the training sequences.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tcal.taylor.capture import LayerIO, capture_teacher_io
from tcal.taylor.phase1 import PHASE1_VARIANTS, apply_phase1
from tcal.taylor.phase2 import AlignConfig, align_layers
from tcal.taylor.statistics import TeacherStats, collect_stats
from tcal.utils.errors import TcalError


def split_calibration(n: int, heldout_frac: float) -> tuple[slice, slice]:
    """(train rows, held-out rows) of ``n`` calibration sequences: the last ``heldout_frac`` are held out."""
    if heldout_frac <= 0:
        return slice(0, n), slice(0, 0)
    k = max(1, int(round(n * heldout_frac)))
    if k >= n:
        raise TcalError(
            f"{n} calibration sequence(s) cannot be split into training and held-out parts "
            f"(held-out fraction {heldout_frac}); give at least 2 sequences or set heldout_frac=0"
        )
    return slice(0, n - k), slice(n - k, n)


@dataclass
class Calibration:
    """The teacher's side of calibration over ``ids``, split once into training and held-out rows."""

    ids: torch.Tensor  # (N, T) calibration token ids
    train_rows: slice  # statistics, Phase 1, Phase 2 training
    heldout_rows: slice  # Phase 2's choice of best state, nothing else
    captured: dict[int, LayerIO]  # per layer, all N sequences: x, out (and ctx, for Phase 1)
    stats: TeacherStats | None  # on the training rows only; None when no Phase 1 will run

    def train(self) -> dict[int, LayerIO]:
        return {i: io.select(self.train_rows) for i, io in self.captured.items()}

    def heldout(self) -> dict[int, LayerIO]:
        return {i: io.select(self.heldout_rows) for i, io in self.captured.items()}

    def record(self) -> dict:
        n_train = len(range(*self.train_rows.indices(self.ids.shape[0])))
        return {"sequences": int(self.ids.shape[0]), "tokens_per_sequence": int(self.ids.shape[1]),
                "train_sequences": n_train, "heldout_sequences": int(self.ids.shape[0]) - n_train}


def as_calibration_ids(calib_ids) -> torch.Tensor:
    if calib_ids is None:
        raise TcalError("this init needs calibration tokens: pass calib_ids (sequences x tokens)")
    calib_ids = torch.as_tensor(calib_ids)
    if calib_ids.dim() == 1:
        calib_ids = calib_ids[None]
    return calib_ids


def prepare(teacher, calib_ids, layers: Sequence[int], *, heldout_frac: float = AlignConfig.heldout_frac,
            statistics: bool = True, batch_size: int = 4, device=None, progress: bool = False) -> Calibration:
    """One capture of the teacher's activations at ``layers`` over every calibration sequence, and
    (``statistics``) its attention statistics over the training sequences only."""
    ids = as_calibration_ids(calib_ids)
    train, held = split_calibration(ids.shape[0], heldout_frac)
    captured = capture_teacher_io(teacher, ids, layers, batch_size=batch_size, with_ctx=statistics,
                                  device=device, progress=progress)
    stats = collect_stats(teacher, ids[train], layers, batch_size=batch_size, progress=progress) if statistics else None
    return Calibration(ids=ids, train_rows=train, heldout_rows=held, captured=captured, stats=stats)


def calibrate(hybrid, teacher, calibration, *, phase1: str | None = None, phase2: bool = False,
              align: AlignConfig | None = None, batch_size: int = 4, progress: bool = False,
              **phase1_switches) -> dict:
    """Run Phase 1 (variant ``phase1``, or none) and then Phase 2 (``phase2``) on every GDN layer
    of ``hybrid``, in place. ``calibration`` is a :class:`Calibration` from :func:`prepare` (shared
    by several hybrids of one teacher) or calibration token ids (N, T).
    Returns ``{"calibration": {...}, "statistics": TeacherStats.to_dict() (when taken), "phase1": {layer:
    record}, "phase2": {layer: record}}``.
    """
    if phase1 is not None and phase1 not in PHASE1_VARIANTS:
        raise TcalError(f"unknown Phase 1 variant {phase1!r}; choose one of {', '.join(PHASE1_VARIANTS)}")
    if phase1_switches and phase1 is None:
        raise TcalError(f"Phase 1 options ({', '.join(sorted(phase1_switches))}) given, but this init runs no Phase 1")
    align = align or AlignConfig()
    layers = sorted(hybrid.gdn_modules())
    if not isinstance(calibration, Calibration):
        device = next(iter(hybrid.gdn_modules().values())).q_proj.weight.device
        calibration = prepare(teacher, calibration, layers, heldout_frac=align.heldout_frac,
                              statistics=phase1 is not None, batch_size=batch_size, device=device,
                              progress=progress)
    missing = [i for i in layers if i not in calibration.captured]
    if missing:
        raise TcalError(f"the calibration has no teacher activations for GDN layer {missing[0]}; "
                        "prepare it for every converted layer")
    want = split_calibration(calibration.ids.shape[0], align.heldout_frac)
    if want != (calibration.train_rows, calibration.heldout_rows):
        raise TcalError(f"the calibration was split with another held-out fraction than align.heldout_frac="
                        f"{align.heldout_frac}; prepare it with the same fraction")
    record: dict = {"calibration": calibration.record()}
    if calibration.stats is not None:
        record["statistics"] = calibration.stats.to_dict()
    if phase1 is not None:
        if calibration.stats is None:
            raise TcalError("Phase 1 needs teacher statistics: prepare the calibration with statistics=True")
        record["phase1"] = apply_phase1(hybrid, calibration.stats, calibration.train(), phase1, progress=progress,
                                        **phase1_switches)
    if phase2:
        record["phase2"] = align_layers(hybrid, calibration.train(), calibration.heldout(), align, progress=progress)
    return record
