"""Taylor-Calibrate Phase 2: layer-local alignment of each GDN layer to its teacher layer.

For every converted layer independently: input = the teacher's normed hidden state entering
that layer (teacher-forced), target = the teacher's attention output after W_o, loss = MSE,
optimiser = AdamW with two learning rates (the reference's: 1e-4 for W_q/W_k/W_v and what
belongs to them, 1e-3 for the gate/decay parameters), W_o and o_norm frozen. The inputs and
targets of every layer come from ONE teacher pass (:func:`tcal.stats.capture_teacher_io`),
and the layers are then trained back to back.

The state kept is the best one on a held-out slice of the calibration sequences (the last
``heldout_frac`` of them, split off by :func:`tcal.taylor.pipeline.calibrate`), not the one with
the lowest training loss: on a few calibration sequences the training loss keeps falling while
the held-out fit gets worse.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tcal.modules.gdn import GatedDeltaNet
from tcal.taylor.capture import LayerIO
from tcal.taylor.layer_fit import gdn_device_dtype, layer_output, output_fit
from tcal.utils.errors import TcalError
from tcal.utils.schedule import lr_at

log = logging.getLogger(__name__)

QKV_PARAMS = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "q_norm", "k_norm")
GATE_PARAMS = ("a_proj", "b_proj", "A_log", "dt_bias", "g_proj")
FROZEN_PARAMS = ("o_proj", "o_norm")


@dataclass
class AlignConfig:
    """Phase 2 settings; the defaults are the reference's (300 full-batch steps, AdamW)."""

    steps: int = 300
    lr_qkv: float = 1e-4  # W_q, W_k, W_v (+ their biases, short convs, q/k norms)
    lr_gate: float = 1e-3  # W_a, W_b (+ bias), A_log, dt_bias, W_g
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int | None = None  # training sequences per step; None = full batch
    train_sequences: int | None = None  # use only the first n training sequences
    seq_len: int | None = None  # use only the first n tokens of every sequence
    heldout_frac: float = 0.25  # last fraction of the sequences picks the best state; 0 = best training loss
    eval_every: int = 1  # held-out evaluation every n steps (and at the last step)
    on_nonfinite: str = "stop"  # NaN/Inf loss, gradient or weight: "stop" the layer or "skip" the step
    max_nonfinite: int = 10  # with "skip": stop the layer after this many non-finite steps
    seed: int = 0  # minibatch order
    schedule: str = "constant"  # learning rate over the steps: "constant" (reference) or "cosine"
    warmup_steps: int = 0  # linear warm-up before the schedule
    patience: int | None = None  # stop a layer after this many held-out evaluations without a new best
    heldout_max_sequences: int = 64  # cap on the held-out slice: it is evaluated every eval_every steps
    # Which inputs each layer is fitted on (see tcal.taylor.pipeline):
    #   "teacher": the teacher's hidden states (layer-local, the reference);
    #   "student": the partly converted hybrid's own hidden states, layers fitted bottom-up.
    inputs: str = "teacher"
    # What the layer's output is fitted to: "attn" = the teacher's attention output (reference);
    # "residual" = teacher residual after the attention minus the student's residual before it,
    # i.e. the output that puts the hybrid's residual stream back onto the teacher's.
    target: str = "attn"

    def __post_init__(self):
        for name, low in (("lr_qkv", 0), ("lr_gate", 0), ("weight_decay", None), ("grad_clip", None)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 if low == 0 else value >= 0)
            if not ok:
                raise TcalError(f"align {name} must be a finite number {'> 0' if low == 0 else '>= 0'}, got {value!r}")
        if self.steps < 0:
            raise TcalError(f"align steps must be >= 0, got {self.steps}")
        if not 0 <= self.heldout_frac < 1:
            raise TcalError(f"heldout_frac must be in [0, 1), got {self.heldout_frac}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise TcalError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.eval_every < 1:
            raise TcalError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.schedule not in SCHEDULES:
            raise TcalError(f"align schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise TcalError(f"align warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.patience is not None and self.patience < 1:
            raise TcalError(f"align patience must be >= 1 evaluations (or None), got {self.patience}")
        if self.heldout_max_sequences < 1:
            raise TcalError(f"heldout_max_sequences must be >= 1, got {self.heldout_max_sequences}")
        if self.inputs not in ("teacher", "student"):
            raise TcalError(f"align inputs must be 'teacher' or 'student', got {self.inputs!r}")
        if self.target not in ("attn", "residual"):
            raise TcalError(f"align target must be 'attn' or 'residual', got {self.target!r}")
        if self.target == "residual" and self.inputs != "student":
            raise TcalError("the residual-stream target corrects the hybrid's own drift: it needs inputs='student'")


SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, steps: int, schedule: str, warmup: int) -> float:
    """Learning-rate multiplier at ``step`` (0-based) of ``steps``: linear warm-up, then constant or
    cosine decay that reaches 10 % at the last step (not 0: the last steps still move the weights
    the best state may pick)."""
    return lr_at(step, peak=1.0, total_steps=steps - 1, warmup=warmup, schedule=schedule, min_ratio=0.1)


def param_groups(gdn: GatedDeltaNet) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], list[str]]:
    """(q/k/v parameters, gate/decay parameters, names of the frozen ones)."""
    qkv, gate, frozen = [], [], []
    for name, p in gdn.named_parameters():
        root = name.split(".")[0]
        if root in QKV_PARAMS:
            qkv.append(p)
        elif root in GATE_PARAMS:
            gate.append(p)
        elif root in FROZEN_PARAMS:
            frozen.append(name)
        else:
            raise TcalError(f"GDN parameter {name!r} is in no Phase 2 group; update tcal.align")
    return qkv, gate, frozen


