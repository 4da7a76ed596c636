"""Taylor-Calibrate end to end: teacher statistics -> Phase 1 -> Phase 2, the one place that chains them.

Every entry point (``tcal.convert``, every command, layer selection, the benchmarks) reaches the
stages through :func:`calibrate`, and :func:`prepare` is the one place that decides which
calibration sequences each stage sees:

- the last ``heldout_frac`` of the sequences are held out: Phase 2 uses them only to pick each
  layer's best state;
- the teacher statistics and every Phase-1 fit see the training sequences only;
- Phase 2 trains on the training sequences.

Phase 2 runs one of two ways (``AlignConfig.inputs``):

- ``"teacher"`` (layer-local, the reference): every layer is fitted on the teacher's hidden
  states, independently, from one teacher pass;
- ``"student"`` (sequential): layers are fitted bottom-up, each on the hidden states the hybrid
  itself produces with every layer below already converted and fitted, so a layer learns to
  work on the inputs it will really see instead of compounding the errors below it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tcal import ops
from tcal.taylor import parallel
from tcal.taylor.capture import LayerIO, capture_layer_input, capture_teacher_io
from tcal.taylor.kl_stage import KLData, kl_stage
from tcal.taylor.phase1 import PHASE1_VARIANTS, apply_phase1
from tcal.taylor.phase2 import align_layers, concurrent_on
from tcal.taylor.stage_config import AlignConfig, KLConfig
from tcal.taylor.statistics import TeacherStats, collect_stats
from tcal.utils.errors import TcalError
from tcal.utils.runtime import memory_budget, tf32_matmul


def split_calibration(n: int, heldout_frac: float, max_heldout: int = AlignConfig.heldout_max_sequences,
                      ) -> tuple[slice, slice]:
    """(train rows, held-out rows) of ``n`` calibration sequences: the last ``heldout_frac`` (at most
    ``max_heldout``) are held out."""
    if heldout_frac <= 0:
        return slice(0, n), slice(0, 0)
    k = min(max(1, int(round(n * heldout_frac))), max_heldout)
    if k >= n:
        raise TcalError(
            f"{n} calibration sequence(s) cannot be split into training and held-out parts "
            f"(held-out fraction {heldout_frac}); give at least 2 sequences or set heldout_frac=0"
        )
    return slice(0, n - k), slice(n - k, n)


# Above this many calibration sequences the teacher's activations are captured one layer at a
# time, when that layer is fitted (all layers at once would hold L x 2-3 x N x T x hidden floats:
# 100 GB for 1M tokens on a 30-layer, 576-wide teacher); Phase 1 and the statistics then read
# the first PHASE1_SEQUENCES training sequences, which is where their estimates have settled.
LAZY_SEQUENCES = 256
PHASE1_SEQUENCES = 64
# A lazy capture takes the layer asked for and as many of the layers the caller asks for next as fit
# in this many bytes of x + out, in one teacher pass: one pass per layer made the capture quadratic
# in depth (on the Qwen2.5-1.5B shape at 256K tokens, 21 passes of 2-28 layers took ~194 s of a
# 437 s conversion). None: a quarter of the free memory on CUDA, 4 GiB on CPU.
LAZY_GROUP_BYTES: int | None = None


# Calibration windows longer than this train uncompiled even where compiling is the default: the compiled
# chunk loop grows with the window's chunks, and at 4,096 tokens its compile took longer than the whole
# uncompiled Phase 2 while the KL stage ran no faster (docs/results.md, *Calibration time*; measured at 512 and 4,096
# only, so the bound sits where the evidence stops).
COMPILE_MAX_WINDOW = 1024


def compile_calibration(device, window: int) -> bool:
    """Whether the calibration's gradient calls run compiled when the caller does not say."""
    return ops.compile_by_default(device) and window <= COMPILE_MAX_WINDOW


def group_bytes_for(device) -> int:
    return LAZY_GROUP_BYTES if LAZY_GROUP_BYTES is not None else memory_budget(device)


