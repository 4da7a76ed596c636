"""Tokenisation of corpora into one token stream, and the fixed-protocol token windows.

A corpus becomes ``doc0 SEP doc1 SEP ... doc_last`` (SEP = the tokenizer's EOS, see
:func:`separator_id`), cached per (corpus content, tokenizer identity). Windows are cut from that
stream (:func:`token_windows`).
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from tcal.data.corpora import as_corpus, spec_parts
from tcal.utils.atomic import atomic_save_npy
from tcal.utils.cache import cache_root
from tcal.utils.errors import TcalError

# Text whose token ids enter the tokenizer's identity: words, casing, digits, whitespace runs, code,
# accents and CJK, so that two tokenizers which split any of these differently get different ids.
_ID_PROBE = ("Hello world! The year 1984, 3.14159 and 1,000,000.\n\n  def f(x):\n\treturn x**2  # ok\n"
             "CAFÉ naïve Größe \u00e9t\u00e9 \u4f60\u597d\u4e16\u754c -- <|endoftext|> </s> [SEP]")


def tokenizer_id(tokenizer) -> str:
    """A stable identity of a tokenizer's behaviour: sha256 of its vocabulary (id -> token), its
    special tokens and document separator, and the ids it gives a probe text; 16 hex digits.

    Behaviour, not serialisation: the same tokenizer loaded by two transformers releases can come
    back as a different class with a differently serialised backend while giving the same ids
    (transformers 5.17 vs 5.2x on the SmolLM2 GGUF), and a pool built on one must load on the other."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode("utf-8", "surrogatepass"))
    specials = sorted(str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or []))
    h.update(repr((separator_id(tokenizer), specials)).encode())
    h.update(repr(list(tokenizer.encode(_ID_PROBE, add_special_tokens=False))).encode())
    return h.hexdigest()[:16]