class _Minibatches:
    """Indices of the training sequences per step: the full batch, or reshuffled minibatches."""

    def __init__(self, n: int, batch_size: int | None, seed: int, device):
        self.n, self.bs, self.device = n, (n if not batch_size else min(batch_size, n)), device
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.cursor = (self._shuffle() if self.bs < n else None), 0

    def _shuffle(self) -> torch.Tensor:
        # one copy to the device per epoch: a pageable host-to-GPU copy per step waits for the GPU
        return torch.randperm(self.n, generator=self.gen).to(self.device)

    def next(self) -> torch.Tensor | None:  # None = all sequences
        if self.bs >= self.n:
            return None
        if self.cursor + self.bs > self.n:
            self.order, self.cursor = self._shuffle(), 0
        idx = self.order[self.cursor : self.cursor + self.bs]
        self.cursor += self.bs
        return idx


@contextlib.contextmanager
def _training_only(gdn: GatedDeltaNet, trained: Sequence[torch.nn.Parameter]):
    """Within the block only ``trained`` require gradients; the flags are put back afterwards."""
    saved = {id(p): p.requires_grad for p in gdn.parameters()}
    for p in gdn.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        for p in gdn.parameters():
            p.requires_grad_(saved[id(p)])


def _snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


@torch.no_grad()
def _restore(params, state) -> None:
    for p, s in zip(params, state):
        p.copy_(s)


def _step(gdn, opt, trained, xb, yb, grad_clip: float) -> float | None:
    """One AdamW step on the MSE to the teacher; the loss, or None if the loss, gradient or the
    updated weights are not finite (the caller then restores the weights and clears the moments).

    The three checks are folded into one tensor that is read together with the loss: one wait for
    the GPU per step instead of one per check and per trained tensor, which left a GPU idle between
    the small kernels of one layer's step. A non-finite loss or gradient still reaches ``opt.step``,
    whose result the caller throws away."""
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(gdn(xb)[0].float(), yb)
    loss.backward()
    ok = torch.isfinite(loss)
    if grad_clip:
        ok = ok & torch.isfinite(torch.nn.utils.clip_grad_norm_(trained, grad_clip))
    opt.step()
    ok = ok & torch.stack([torch.isfinite(p).all() for p in trained]).all()
    value, good = torch.stack([loss.detach(), ok.to(loss.dtype)]).tolist()
    return value if good else None


