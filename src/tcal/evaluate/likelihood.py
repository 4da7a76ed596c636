"""Held-out perplexity with a fixed, recorded protocol.

Protocol: the corpus is tokenised into one stream (documents joined by the tokenizer's EOS,
see :func:`tcal.data.tokens.corpus_tokens`); the first ``windows`` full windows of ``window`` tokens
at ``stride`` (default ``window``: non-overlapping) are scored independently (no state carried
between windows); every window contributes its ``window - 1`` next-token predictions;
``nll`` = mean negative log-likelihood (nats) over all of them and ``ppl = exp(nll)``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tcal.data.corpora import as_corpus
from tcal.data.tokens import token_windows, window_prefix
from tcal.utils.errors import TcalError
from tcal.utils.runtime import model_device


def _forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    try:
        out = model(input_ids=ids, use_cache=False)
    except TypeError:
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out[0]


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, *, batch_size: int = 4, device=None, progress: bool = True,
               desc: str = "perplexity") -> tuple[float, int]:
    """Sum of next-token NLL (nats, float64) over ``windows`` [N, W] and the number of predictions."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise TcalError(f"windows must be a [N, W>=2] token tensor, got shape {tuple(windows.shape)}")
    if batch_size < 1:
        raise TcalError(f"batch size must be at least 1, got {batch_size}")
    model_dev = model_device(model)
    device = torch.device(device) if device is not None else model_dev
    if device.type != model_dev.type or (device.index is not None and model_dev.index is not None
                                         and device.index != model_dev.index):
        raise TcalError(f"the model is on {model_dev} but device={device} was asked; move the model first (model.to('{device}'))")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        n = windows.shape[0]
        for i in tqdm(range(0, n, batch_size), desc=desc, disable=not progress, leave=False,
                      total=math.ceil(n / batch_size), unit="batch"):
            ids = windows[i:i + batch_size].to(device=device, dtype=torch.long)
            logits = _forward_logits(model, ids)
            targets = ids[:, 1:]
            for b in range(ids.shape[0]):  # one row at a time: bounds the fp32 copy of the logits
                lb = logits[b, :-1].float()
                total += F.cross_entropy(lb, targets[b], reduction="sum").double().item()
                count += targets.shape[1]
            del logits
    finally:
        model.train(was_training)
    return total, count


def perplexity_report(model, tokenizer, data, window: int = 512, windows: int = 64, *, stride: int | None = None,
                      batch_size: int = 4, device=None, progress: bool = True, cache_dir=None) -> dict:
    """Perplexity plus the protocol that produced it.

    ``data``: corpus spec (``wiki:eval``), Corpus, file/directory path, raw text, or an
    already-cut ``[N, W]`` token tensor (then ``window``/``windows`` are taken from its shape).
    Returns a dict with ``ppl, nll, tokens`` (predicted tokens = windows * (window - 1)),
    ``window, windows, stride, data`` (its name), ``data_hash`` (content sha256, first 16),
    ``model``, ``dtype``, ``device``, ``seconds``. ``device`` (default: the model's) is where the
    token windows go; the model must already be there. ``cache_dir``: the tcal cache (token arrays).
    """
    t0 = time.time()
    if isinstance(data, torch.Tensor):
        ids = data
        name, dhash = "tensor", None
        window, windows = int(ids.shape[-1]), int(ids.shape[0])
        stride = stride or window
    else:
        if tokenizer is None:
            raise TcalError("perplexity of text needs the model's tokenizer: pass tokenizer= "
                            "(or token windows as an (N, W) tensor)")
        corpus = as_corpus(data, cache_dir=cache_dir)
        name, dhash = corpus.name, corpus.content_hash[:16]
        ids = token_windows(corpus, tokenizer, window=window, n_windows=windows, stride=stride, cache_dir=cache_dir)
        prefix = window_prefix(tokenizer)
        stride = stride or window - len(prefix)
    total, count = window_nll(model, ids, batch_size=batch_size, device=device, progress=progress,
                              desc=f"perplexity {name}")
    nll = total / count
    dev = torch.device(device) if device is not None else model_device(model)
    try:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    except StopIteration:
        dtype = None
    cfg = getattr(model, "config", None)
    return {
        "ppl": math.exp(nll),
        "nll": nll,
        "tokens": count,
        "window": window,
        "windows": windows,
        "stride": stride,
        "window_prefix": None if isinstance(data, torch.Tensor) else prefix,  # e.g. [BOS]: every window starts so
        "data": name,
        "data_hash": dhash,
        "model": getattr(cfg, "name_or_path", None) or type(model).__name__,
        "dtype": dtype,
        "device": str(dev),
        "seconds": round(time.time() - t0, 2),
    }


def window_ppl(model, windows: torch.Tensor, **kwargs) -> float:
    """exp(mean next-token NLL) over token windows [N, W]; ``kwargs`` as for :func:`window_nll`."""
    total, count = window_nll(model, windows, **kwargs)
    return math.exp(total / count)


def perplexity(model, tokenizer, data, window: int = 512, windows: int = 64, *, stride: int | None = None,
               batch_size: int = 4, device=None, progress: bool = True, cache_dir=None) -> float:
    """exp(mean next-token NLL) over the first ``windows`` windows of ``window`` tokens of ``data``
    (see the module docstring for the protocol; :func:`perplexity_report` also returns it)."""
    return perplexity_report(model, tokenizer, data, window, windows, stride=stride, batch_size=batch_size,
                             device=device, progress=progress, cache_dir=cache_dir)["ppl"]
