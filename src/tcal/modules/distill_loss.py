"""The distillation loss: forward KL to the frozen teacher (optionally mixed with next-token CE),
computed over chunks of rows so the full logits never exist.

Objective. Forward KL(teacher || student) over the full vocabulary at every position of every
training sequence, optionally mixed with next-token cross-entropy::

    loss = (1 - w) * mean_tokens KL(p_teacher || p_student) + w * mean_tokens CE(next token)

The logits are never materialised for the whole batch: both models run up to their final
norm (``model.model``), and the LM heads, log-softmaxes and the loss are computed over chunks
of ``kl_chunk`` token rows inside ``torch.utils.checkpoint``, so at any time only one chunk's
``rows x vocab`` fp32 tensors exist, in the forward and in the backward pass (the backward
recomputes the chunk's logits, teacher included, from the saved hidden states).

A loss that sees the same rows at every step (the KL stage's fixed calibration sequences) can keep
the teacher's side, its distributions and their negative entropies (:class:`TeacherTargets`), where
they fit in memory: each step then skips the teacher's LM head and softmax, which over a large
vocabulary cost as much as the student's.

The same KL, without gradients and averaged per predicted token over fixed sequences (:func:`mean_kl`), says how far
a hybrid's next-token distributions are from its teacher's: the KL stage picks its state by it
(:mod:`tcal.taylor.kl_stage`) and the ``answer_kl`` task scores a training curve's development answers with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from tcal.utils.errors import TcalError


def _weight_bias(head) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(head, nn.Linear):
        return head.weight, head.bias
    if isinstance(head, tuple):
        return head[0], (head[1] if len(head) > 1 else None)
    if isinstance(head, torch.Tensor):
        return head, None
    raise TcalError(f"an LM head must be an nn.Linear or a weight tensor, got {type(head).__name__}")


@dataclass
class TeacherTargets:
    """The teacher's next-token distributions of fixed rows, computed once (:func:`teacher_targets`) for a
    loss that sees the same rows again: ``probs`` (..., V) fp32 and ``neg_entropy`` (...) = sum p log p."""

    probs: torch.Tensor
    neg_entropy: torch.Tensor

    def __getitem__(self, index) -> TeacherTargets:
        return TeacherTargets(self.probs[index], self.neg_entropy[index])

    def rows(self) -> TeacherTargets:
        """Every leading dim flattened into rows: (N, V) and (N,)."""
        return TeacherTargets(self.probs.reshape(-1, self.probs.shape[-1]), self.neg_entropy.reshape(-1))

    @staticmethod
    def nbytes(rows: int, vocab: int) -> int:
        return rows * (vocab + 1) * 4


# Logits of one chunk of rows at most this many values (128 MiB in fp32): over a 151,936-token vocabulary that is
# 220 rows, where 1,024 rows made the KL stage's fp32 logits, softmaxes and their gradients the peak of a conversion
CHUNK_VALUES = 2**25


def rows_per_chunk(vocab: int, values: int = CHUNK_VALUES) -> int:
    """Rows of one chunk of the chunked loss over ``vocab`` logits: at most ``values`` logits, at least 16 rows."""
    return max(16, values // max(1, vocab))


def _teacher_terms(ht, wt, bt) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, sum p log p) of one chunk of teacher rows, in fp32."""
    logp_t = torch.log_softmax(F.linear(ht, wt, bt).float(), dim=-1)
    p_t = logp_t.exp()
    return p_t, (p_t * logp_t).sum(-1)


@torch.no_grad()
def teacher_targets(teacher_hidden: torch.Tensor, teacher_head, chunk_rows: int = 1024) -> TeacherTargets:
    """:class:`TeacherTargets` of ``teacher_hidden`` (..., D) (after the teacher's final norm): the same
    numbers :func:`chunked_distill_loss` computes from the hidden states, for ``chunk_rows`` rows at a time."""
    wt, bt = _weight_bias(teacher_head)
    lead, h = teacher_hidden.shape[:-1], teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    probs = torch.empty(h.shape[0], wt.shape[0], dtype=torch.float32, device=h.device)
    neg_entropy = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], chunk_rows):
        probs[i : i + chunk_rows], neg_entropy[i : i + chunk_rows] = _teacher_terms(h[i : i + chunk_rows], wt, bt)
    return TeacherTargets(probs.view(*lead, -1), neg_entropy.view(lead))