def separator_id(tokenizer) -> int | None:
    """The token put between documents: EOS, else SEP, else BOS, else none."""
    for attr in ("eos_token_id", "sep_token_id", "bos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return None


def window_prefix(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before every text it encodes (Gemma's and Llama 3's BOS; none for
    SmolLM2): every window starts with them, as every text the model was trained on did. Without its BOS
    Gemma 3 scores twice the perplexity on the same tokens (docs/data.md, *Perplexity protocol*)."""
    probe = "The river rose."
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    if len(full) > len(plain) and full[len(full) - len(plain):] == plain:
        return full[: len(full) - len(plain)]
    return []


def encode_documents(tokenizer, documents: Sequence[str], *, batch: int = 256, progress: bool | None = None,
                     desc: str = "tokenising") -> Iterator[list[int]]:
    """Token ids of each document, no special tokens added, in order (batched for fast tokenizers)."""
    total = sum(len(d) for d in documents)
    if progress is None:
        progress = total > 2_000_000
    from tqdm import tqdm

    bar = tqdm(total=total, unit="char", unit_scale=True, desc=desc, disable=not progress, leave=False)
    for i in range(0, len(documents), batch):
        chunk = list(documents[i:i + batch])
        try:
            enc = tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
        except TypeError:
            enc = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        for ids in enc:
            yield list(ids)
        bar.update(sum(len(d) for d in chunk))
    bar.close()


def _slug(name: str) -> str:
    base = os.path.basename(name.rstrip("/")) or name
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._") or "corpus"
    return s[:40]


def corpus_tokens(data, tokenizer, *, cache_dir=None, cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise a corpus into one stream: doc0, SEP, doc1, SEP, ..., doc_last (SEP = the
    tokenizer's EOS, see :func:`separator_id`; no BOS/EOS added inside documents).

    Returns ``(tokens uint32 [N], bounds int64 [D, 2])`` where ``bounds[i] = (start, end)`` of
    document i in the stream (separator excluded). Cached under
    ``<cache>/tokens/<name>-<content hash>-<tokenizer id>.npy`` (+ ``.bounds.npy``) unless
    ``cache=False`` or the data is raw text.
    """
    corpus = as_corpus(data, cache_dir=cache_dir)
    use_cache = cache and not corpus.name.startswith("text:")
    if use_cache:
        stem = f"{_slug(corpus.name)}-{corpus.content_hash[:16]}-{tokenizer_id(tokenizer)}"
        tdir = cache_root(cache_dir) / "tokens"
        tpath, bpath = tdir / f"{stem}.npy", tdir / f"{stem}.bounds.npy"
        if tpath.exists() and bpath.exists():
            try:
                return np.load(tpath), np.load(bpath)
            except (OSError, ValueError):
                pass  # damaged cache entry: rebuild it
    sep = separator_id(tokenizer)
    pieces, bounds, pos = [], [], 0
    for i, ids in enumerate(encode_documents(tokenizer, corpus.documents, desc=f"tokenising {corpus.name}")):
        if i and sep is not None:
            pieces.append(np.array([sep], dtype=np.uint32))
            pos += 1
        arr = np.asarray(ids, dtype=np.uint32)
        pieces.append(arr)
        bounds.append((pos, pos + len(arr)))
        pos += len(arr)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)
    bounds_arr = np.asarray(bounds, dtype=np.int64).reshape(-1, 2)
    if use_cache:
        atomic_save_npy(bpath, bounds_arr)
        atomic_save_npy(tpath, tokens)
    return tokens, bounds_arr


def window_starts(tokens_len: int, bounds: np.ndarray | None, *, window: int, stride: int,
                  respect_docs: bool) -> np.ndarray:
    """Start offsets of all full windows, in order."""
    if not respect_docs:
        if tokens_len < window:
            return np.zeros(0, dtype=np.int64)
        return np.arange(0, tokens_len - window + 1, stride, dtype=np.int64)
    starts = [np.arange(s, e - window + 1, stride, dtype=np.int64) for s, e in bounds if e - s >= window]
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def token_windows(data, tokenizer, *, window: int, n_windows: int | None, stride: int | None = None,
                  respect_docs: bool = False, seed: int | None = None, cache_dir=None):
    """Cut a corpus into ``(N, window)`` token windows (a ``torch.LongTensor``).

    - ``data``: corpus spec, Corpus, path or raw text (see :func:`as_corpus`).
    - Documents are joined with the tokenizer's EOS between them (:func:`corpus_tokens`).
    - A tokenizer that puts a BOS before every text (:func:`window_prefix`) gets it at the start of every
      window: a window is then the BOS and the next ``window - 1`` tokens of the stream.
    - Windows start at 0, stride, 2*stride, ... of the stream (``stride`` defaults to the stream tokens a
      window holds: no overlap); only full windows are used.
    - ``respect_docs=True``: windows are cut inside each document separately and never cross a
      document boundary; documents shorter than ``window`` give no window (they are not packed).
    - ``n_windows=None``: all windows. ``seed=None``: the first ``n_windows`` in order (a fixed
      protocol); ``seed=int``: ``n_windows`` windows (all of them when None) sampled without
      replacement, in random order.
    - Too few tokens: TcalError naming the token count and what was asked.
    """
    if window < 2:
        raise TcalError(f"window must be at least 2 tokens, got {window}; use e.g. --window 512")
    prefix = window_prefix(tokenizer)
    full, window = window, window - len(prefix)  # window: the stream tokens of each window from here on
    if window < 1:
        raise TcalError(f"window must be longer than the {len(prefix)} token(s) every window starts with, "
                        f"got {full}; use e.g. --window 512")
    stride = window if stride is None else int(stride)
    if stride < 1:
        raise TcalError(f"stride must be a positive number of tokens, got {stride}; leave it unset for non-overlapping windows")
    if n_windows is not None and n_windows < 1:
        raise TcalError(f"number of windows must be at least 1, got {n_windows}")
    corpus = as_corpus(data, cache_dir=cache_dir)
    tokens, bounds = corpus_tokens(corpus, tokenizer, cache_dir=cache_dir)
    starts = window_starts(len(tokens), bounds, window=window, stride=stride, respect_docs=respect_docs)
    if len(starts) == 0 or (n_windows is not None and len(starts) < n_windows):
        m = n_windows if n_windows is not None else 1
        if respect_docs:
            raise TcalError(
                f"corpus {corpus.name} has {len(tokens)} tokens in {len(bounds)} documents, giving {len(starts)} "
                f"windows of {full} inside documents, {m} asked; use fewer or shorter windows, respect_docs=False, or a larger corpus"
            )
        need = (m - 1) * stride + window
        what = f"{m} windows of {full}" + (f" at stride {stride}" if stride != window else "")
        formula = f"{window}*{m}" if stride == window else f"{stride}*{m - 1}+{window}"
        raise TcalError(
            f"corpus {corpus.name} has {len(tokens)} tokens, {what} asked (needs {formula} = {need}); "
            f"use fewer windows or a larger corpus (or a mixture a+b, e.g. wiki:calib+shakespeare:calib)"
        )
    if seed is not None:
        rng = np.random.default_rng(seed)
        starts = starts[rng.choice(len(starts), size=n_windows or len(starts), replace=False)]
    elif n_windows is not None:
        starts = starts[:n_windows]
    idx = starts[:, None] + np.arange(window, dtype=np.int64)[None, :]
    out = tokens[idx].astype(np.int64)
    if prefix:
        out = np.concatenate([np.tile(np.asarray(prefix, dtype=np.int64), (len(out), 1)), out], axis=1)
    return torch.from_numpy(out)




def mixture_parts(data) -> list:
    """``"wiki:calib+shakespeare:calib"`` -> its parts; anything else (a path that exists included) -> [data]."""
    parts = spec_parts(data, "+")
    if len(parts) > 1 and (any(not p for p in parts) or len(set(parts)) != len(parts)):
        raise TcalError(f"corpus mixture {data!r} has an empty or repeated part; e.g. wiki:calib+sotu:calib")
    return parts


def mixed_windows(data, tokenizer, *, window: int, n_windows: int, cache_dir=None):
    """``n_windows`` windows of ``window`` tokens from a mixture ``"a+b+c"`` (or one corpus):
    the first n_windows/k windows of each part (the first parts take the remainder), interleaved
    a, b, c, a, b, c... so that any prefix or suffix of the rows (the training and the held-out
    calibration sequences) holds every domain."""
    parts = mixture_parts(data)
    if len(parts) == 1:
        return token_windows(parts[0], tokenizer, window=window, n_windows=n_windows, cache_dir=cache_dir)
    if n_windows < len(parts):
        raise TcalError(f"{n_windows} windows cannot mix {len(parts)} corpora; ask for at least {len(parts)}")
    k, extra = divmod(n_windows, len(parts))
    chunks = [token_windows(p, tokenizer, window=window, n_windows=k + (j < extra), cache_dir=cache_dir)
              for j, p in enumerate(parts)]
    rows = [c[r] for r in range(k + 1) for c in chunks if r < c.shape[0]]
    return torch.stack(rows)
