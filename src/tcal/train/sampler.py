"""The training data order: a function of (seed, step) alone, so a resumed run sees exactly the
batches an uninterrupted run sees.

The token stream is cut into non-overlapping windows of ``seq_len`` tokens. Training sample
``i = step * batch_size + b`` is window ``perm_e[i mod n]`` of epoch ``e = i div n``, with
``perm_e = default_rng([seed, e]).permutation(n)``. Packed data has no padding: every step trains
on ``batch_size * seq_len`` tokens.

A recall mix (``recall_frac`` > 0, tcal.data.recall) turns a share of the windows into ones that end
with a verbatim copy of an earlier span of themselves; which ones, and which span, is a function of
(seed, sample) alone, like the order.

A ``prefix`` (the tokens the tokenizer puts before every text: Gemma's BOS) starts every window, as every text the
teacher was trained on did; the stream is then cut into windows of ``seq_len - len(prefix)`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tcal.data.recall import recall_window
from tcal.utils.errors import TcalError


class WindowOrder:
    """Sample ``i`` -> window index: ``perm_e[i mod n]`` with ``perm_e = default_rng([seed, e]).permutation(n)``."""

    def __init__(self, n_windows: int, seed: int):
        if n_windows < 1:
            raise TcalError("the training data has no full window; use a larger pool or a shorter --seq-len")
        self.n, self.seed = int(n_windows), int(seed)
        self._epoch, self._perm = None, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n)
            self._epoch = epoch
        return self._perm

    def window(self, sample: int) -> int:
        epoch, pos = divmod(int(sample), self.n)
        return int(self.permutation(epoch)[pos])


def batch_for_step(tokens: np.ndarray, order: WindowOrder, seq_len: int, step: int, batch_size: int,
                   rows: range | None = None, *, recall_frac: float = 0.0, recall_span: int = 0,
                   prefix: tuple[int, ...] = ()) -> torch.Tensor:
    """The (batch_size, seq_len) LongTensor that step ``step`` trains on, or only its rows ``rows``
    (one rank's share: the ranks' shares together are the same batch)."""
    body = seq_len - len(prefix)  # stream tokens per window
    head = np.asarray(prefix, dtype=np.int64)
    picked = []
    for b in range(batch_size) if rows is None else rows:
        sample = step * batch_size + b
        start = order.window(sample) * body
        window = np.asarray(tokens[start:start + body], dtype=np.int64)
        window = recall_window(window, order.seed, sample, recall_frac, recall_span)
        picked.append(np.concatenate([head, window]) if len(head) else window)
    return torch.from_numpy(np.stack(picked))




@dataclass
class Stream:
    """One training stream: its tokens (flat), the answer mask of an instruct set (flat, the same length; None: the
    loss is over every position) and its own data order over windows of ``seq_len - len(prefix)`` tokens."""

    tokens: np.ndarray
    order: WindowOrder
    mask: np.ndarray | None = None
    prefix: tuple[int, ...] = ()
    recall_frac: float = 0.0  # raw text only: an instruct window's mask would not fit a copied span
    recall_span: int = 0


def mix_rows(batch_size: int, mix_frac: float) -> int:
    """Rows of every batch the second stream of a mix fills: its share of the batch, rounded, at least one where the
    share is positive and at most batch_size - 1 where it is below one."""
    if mix_frac <= 0:
        return 0
    if mix_frac >= 1:
        return batch_size
    return min(batch_size - 1, max(1, round(batch_size * mix_frac)))


def mixed_batch_for_step(streams: list[tuple[Stream, int]], seq_len: int, step: int,
                         rows: range | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (B, seq_len) ids and loss mask (None when no stream has one) that step ``step`` trains on: the first
    stream's ``n_0`` rows, then the next stream's ``n_1``, ... (``streams``: (stream, rows per batch) pairs); the
    k-th row a stream fills at step s is its sample ``s * n + k``, so each stream keeps its own data order whatever
    the others do. ``rows``: one rank's share of the batch's rows."""
    total = sum(n for _, n in streams)
    owner = [(stream, n, k) for stream, n in streams for k in range(n)]
    ids, masks = [], []
    any_mask = any(stream.mask is not None for stream, _ in streams)
    for b in range(total) if rows is None else rows:
        stream, n, k = owner[b]
        sample = step * n + k
        body = seq_len - len(stream.prefix)
        start = stream.order.window(sample) * body
        window = np.asarray(stream.tokens[start:start + body], dtype=np.int64)
        window = recall_window(window, stream.order.seed, sample, stream.recall_frac, stream.recall_span)
        head = np.asarray(stream.prefix, dtype=np.int64)
        ids.append(np.concatenate([head, window]) if len(head) else window)
        if any_mask:
            if stream.mask is None:  # raw text: the loss is over every position, as without a mix
                m = np.ones(seq_len, dtype=bool)
            else:
                m = np.zeros(seq_len, dtype=bool)
                m[len(head):] = np.asarray(stream.mask[start:start + body], dtype=bool)
            masks.append(m)
    return torch.from_numpy(np.stack(ids)), (torch.from_numpy(np.stack(masks)) if any_mask else None)
