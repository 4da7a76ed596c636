"""Token pools for distillation-scale data (tens of millions of tokens) from text that packages ship.

A pool is a directory::

    manifest.json         sources, token counts, tokenizer identity, parts with sha256
    tokens-00000.bin      raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    tokens-00001.bin      ... each part at most ``max_file_mb`` MiB

Documents are joined with the tokenizer's EOS between them, in source order; the sources are
in :mod:`tcal.data.pool_sources`. Evaluation text never enters a pool: a source whose text overlaps a
built-in evaluation split (:mod:`tcal.data.overlap`) fails the build. A source that fails to fetch is
skipped with a warning and recorded in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tcal.data.overlap import NgramCounter, check_ngrams, eval_corpora
from tcal.data.pool_sources import SourceUnavailable, resolve_source
from tcal.data.tokens import encode_documents, separator_id, tokenizer_id
from tcal.utils.atomic import atomic_dir
from tcal.utils.cache import sha256_file
from tcal.utils.errors import TcalError
from tcal.utils.progress import say

POOL_FORMAT = "tcal-pool-v1"
DEFAULT_POOL_SOURCES = ("sotu", "brown", "python-doc", "postgres-doc", "linux-doc")


# --------------------------------------------------------------------------------------
# writing and reading pools
# --------------------------------------------------------------------------------------


class _PartWriter:
    def __init__(self, out: Path, dtype, part_tokens: int):
        self.out, self.dtype, self.part_tokens = out, np.dtype(dtype), part_tokens
        self.parts: list[dict] = []
        self.f = None
        self.in_part = 0
        self.total = 0
        self.h = None

    def _open(self):
        name = f"tokens-{len(self.parts):05d}.bin"
        self.f = open(self.out / name, "wb")
        self.h = hashlib.sha256()
        self.parts.append({"file": name, "tokens": 0})
        self.in_part = 0

    def write(self, ids) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        while len(arr):
            if self.f is None or self.in_part >= self.part_tokens:
                self._finish_part()
                self._open()
            take = min(len(arr), self.part_tokens - self.in_part)
            b = arr[:take].astype(self.dtype.newbyteorder("<")).tobytes()
            self.f.write(b)
            self.h.update(b)
            self.in_part += take
            self.total += take
            self.parts[-1]["tokens"] += take
            arr = arr[take:]

    def _finish_part(self):
        if self.f is not None:
            self.f.close()
            self.parts[-1]["bytes"] = self.parts[-1]["tokens"] * self.dtype.itemsize
            self.parts[-1]["sha256"] = self.h.hexdigest()
            self.f = None

    def close(self) -> list[dict]:
        self._finish_part()
        return self.parts


def _write_source(writer: _PartWriter, rec: dict, documents, tokenizer, sep, max_tokens, bar,
                  ngrams: NgramCounter) -> bool:
    """Tokenise one source's documents (in batches of 64) into the pool, and their n-grams into ``ngrams``;
    True if cut at ``max_tokens``."""
    batch: list[str] = []

    def flush() -> bool:
        for text, ids in zip(batch, encode_documents(tokenizer, batch, progress=False)):
            ngrams.add(text)
            ids = list(ids)
            if writer.total and sep is not None:
                ids = [sep] + ids
            cut = max_tokens is not None and writer.total + len(ids) >= max_tokens
            if cut:
                ids = ids[: max_tokens - writer.total]
            writer.write(ids)
            rec["documents"] += 1
            rec["tokens"] += len(ids)
            rec["chars"] += len(text)
            bar.update(1)
            if cut:
                return True
        bar.set_postfix(tokens=f"{rec['tokens'] / 1e6:.2f}M")
        batch.clear()
        return False

    for text in documents:
        if text and text.strip():
            batch.append(text)
        if len(batch) >= 64 and flush():
            return True
    return bool(batch) and flush()


def build_pool(tokenizer, out_path, *, sources=DEFAULT_POOL_SOURCES, max_tokens: int | None = None,
               max_file_mb: float = 60, cache_dir=None, progress: bool = True) -> dict:
    """Tokenise ``sources`` into a pool directory at ``out_path`` (written atomically; an
    existing pool there is replaced). Returns the manifest (also written as manifest.json).

    ``max_tokens`` stops after that many tokens in all; ``max_file_mb`` bounds each part file.
    """
    if max_tokens is not None and max_tokens < 1:
        raise TcalError(f"max_tokens must be positive, got {max_tokens}")
    if not max_file_mb or max_file_mb <= 0:
        raise TcalError(f"max_file_mb must be positive, got {max_file_mb}")
    resolved = [resolve_source(s, cache_dir) for s in sources]  # refuse bad sources before any work
    if not resolved:
        raise TcalError("no pool sources given; use e.g. sources=('sotu', 'brown')")
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    part_tokens = max(1, int(max_file_mb * (1 << 20)) // np.dtype(dtype).itemsize)
    out = Path(out_path)
    if out.exists() and not (out / "manifest.json").is_file():
        if not out.is_dir() or any(out.iterdir()):
            raise TcalError(f"{out} exists and is not a tcal pool; choose a new output path")
    sep = separator_id(tokenizer)
    with atomic_dir(out) as tmp:
        writer = _PartWriter(tmp, dtype, part_tokens)
        records = []
        for name, docs_fn, note in resolved:
            rec = {"name": name, "note": note, "status": "ok", "documents": 0, "tokens": 0, "chars": 0}
            records.append(rec)
            if max_tokens is not None and writer.total >= max_tokens:
                rec["status"] = "not used (max_tokens reached)"
                continue
            t0 = time.time()
            bar = tqdm(desc=f"pool {name}", unit="doc", disable=not progress, leave=True)
            ngrams = NgramCounter()
            try:
                if _write_source(writer, rec, docs_fn(), tokenizer, sep, max_tokens, bar, ngrams):
                    rec["status"] = "ok (cut at max_tokens)"
            except (SourceUnavailable, TcalError, OSError, subprocess.SubprocessError) as e:
                rec["status"] = "skipped" if rec["documents"] == 0 else f"failed after {rec['documents']} documents"
                rec["reason"] = str(e)[:300]
                warnings.warn(f"tcal pool: source {name} {rec['status']}: {rec['reason']}", stacklevel=2)
            finally:
                bar.close()
            # evaluation text never enters a pool: a source that holds some fails the build (nothing is written)
            found = check_ngrams(name, ngrams.hashes(), role="pool source", cache_dir=cache_dir)
            rec["eval_overlap"] = {o.eval: round(o.data_share, 6) for o in found if o.shared}
            rec["seconds"] = round(time.time() - t0, 1)
        parts = writer.close()
        if writer.total == 0:
            why = "; ".join(f"{r['name']}: {r.get('reason', r['status'])}" for r in records)
            raise TcalError(f"the pool is empty: no source gave any text ({why}); check network access or use dir:PATH sources")
        manifest = {
            "format": POOL_FORMAT,
            "dtype": np.dtype(dtype).name,
            "byteorder": "little",
            "total_tokens": writer.total,
            "separator_token_id": sep,
            "tokenizer": {
                "id": tokenizer_id(tokenizer),
                "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
                "class": type(tokenizer).__name__,
                "vocab_size": vocab,
            },
            "max_file_mb": max_file_mb,
            # the evaluation text every source was checked against (tcal.data.overlap); a source's eval_overlap:
            # the share of its distinct n-grams found in each (below the refusal limit, or the build failed)
            "eval_checked": [c.name for c in eval_corpora((), cache_dir=cache_dir)],
            "sources": records,
            "parts": parts,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    say(f"pool {out}: {writer.total:,} tokens in {len(parts)} part(s) from "
        + ", ".join(f"{r['name']} {r['tokens']:,}" for r in records if r["tokens"]))
    return manifest


def read_manifest(path) -> dict:
    mpath = Path(path) / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise TcalError(f"{path} is not a tcal pool (no manifest.json); build one with build_pool") from None
    except (OSError, ValueError) as e:
        raise TcalError(f"cannot read {mpath} ({e}); rebuild the pool") from None
    if manifest.get("format") != POOL_FORMAT:
        raise TcalError(f"{mpath} has format {manifest.get('format')!r}, expected {POOL_FORMAT}; rebuild the pool")
    return manifest


def load_pool(path, *, verify: bool = False) -> np.ndarray:
    """The pool's tokens as one 1-D array: a read-only ``np.memmap`` when the pool has one part,
    else the parts concatenated in memory. ``verify=True`` checks each part's sha256 first."""
    path = Path(path)
    manifest = read_manifest(path)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    arrays = []
    for part in manifest["parts"]:
        f = path / part["file"]
        if not f.is_file() or f.stat().st_size != part["tokens"] * dtype.itemsize:
            raise TcalError(f"pool part {f} is missing or has the wrong size; rebuild the pool")
        if verify:
            if sha256_file(f) != part["sha256"]:
                raise TcalError(f"pool part {f} fails its sha256 check; rebuild the pool")
        arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays)


def sample_windows(tokens: np.ndarray, window: int, n: int, *, seed: int | None = None):
    """``n`` random windows of ``window`` tokens from a pool (``torch.LongTensor [n, window]``)."""
    if len(tokens) < window:
        raise TcalError(f"pool has {len(tokens)} tokens, fewer than one window of {window}; use a larger pool")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - window + 1, size=n)
    idx = starts[:, None] + np.arange(window)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
