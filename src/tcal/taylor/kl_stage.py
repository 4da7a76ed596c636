"""An optional last calibration stage: a short whole-model KL fit of every GDN layer at once.

Phase 2 fits each layer to its own target, so the small errors of 15-22 converted layers add
up in the residual stream and nothing ever sees their sum. This stage trains the GDN layers
(only them: embeddings, MLPs, norms and the kept attention stay the teacher's) jointly on the
forward KL(teacher || hybrid) of the next-token distributions over the calibration training
sequences. The state kept is the one of lowest KL on the held-out calibration sequences, which
are evaluated before the first step too, so the stage can never return a worse model than it
was given (on those sequences). The schedule, held-out checks, patience and non-finite guard are the
fit rules every loop shares (:mod:`tcal.utils.fit`); the settings are :class:`tcal.taylor.stage_config.KLConfig`.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from tcal.data.recall import recall_rows
from tcal.modules.distill_loss import (
    TeacherTargets,
    chunked_distill_loss,
    final_hidden,
    lm_parts,
    mask_rows,
    mean_kl,
    rows_per_chunk,
    teacher_targets,
)
from tcal.taylor.stage_config import KLConfig
from tcal.utils.errors import TcalError
from tcal.utils.fit import begin, nonfinite
from tcal.utils.fit_tensors import heldout_step, restore, set_lr, snapshot
from tcal.utils.runtime import memory_budget

log = logging.getLogger(__name__)


@dataclass
class KLData:
    """The KL stage's own sequences, where they are not the calibration's: training and held-out (N, T) ids and, for
    instruct windows, the masks of their answer positions (:mod:`tcal.data.instruct`); ``name`` says what text."""

    train: torch.Tensor
    heldout: torch.Tensor
    train_mask: torch.Tensor | None = None
    heldout_mask: torch.Tensor | None = None
    name: str = ""

    def record(self) -> dict:
        count = lambda ids, m: int(ids.numel() if m is None else m.sum())  # noqa: E731
        return {"data": self.name, "train_sequences": int(self.train.shape[0]),
                "heldout_sequences": int(self.heldout.shape[0]), "tokens_per_sequence": int(self.train.shape[1]),
                "loss_tokens": {"train": count(self.train, self.train_mask),
                                "heldout": count(self.heldout, self.heldout_mask)}}


def _gdn_params(hybrid) -> list[torch.nn.Parameter]:
    return [p for gdn in hybrid.gdn_modules().values() for p in gdn.parameters()]


@torch.no_grad()
def teacher_hidden(base_t, ids: torch.Tensor, batch_size: int, device) -> torch.Tensor:
    """The final hidden states (after the final norm) of the teacher decoder ``base_t`` for ``ids`` (N, T):
    (N, T, D) on ``device``."""
    return torch.cat([final_hidden(base_t, ids[s : s + batch_size].to(device))
                      for s in range(0, ids.shape[0], batch_size)])


def _teacher_cache(base_t, head_t, ids: torch.Tensor, batch_size: int, device, room: int):
    """What of the teacher's side of the fixed sequences ``ids`` (N, T) fits in ``room`` bytes, computed once:
    its :class:`TeacherTargets` (N, T, V) (no teacher pass per step), else its final hidden states (N, T, D) (no
    teacher decoder pass; its LM head still runs), else None. Returns (cache, bytes used)."""
    p = next(base_t.parameters())
    rows, vocab = ids.numel(), head_t.weight.shape[0]
    hidden_bytes = rows * head_t.weight.shape[1] * p.element_size()
    target_bytes = TeacherTargets.nbytes(rows, vocab)
    if target_bytes + hidden_bytes <= room:  # the hidden states exist while the targets are made
        return teacher_targets(teacher_hidden(base_t, ids, batch_size, device), head_t), target_bytes
    if hidden_bytes <= room:
        return teacher_hidden(base_t, ids, batch_size, device), hidden_bytes
    return None, 0


def _cache_kind(cache) -> str | None:
    return "targets" if isinstance(cache, TeacherTargets) else "hidden" if cache is not None else None


def kl_stage(hybrid, teacher, train_ids: torch.Tensor, heldout_ids: torch.Tensor, cfg: KLConfig,
             progress: bool = False, train_mask: torch.Tensor | None = None,
             heldout_mask: torch.Tensor | None = None) -> dict:
    """Train the GDN layers of ``hybrid`` on KL to ``teacher`` over ``train_ids`` (N, T), in place;
    keep the state of lowest KL on ``heldout_ids``. Returns the record (KL curve, best step, ...).

    ``train_mask`` / ``heldout_mask`` (N, T) bool: the positions the KL is over (the answer tokens of instruct
    windows, :mod:`tcal.data.instruct`); None = every position."""
    if heldout_ids.shape[0] == 0:
        raise TcalError("the KL stage needs held-out calibration sequences to pick its state; "
                        "use a held-out fraction > 0")
    for name, mask, ids in (("train", train_mask, train_ids), ("held-out", heldout_mask, heldout_ids)):
        if mask is not None and tuple(mask.shape) != tuple(ids.shape):
            raise TcalError(f"the KL stage's {name} mask is {tuple(mask.shape)}, its sequences {tuple(ids.shape)}")
    if (train_mask is not None or heldout_mask is not None) and cfg.recall_frac > 0:
        raise TcalError("the KL stage's recall mix rewrites the ends of its windows, which a loss mask would no "
                        "longer fit: use one or the other")
    t0 = time.perf_counter()
    if cfg.recall_frac > 0:
        if train_ids.shape[1] < 2 * cfg.recall_span:
            raise TcalError(f"the KL stage's recall mix copies {cfg.recall_span}-token spans, which needs calibration "
                            f"windows of at least {2 * cfg.recall_span} tokens (they have {train_ids.shape[1]}); "
                            "lower the span or lengthen the windows")
        train_ids = recall_rows(train_ids, cfg.seed, cfg.recall_frac, cfg.recall_span)
        heldout_ids = recall_rows(heldout_ids, cfg.seed, cfg.recall_frac, cfg.recall_span,
                                  first_sample=train_ids.shape[0])
    params = _gdn_params(hybrid)
    eval_bs = max(cfg.batch_size, cfg.eval_tokens // max(1, heldout_ids.shape[1]))  # sequences per held-out pass
    saved_flags = {id(p): p.requires_grad for p in hybrid.parameters()}
    base_s, head_s = lm_parts(hybrid)
    base_t, head_t = lm_parts(teacher)
    dev = head_s.weight.device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    base_lrs = [g["lr"] for g in opt.param_groups]
    rules = cfg.fit_rules()
    gen = torch.Generator().manual_seed(cfg.seed)
    was_training, teacher_training = hybrid.training, teacher.training
    teacher.eval()
    hybrid.eval()  # no dropout: the stage fits the model as it will run
    # The teacher is frozen, so its side of the fixed sequences never changes: computed once it saves a
    # teacher pass per step and one per held-out sequence per evaluation.
    held_t = train_t = None
    if cfg.cache_teacher:
        room = memory_budget(dev)
        held_t, used = _teacher_cache(base_t, head_t, heldout_ids, eval_bs, dev, room)
        train_t, _ = _teacher_cache(base_t, head_t, train_ids, cfg.batch_size, dev, room - used)
    chunk = rows_per_chunk(head_s.weight.shape[0])
    before = mean_kl(hybrid, teacher, heldout_ids, eval_bs, held_t, heldout_mask)
    fit, best_state = begin(before), snapshot(params)
    curve, held_curve = [], [(0, before)]
    steps = range(1, cfg.steps + 1)
    bar = tqdm(steps, desc="KL stage", unit="step", leave=False) if progress else None
    try:
        for p in hybrid.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            for step in bar if bar is not None else steps:
                set_lr(opt, base_lrs, rules.schedule.lr(step - 1))
                idx = torch.randint(0, train_ids.shape[0], (min(cfg.batch_size, train_ids.shape[0]),), generator=gen)
                mb = train_ids[idx].to(dev)
                rows = mask_rows(train_mask, idx, dev)
                if rows is not None and not bool(rows.any()):
                    continue
                if train_t is not None:
                    ht = train_t[idx.to(dev)]
                else:
                    with torch.no_grad():
                        ht = final_hidden(base_t, mb)
                ht = ht.rows() if isinstance(ht, TeacherTargets) else ht.reshape(-1, ht.shape[-1])
                hs = final_hidden(base_s, mb)
                # chunks of rows_per_chunk rows, each recomputed in the backward once there are several: the
                # logits of one chunk at a time, where the whole batch's (768 x 151,936 for a Qwen coder at the
                # reference budget) set a conversion's memory peak
                n_rows = mb.numel() if rows is None else int(rows.sum())
                loss, kl, _ = chunked_distill_loss(hs.reshape(-1, hs.shape[-1]), head_s, ht, head_t,
                                                   chunk_rows=chunk, use_checkpoint=n_rows > chunk, row_mask=rows)
                if not math.isfinite(kl):  # checked before the update, which is then never applied
                    fit = nonfinite(rules, fit, step)
                    if fit.stopped:
                        log.warning("KL stage: non-finite KL at step %d; restored the best state (step %d) and "
                                    "stopped", step, fit.best_step)
                        break
                    continue
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                curve.append(kl)
                fit, best_state = heldout_step(rules, fit, step,
                                               lambda: mean_kl(hybrid, teacher, heldout_ids, eval_bs, held_t,
                                                               heldout_mask),
                                               params, best_state, held_curve)
                if fit.stopped:
                    break
                if bar is not None:
                    bar.set_postfix(kl=f"{kl:.3f}", best=f"{fit.best:.3f}")
    finally:
        if bar is not None:
            bar.close()
        restore(params, best_state)
        for p in hybrid.parameters():
            p.requires_grad_(saved_flags[id(p)])
        hybrid.train(was_training)
        teacher.train(teacher_training)
    return {"steps_run": len(curve), "best_step": fit.best_step, "train_kl": curve, "heldout_curve": held_curve,
            "heldout_kl_before": before, "heldout_kl": fit.best,
            "train_tokens": int(train_ids.numel()), "heldout_tokens": int(heldout_ids.numel()),
            "loss_tokens": {"train": int(train_ids.numel() if train_mask is None else train_mask.sum()),
                            "heldout": int(heldout_ids.numel() if heldout_mask is None else heldout_mask.sum())},
            "teacher_cached": {"heldout": _cache_kind(held_t), "train": _cache_kind(train_t)},
            "recall": {"frac": cfg.recall_frac, "span": cfg.recall_span},
            "wall_s": time.perf_counter() - t0}
