"""The recall mix: token windows that end with a verbatim copy of an earlier span of themselves.

Ordinary text seldom asks a model to find something far back in its context. On a repeated span the
teacher copies from wherever the first occurrence lies, so a KL on the copy asks a student for that
skill at every distance up to the window's length, without a question template or a haystack of the
evaluation's. Which windows get a copy, and from where, is a function of (seed, sample) alone.
"""
from __future__ import annotations

import numpy as np
import torch


def with_recall(window: np.ndarray, source: int, span: int) -> np.ndarray:
    """A copy of ``window`` whose last ``span`` tokens repeat ``window[source:source + span]``.

    The source must end before the copy starts, so the copy repeats text the window still holds."""
    n = len(window)
    if span < 1 or source < 0 or source + span > n - span:
        raise ValueError(f"a {span}-token span at {source} does not fit before the last {span} of {n} tokens")
    out = np.array(window, copy=True)
    out[n - span:] = window[source:source + span]
    return out


def recall_source(seed: int, sample: int, seq_len: int, frac: float, span: int) -> int | None:
    """Where sample ``sample``'s repeated span starts, or None for a window left as it is."""
    if frac <= 0:
        return None
    rng = np.random.default_rng([seed, 1, int(sample)])  # a stream of its own: a data order's stays as it was
    if rng.random() >= frac:
        return None
    return int(rng.integers(0, seq_len - 2 * span + 1))


def recall_window(window: np.ndarray, seed: int, sample: int, frac: float, span: int) -> np.ndarray:
    """``window`` as sample ``sample`` of the mix has it: as it is, or ending with a copy of its own span."""
    source = recall_source(seed, sample, len(window), frac, span)
    return window if source is None else with_recall(window, source, span)


def recall_rows(ids: torch.Tensor, seed: int, frac: float, span: int, first_sample: int = 0) -> torch.Tensor:
    """``ids`` (N, T) with the recall mix applied to each row; row n is sample ``first_sample + n``."""
    rows = [recall_window(row, seed, first_sample + n, frac, span) for n, row in enumerate(ids.cpu().numpy())]
    return torch.from_numpy(np.stack(rows)).to(ids.device) if rows else ids
