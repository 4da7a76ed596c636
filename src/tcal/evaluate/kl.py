"""The mean KL(teacher || model) per predicted token over fixed sequences: how far a hybrid's next-token
distributions are from its teacher's. The KL stage picks its state by it (:mod:`tcal.taylor.kl_stage`) and the
``answer_kl`` task scores a training curve's development answers with it."""
from __future__ import annotations

import torch

from tcal.modules.distill_loss import TeacherTargets, chunked_distill_loss, final_hidden, lm_parts, rows_per_chunk
from tcal.utils.errors import TcalError


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
