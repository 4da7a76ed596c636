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