def _chunk_terms(hs, ws, bs, ht, wt, bt, p_t, neg_entropy, labels, kl_scale: float, ce_scale: float):
    """One chunk of rows: (scaled loss, KL sum, CE sum). Logits and softmaxes in fp32. The teacher's side
    comes from its hidden states ``ht`` or, when kept (``ht`` None), as ``p_t`` and ``neg_entropy``."""
    logp_s = torch.log_softmax(F.linear(hs, ws, bs).float(), dim=-1)
    if ht is not None:
        with torch.no_grad():
            p_t, neg_entropy = _teacher_terms(ht, wt, bt)
    kl = (neg_entropy - (p_t * logp_s).sum(-1)).sum()
    if labels is not None:
        valid = labels >= 0
        nll = -logp_s.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
        ce = torch.where(valid, nll, torch.zeros_like(nll)).sum()
    else:
        ce = kl.new_zeros(())
    loss = kl * kl_scale + ce * ce_scale
    return loss, kl.detach(), ce.detach()


def chunked_distill_loss(
    student_hidden: torch.Tensor,  # (N, D) after the student's final norm
    student_head,  # nn.Linear (V <- D) or its weight
    teacher_hidden: torch.Tensor | TeacherTargets,  # (N, D') after the teacher's final norm, no grad; or kept targets
    teacher_head,  # nn.Linear or its weight; unused (may be None) with TeacherTargets
    labels: torch.Tensor | None = None,  # (N,) next-token ids, -100 where there is none
    *,
    ce_weight: float = 0.0,
    chunk_rows: int = 1024,
    use_checkpoint: bool = True,
    row_mask: torch.Tensor | None = None,  # (N,) bool: the rows the loss is over (an instruct answer's); None = all
) -> tuple[torch.Tensor, float, float]:
    """``(loss, mean KL, mean CE)`` with ``loss = (1 - w) mean KL(t || s) + w mean CE``.

    KL is averaged over all N rows (``row_mask``: over the rows it marks, the others never reach an LM head),
    CE over the rows with a label. Rows are processed ``chunk_rows`` at a time; with ``use_checkpoint`` (and grad
    enabled) each chunk is a ``torch.utils.checkpoint`` region, so only its inputs are kept for the backward pass
    and peak memory is O(chunk_rows x vocab), not O(N x vocab).
    """
    kept = isinstance(teacher_hidden, TeacherTargets)
    t_rows = teacher_hidden.probs if kept else teacher_hidden
    if student_hidden.dim() != 2 or t_rows.dim() != 2 or student_hidden.shape[0] != t_rows.shape[0]:
        raise TcalError(
            f"hidden states must be (N, D) with the same N, got {tuple(student_hidden.shape)} and "
            f"{tuple(t_rows.shape)}"
        )
    if row_mask is not None:
        if row_mask.shape != (student_hidden.shape[0],):
            raise TcalError(f"row_mask must be (N,) = ({student_hidden.shape[0]},), got {tuple(row_mask.shape)}")
        if not bool(row_mask.any()):
            raise TcalError("row_mask selects no rows: the loss would be over nothing")
        keep = row_mask.to(student_hidden.device).bool()
        student_hidden = student_hidden[keep]
        teacher_hidden = teacher_hidden[keep.to(t_rows.device)]
        t_rows = teacher_hidden.probs if kept else teacher_hidden
        labels = None if labels is None else labels[keep.to(labels.device)]
    if chunk_rows < 1:
        raise TcalError(f"chunk_rows must be positive, got {chunk_rows}")
    n = student_hidden.shape[0]
    ws, bs = _weight_bias(student_head)
    wt, bt = (None, None) if kept else _weight_bias(teacher_head)
    vocab_t = t_rows.shape[1] if kept else wt.shape[0]
    if ws.shape[0] != vocab_t:
        raise TcalError(f"student and teacher vocabularies differ ({ws.shape[0]} vs {vocab_t}); "
                        "distil from the teacher the hybrid was converted from")
    use_labels = labels if ce_weight > 0 else None
    if ce_weight > 0 and labels is None:
        raise TcalError("ce_weight > 0 needs labels (next-token ids)")
    n_ce = int((use_labels >= 0).sum()) if use_labels is not None else 0
    kl_scale = (1.0 - ce_weight) / n
    ce_scale = ce_weight / n_ce if n_ce else 0.0
    ckpt = use_checkpoint and torch.is_grad_enabled()
    loss = None
    kl_sum = torch.zeros((), dtype=torch.float64, device=student_hidden.device)
    ce_sum = torch.zeros((), dtype=torch.float64, device=student_hidden.device)
    for i in range(0, n, chunk_rows):
        rows = slice(i, i + chunk_rows)
        ht, p_t, neg_entropy = ((None, teacher_hidden.probs[rows], teacher_hidden.neg_entropy[rows]) if kept
                                else (teacher_hidden[rows], None, None))
        args = (student_hidden[rows], ws, bs, ht, wt, bt, p_t, neg_entropy,
                None if use_labels is None else use_labels[rows], kl_scale, ce_scale)
        if ckpt:
            part, kl_c, ce_c = _checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, kl_c, ce_c = _chunk_terms(*args)
        loss = part if loss is None else loss + part
        kl_sum += kl_c.double()
        ce_sum += ce_c.double()
    return loss, kl_sum.item() / n, (ce_sum.item() / n_ce if n_ce else float("nan"))