def align_layer(
    gdn: GatedDeltaNet,
    train: LayerIO,
    heldout: LayerIO | None,
    cfg: AlignConfig,
    progress: bool = True,
    layer: int | None = None,
) -> dict:
    """Phase 2 on one layer, in place; returns its record (loss curve, held-out fit before/after, best step...)."""
    t0 = time.perf_counter()
    layer = gdn.layer_idx if layer is None else layer
    dev, dt = gdn_device_dtype(gdn)
    x, y = train.x.to(dev, dt), train.out.to(dev).float()
    has_held = heldout is not None and heldout.x.shape[0] > 0
    if has_held:
        hx, hy = heldout.x.to(dev, dt), heldout.out.to(dev).float()
    qkv, gate, _ = param_groups(gdn)
    trained = qkv + gate
    groups = [g for g in ({"params": qkv, "lr": cfg.lr_qkv}, {"params": gate, "lr": cfg.lr_gate}) if g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    base_lrs = [g["lr"] for g in opt.param_groups]

    def held_fit():  # (None, None) without a held-out slice: the record stays valid JSON
        return output_fit(layer_output(gdn, hx), hy) if has_held else (None, None)

    train_before, held_before = output_fit(layer_output(gdn, x), y), held_fit()
    best_score = held_before[0] if has_held else math.inf
    best_state, best_step = _snapshot(trained), 0
    curve, held_curve, bad_steps, stale = [], [], [], 0
    batches = _Minibatches(x.shape[0], cfg.batch_size, cfg.seed, dev)
    steps = range(1, cfg.steps + 1)
    bar = tqdm(steps, desc=f"phase 2 layer {layer}", unit="step", leave=False) if progress else None
    try:
        with _training_only(gdn, trained):
            for step in bar if bar is not None else steps:
                idx = batches.next()
                for g, lr in zip(opt.param_groups, base_lrs):
                    g["lr"] = lr * lr_factor(step - 1, cfg.steps, cfg.schedule, cfg.warmup_steps)
                before = _snapshot(trained)
                lval = _step(gdn, opt, trained, x if idx is None else x[idx], y if idx is None else y[idx],
                             cfg.grad_clip)
                if lval is None:
                    bad_steps.append(step)
                    _restore(trained, before)
                    opt.state.clear()  # moments may hold the NaN; start them afresh
                    if len(bad_steps) == 1:
                        log.warning("phase 2, layer %s: non-finite loss/gradient/weights at step %d; restored the "
                                    "last good state and %s", layer, step,
                                    "stopped this layer" if cfg.on_nonfinite == "stop" else "skipped the step")
                    if cfg.on_nonfinite == "stop" or len(bad_steps) >= cfg.max_nonfinite:
                        break
                    continue
                curve.append(lval)
                if has_held:
                    if step % cfg.eval_every == 0 or step == cfg.steps:
                        rel, _ = held_fit()
                        held_curve.append((step, rel))
                        if math.isfinite(rel) and rel < best_score:
                            best_score, best_state, best_step, stale = rel, _snapshot(trained), step, 0
                        else:
                            stale += 1
                            if cfg.patience is not None and stale >= cfg.patience:
                                break
                elif lval < best_score:  # the loss was measured on the weights before this step
                    best_score, best_state, best_step = lval, before, step - 1
                if bar is not None:
                    bar.set_postfix(loss=f"{lval:.3g}", best=best_step)
    finally:
        if bar is not None:
            bar.close()
        _restore(trained, best_state)
    train_after, held_after = output_fit(layer_output(gdn, x), y), held_fit()
    return {
        "layer": layer, "steps_run": len(curve), "best_step": best_step, "train_loss": curve,
        "inputs": cfg.inputs, "target": cfg.target,
        "heldout_curve": held_curve,
        "train_rel_mse_before": train_before[0], "train_cos_before": train_before[1],
        "train_rel_mse": train_after[0], "train_cos": train_after[1],
        "heldout_rel_mse_before": held_before[0], "heldout_cos_before": held_before[1],
        "heldout_rel_mse": held_after[0], "heldout_cos": held_after[1],
        "nonfinite_steps": bad_steps,
        "train_tokens": int(x.shape[0] * x.shape[1]),
        "heldout_tokens": int(hx.shape[0] * hx.shape[1]) if has_held else 0,
        "wall_s": time.perf_counter() - t0,
    }


def align_layers(
    hybrid,
    train: Mapping[int, LayerIO],
    heldout: Mapping[int, LayerIO] | None,
    cfg: AlignConfig | None = None,
    layers: Sequence[int] | None = None,
    progress: bool = True,
) -> dict[int, dict]:
    """Phase 2 on each GDN layer of ``hybrid`` (default: all), back to back.

    ``train`` / ``heldout``: {layer: LayerIO} teacher activations of the training and the held-out
    calibration sequences (``heldout`` None or empty: keep the state of lowest training loss).
    """
    cfg = cfg or AlignConfig()
    gdns = hybrid.gdn_modules()
    layers = sorted(gdns) if layers is None else sorted(int(i) for i in layers)
    records = {}
    for i in layers:
        if i not in gdns:
            raise TcalError(f"layer {i} is not a GDN layer of this hybrid")
        if i not in train:
            raise TcalError(f"no captured teacher activations for layer {i}")
        tr, ho = train[i], (heldout or {}).get(i)
        if cfg.seq_len:
            tr = tr.select((slice(None), slice(None, cfg.seq_len)))
            ho = None if ho is None else ho.select((slice(None), slice(None, cfg.seq_len)))
        if cfg.train_sequences:
            tr = tr.select(slice(0, cfg.train_sequences))
        records[i] = align_layer(gdns[i], tr, ho, cfg, progress=progress, layer=i)
    return records