def pass_sizes(total: int, per_layer_bytes: int, budget: int) -> list[int]:
    """Layers per lazy teacher pass for ``total`` layers whose x + out take ``per_layer_bytes`` each, in
    ``budget`` bytes: as few passes as fit, in equal shares, largest first (21 layers that fit 10 at a time go
    7, 7, 7, not 10, 10, 1; 7 that fit 3 go 3, 2, 2), so the layers fitted side by side come in groups of one
    size, i.e. one compiled shape. At least one layer per pass."""
    per_pass = max(1, budget // max(1, per_layer_bytes))
    passes = -(-total // per_pass)
    return [total // passes + (k < total % passes) for k in range(passes)]


@dataclass
class Calibration:
    """The teacher's side of calibration over ``ids``, split once into training and held-out rows."""

    ids: torch.Tensor  # (N, T) calibration token ids
    train_rows: slice  # statistics, Phase 1, Phase 2 training
    heldout_rows: slice  # Phase 2's choice of best state (and the KL stage's), nothing else
    captured: dict[int, LayerIO]  # per layer, all N sequences: x, out (and ctx, for Phase 1); {} = lazy
    stats: TeacherStats | None  # on the Phase-1 rows; None when no Phase 1 will run
    teacher: object = None  # what captures a layer on demand (lazy) or its residual stream
    phase1_captured: dict[int, LayerIO] | None = None  # lazy only: the Phase-1 rows, with ctx
    device: object = None
    batch_size: int = 4
    # lazy: layers a grouped pass took beyond the one asked for, each handed out (and dropped) once
    pending: dict[int, LayerIO] = field(default_factory=dict)
    passes: int = 0  # lazy teacher passes made so far
    # sizes of the grouped passes still to come, planned at the first: the layers of a pass are fitted side by
    # side and one group size is one compiled shape, while a budget read later differs (the fits before it held
    # or gave back memory); the plan stands while its next size still fits
    pass_plan: list[int] = field(default_factory=list)

    @property
    def lazy(self) -> bool:
        return not self.captured

    def phase1_rows(self) -> slice:
        return self.train_rows if not self.lazy else slice(0, min(PHASE1_SEQUENCES, self.train_rows.stop))

    def phase1_io(self) -> dict[int, LayerIO]:
        """The activations Phase 1 fits on: the training rows (lazy: the first PHASE1_SEQUENCES of them)."""
        if self.lazy:
            return self.phase1_captured or {}
        return self.train()

    def layer_io(self, layer: int, resid: bool = False, then: Sequence[int] = ()) -> LayerIO:
        """All N sequences of one layer (x, out; ``resid`` the residual stream too), captured now if lazy.

        ``then``: the layers the caller will ask for next, in order. A lazy capture takes as many of
        them as fit in :data:`LAZY_GROUP_BYTES` in the same teacher pass and hands each out once."""
        io = self.captured.get(layer)
        if io is not None and (io.resid is not None or not resid):
            return io
        if io is None and not resid and layer in self.pending:
            return self.pending.pop(layer)
        if self.teacher is None:
            raise TcalError(f"the calibration holds no activations of layer {layer} and no teacher to take them "
                            "from; prepare it with tcal.taylor.pipeline.prepare")
        group = [layer]
        if io is None and not resid:
            per_layer = 2 * self.ids.numel() * self.teacher.config.hidden_size * 4
            budget = group_bytes_for(self.device)
            rest = [i for i in dict.fromkeys(then) if i not in self.pending and i != layer]
            if not self.pass_plan or self.pass_plan[0] * per_layer > max(budget, per_layer):
                self.pass_plan = pass_sizes(1 + len(rest), per_layer, budget)
            group = [layer, *rest[: self.pass_plan.pop(0) - 1]]
        fresh = capture_teacher_io(self.teacher, self.ids, group, batch_size=self.batch_size, with_ctx=False,
                                   with_resid=resid, device=self.device)
        self.passes += 1
        self.pending.update({i: fresh[i] for i in group[1:]})
        return fresh[layer] if io is None else LayerIO(io.x, io.out, io.ctx, fresh[layer].resid)

    def layer_ios(self, first: int, then: Sequence[int] = ()) -> dict[int, LayerIO]:
        """``first`` and the layers of ``then`` that come with it: every one of them when all are captured,
        or (lazy) as many as one grouped teacher pass takes (see :meth:`layer_io`)."""
        if not self.lazy:
            return {i: self.layer_io(i) for i in [first, *then]}
        ios = {first: self.layer_io(first, then=then)}
        for i in then:
            if i in self.pending:
                ios[i] = self.pending.pop(i)
        return ios

    def has_layer(self, layer: int) -> bool:
        return layer in self.captured or (self.lazy and self.teacher is not None)

    def train(self) -> dict[int, LayerIO]:
        return {i: io.select(self.train_rows) for i, io in self.captured.items()}

    def heldout(self) -> dict[int, LayerIO]:
        return {i: io.select(self.heldout_rows) for i, io in self.captured.items()}

    def record(self) -> dict:
        n_train = len(range(*self.train_rows.indices(self.ids.shape[0])))
        rec = {"sequences": int(self.ids.shape[0]), "tokens_per_sequence": int(self.ids.shape[1]),
               "train_sequences": n_train, "heldout_sequences": int(self.ids.shape[0]) - n_train}
        if self.lazy:
            rec["phase1_sequences"] = len(range(*self.phase1_rows().indices(self.ids.shape[0])))
        return rec


def as_calibration_ids(calib_ids) -> torch.Tensor:
    if calib_ids is None:
        raise TcalError("this init needs calibration tokens: pass calib_ids (sequences x tokens)")
    calib_ids = torch.as_tensor(calib_ids)
    if calib_ids.dim() == 1:
        calib_ids = calib_ids[None]
    return calib_ids


def prepare(teacher, calib_ids, layers: Sequence[int], *, heldout_frac: float = AlignConfig.heldout_frac,
            max_heldout: int = AlignConfig.heldout_max_sequences, statistics: bool = True, batch_size: int = 4,
            device=None, progress: bool = False, lazy: bool | None = None) -> Calibration:
    """The teacher's activations at ``layers`` over every calibration sequence, and (``statistics``)
    its attention statistics over the training sequences only.

    ``lazy`` (default: more than LAZY_SEQUENCES sequences): capture nothing for Phase 2 now (each
    layer is captured when it is fitted); Phase 1 and the statistics read the first
    PHASE1_SEQUENCES training sequences."""
    ids = as_calibration_ids(calib_ids)
    train, held = split_calibration(ids.shape[0], heldout_frac, max_heldout)
    lazy = ids.shape[0] > LAZY_SEQUENCES if lazy is None else lazy
    cal = Calibration(ids=ids, train_rows=train, heldout_rows=held, captured={}, stats=None, teacher=teacher,
                      device=device, batch_size=batch_size)
    if not lazy:
        cal.captured = capture_teacher_io(teacher, ids, layers, batch_size=batch_size, with_ctx=statistics,
                                          device=device, progress=progress)
    elif statistics:
        cal.phase1_captured = capture_teacher_io(teacher, ids[cal.phase1_rows()], layers, batch_size=batch_size,
                                                 with_ctx=True, device=device, progress=progress)
    if statistics:
        cal.stats = collect_stats(teacher, ids[cal.phase1_rows()], layers, batch_size=batch_size, progress=progress)
    return cal


def student_layer_io(hybrid, calibration: Calibration, layer: int, target: str, batch_size: int = 4) -> LayerIO:
    """Layer ``layer``'s Phase-2 data, all N sequences, on the hybrid's own inputs: x = what the
    hybrid (layers below already converted) feeds the layer; out = the teacher's attention output
    (``target="attn"``) or the output that puts the hybrid's residual stream back onto the
    teacher's (``"residual"``: teacher residual after the attention - hybrid residual before it)."""
    teacher_io = calibration.layer_io(layer, resid=target == "residual")
    dev = teacher_io.out.device
    resid_s, x_s = capture_layer_input(hybrid, calibration.ids, layer, batch_size=batch_size, device=dev,
                                       dtype=teacher_io.out.dtype)
    if target == "attn":
        return LayerIO(x=x_s, out=teacher_io.out)
    return LayerIO(x=x_s, out=teacher_io.resid + teacher_io.out - resid_s)


def align_per_layer(hybrid, calibration: Calibration, align: AlignConfig, batch_size: int = 4,
                    progress: bool = False, spread: bool = True) -> dict[int, dict]:
    """Phase 2 bottom-up: on the teacher's inputs (``align.inputs == "teacher"``, from the capture or,
    lazy, captured now; with ``align.concurrent`` the layers of one teacher pass are fitted side by side)
    or on the hybrid's own (``"student"``, one layer at a time).

    Under a process group (``spread``, :mod:`tcal.taylor.parallel`), layer-local Phase 2 is spread
    over the ranks, each fitting its share of the layers, and every rank ends with every layer and
    record. Sequential Phase 2 stays serial on every rank: layer l is fitted on what the layers
    below it, already fitted, produce; rank 0's result is then given to all, so they agree exactly.
    """
    gdns = hybrid.gdn_modules()
    layers = sorted(gdns)
    rank, world = parallel.ranks() if spread else (0, 1)
    owner = parallel.owners(layers, world)
    mine = [i for i in layers if owner[i] == rank] if align.inputs == "teacher" else layers
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(mine), desc=f"phase 2 ({'sequential' if align.inputs == 'student' else 'layer-local'})",
                   unit="layer", leave=False)
    side_by_side = align.inputs == "teacher" and concurrent_on(align, next(iter(gdns.values())).q_proj.weight.device)
    records, todo = {}, list(mine)
    while todo:
        if align.inputs == "student":
            ios = {todo[0]: student_layer_io(hybrid, calibration, todo[0], align.target, batch_size=batch_size)}
        elif side_by_side:  # the layers of one teacher pass, fitted together (align_layers groups them by memory)
            ios = calibration.layer_ios(todo[0], then=todo[1:])
        else:
            ios = {todo[0]: calibration.layer_io(todo[0], then=todo[1:])}
        group = [i for i in todo if i in ios]
        train = {i: ios[i].select(calibration.train_rows) for i in group}
        held = {i: ios[i].select(calibration.heldout_rows) for i in group}
        records.update(align_layers(hybrid, train, held, align, layers=group, progress=progress))
        todo = [i for i in todo if i not in ios]
        del ios, train, held
        if bar is not None:
            bar.update(len(group))
    if bar is not None:
        bar.close()
    if world > 1:
        if align.inputs == "teacher":
            records = parallel.share_layers(gdns, owner, records)
        else:
            records = parallel.from_rank0(gdns, records)
    return records


def calibrate(hybrid, teacher, calibration, *, phase1: str | None = None, phase2: bool = False,
              align: AlignConfig | None = None, kl: KLConfig | None = None, batch_size: int = 4,
              progress: bool = False, spread: bool = True, compile: bool | None = None,
              kl_data: KLData | None = None, **phase1_switches) -> dict:
    """Run Phase 1 (variant ``phase1``, or none), then Phase 2 (``phase2``) on every GDN layer
    of ``hybrid``, then (``kl`` with steps > 0) the whole-model KL stage, in place. ``calibration`` is a :class:`Calibration` from :func:`prepare` (shared
    by several hybrids of one teacher) or calibration token ids (N, T).
    Returns ``{"calibration": {...}, "statistics": TeacherStats.to_dict() (when taken), "phase1": {layer:
    record}, "phase2": {layer: record}, "kl": record}``.

    Under a process group (``spread``; see :mod:`tcal.taylor.parallel`) every rank calls this with
    the same arguments: layer-local Phase 2 is spread over the ranks, the KL stage (one
    whole-model fit) runs on rank 0 and its result is broadcast, and every rank returns the same
    hybrid and record. Phase 1 (closed-form, cheap) runs on every rank.

    ``kl_data``: the KL stage's own sequences (instruct windows with their answer masks); None: the calibration's
    training and held-out sequences.

    ``compile``: Phase 2's and the KL stage's gradient calls through the compiled chunked path
    (None: where :func:`tcal.ops.compile_by_default` says, i.e. on GPUs without fla's backward, for windows
    up to :data:`COMPILE_MAX_WINDOW` tokens).
    """
    if phase1 is not None and phase1 not in PHASE1_VARIANTS:
        raise TcalError(f"unknown Phase 1 variant {phase1!r}; choose one of {', '.join(PHASE1_VARIANTS)}")
    if phase1_switches and phase1 is None:
        raise TcalError(f"Phase 1 options ({', '.join(sorted(phase1_switches))}) given, but this init runs no Phase 1")
    align = align or AlignConfig()
    layers = sorted(hybrid.gdn_modules())
    device = next(iter(hybrid.gdn_modules().values())).q_proj.weight.device
    if not isinstance(calibration, Calibration):
        calibration = prepare(teacher, calibration, layers, heldout_frac=align.heldout_frac,
                              max_heldout=align.heldout_max_sequences, statistics=phase1 is not None, batch_size=batch_size, device=device,
                              progress=progress)
    missing = [i for i in layers if not calibration.has_layer(i)]
    if missing:
        raise TcalError(f"the calibration has no teacher activations for GDN layer {missing[0]}; "
                        "prepare it for every converted layer")
    want = split_calibration(calibration.ids.shape[0], align.heldout_frac, align.heldout_max_sequences)
    if want != (calibration.train_rows, calibration.heldout_rows):
        raise TcalError(f"the calibration was split with another held-out fraction than align.heldout_frac="
                        f"{align.heldout_frac}; prepare it with the same fraction")
    if kl is not None and kl.steps and kl_data is None and calibration.heldout_rows.stop == calibration.heldout_rows.start:
        raise TcalError("the KL stage picks its state on held-out calibration sequences: use heldout_frac > 0")
    record: dict = {"calibration": calibration.record()}
    if calibration.stats is not None:
        record["statistics"] = calibration.stats.to_dict()
    # where fla cannot train, every GDN call of the calibration runs on the PyTorch path (ops.torch_only)
    with ops.torch_only(ops.compile_by_default(device)):
        if phase1 is not None:
            if calibration.stats is None:
                raise TcalError("Phase 1 needs teacher statistics: prepare the calibration with statistics=True")
            record["phase1"] = apply_phase1(hybrid, calibration.stats, calibration.phase1_io(), phase1,
                                            progress=progress, **phase1_switches)
        with ops.compile_training(compile_calibration(device, calibration.ids.shape[1]) if compile is None
                                  else compile):
            if phase2:
                with tf32_matmul(device, align.tf32):
                    record["phase2"] = align_per_layer(hybrid, calibration, align, batch_size=batch_size,
                                                       progress=progress, spread=spread)
            if kl is not None and kl.steps:
                rank, world = parallel.ranks() if spread else (0, 1)
                kl_record = None
                if rank == 0:
                    # rank 0 alone: the same fit on every rank could drift apart through non-deterministic GPU kernels
                    with tf32_matmul(device, kl.tf32):
                        if kl_data is None:
                            kl_record = kl_stage(hybrid, teacher, calibration.ids[calibration.train_rows],
                                                 calibration.ids[calibration.heldout_rows], kl, progress=progress)
                        else:
                            kl_record = kl_stage(hybrid, teacher, kl_data.train, kl_data.heldout, kl,
                                                 progress=progress, train_mask=kl_data.train_mask,
                                                 heldout_mask=kl_data.heldout_mask)
                            kl_record["data"] = kl_data.record()
                if world > 1:
                    kl_record = parallel.from_rank0(hybrid.gdn_modules(), kl_record)
                record["kl"] = kl_record
    return record