def lm_parts(model) -> tuple[nn.Module, nn.Module]:
    """(decoder up to the final norm, LM head) of an HF causal LM (``model.model``, ``lm_head``)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model") or "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or not isinstance(head, nn.Linear):
        raise TcalError(
            f"{type(model).__name__} does not expose its decoder and LM head (model.model, lm_head); "
            "distillation supports HF decoder-only causal LMs"
        )
    if getattr(model.config, "final_logit_softcapping", None):
        raise TcalError(f"{type(model).__name__} soft-caps its logits, which the chunked KL does not apply")
    return base, head


def final_hidden(base: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = base(input_ids=ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def mask_rows(mask: torch.Tensor | None, index, dev) -> torch.Tensor | None:
    """The flat (B*T,) row mask of the sequences ``index`` of an (N, T) mask, on ``dev``; None where every row counts."""
    return None if mask is None else mask[index].reshape(-1).to(dev)


@torch.no_grad()
def mean_kl(hybrid, teacher, ids: torch.Tensor, batch_size: int,
            hidden: torch.Tensor | TeacherTargets | None = None, mask: torch.Tensor | None = None) -> float:
    """Mean KL(teacher || hybrid) per predicted token over ``ids`` (N, T); ``hidden``: the teacher's side of the
    same ids, if kept (``teacher_hidden`` or :class:`TeacherTargets`); ``mask`` (N, T): only the positions it marks
    count (an instruct answer's)."""
    base_s, head_s = lm_parts(hybrid)
    base_t, head_t = lm_parts(teacher)
    dev = head_s.weight.device
    chunk = rows_per_chunk(head_s.weight.shape[0])
    total, n = 0.0, 0
    for s in range(0, ids.shape[0], batch_size):
        mb = ids[s : s + batch_size].to(dev)
        rows = mask_rows(mask, slice(s, s + batch_size), dev)
        count = mb.numel() if rows is None else int(rows.sum())
        if not count:
            continue
        hs = final_hidden(base_s, mb)
        ht = hidden[s : s + batch_size] if hidden is not None else final_hidden(base_t, mb)
        ht = ht.rows() if isinstance(ht, TeacherTargets) else ht.reshape(-1, ht.shape[-1])
        _, kl, _ = chunked_distill_loss(hs.reshape(-1, hs.shape[-1]), head_s, ht, head_t, use_checkpoint=False,
                                        chunk_rows=chunk, row_mask=rows)
        total, n = total + kl * count, n + count
    if not n:
        raise TcalError("the held-out KL has no position to score: its mask marks none")
    return total / n
