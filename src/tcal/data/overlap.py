"""Whether calibration, training or pool text contains evaluation text, read from the text itself.

Text is normalised (lower case, every run of characters that are not letters, digits or ``_`` one space,
so that reflowed lines, changed punctuation or casing still match) and cut into word n-grams of
:data:`NGRAM` words inside each document. Each n-gram is hashed to 64 bits (a polynomial hash of its
normalised bytes mod 2^64, vectorised over the whole text, then mixed by splitmix64's finaliser). Two texts
overlap by the *distinct* n-grams they share:

- the data's share: shared / the data's distinct n-grams (how much of the data is evaluation text);
- the evaluation text's share: shared / that text's distinct n-grams (how much of it the data holds).

Counting distinct n-grams, a licence header or a stock phrase repeated in every document counts once, so
boilerplate does not add up to a share. Data is refused when either share reaches :data:`MAX_SHARE`; the
values and the measurements they come from are in docs/data.md (*Disjointness check*).

The evaluation side is the evaluation text a command is given and every built-in ``:eval`` split
(:data:`tcal.data.corpora.BUILTIN_CORPORA`) whose package is in the tcal cache: the check downloads nothing,
and a split whose package was never fetched to this cache has not been evaluated on with it. The n-grams of
each built-in split are cached in ``<cache>/overlap/`` by content hash, and so is the result of checking a
built-in corpus against them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tcal.data.corpora import BUILTIN_CORPORA, PATH_STARTS, Corpus, as_corpus, path_exists, spec_parts
from tcal.utils.atomic import atomic_save_npy, write_json
from tcal.utils.cache import NotInCache, cache_root, cached_only
from tcal.utils.errors import TcalError

# Chosen by measurement (docs/data.md, *Disjointness check*): at 13 words the built-in calibration splits share at
# most 0.22 % of their n-grams with an evaluation split (sotu), Python packages split the same way 0.03-1.9 %
# (covering up to 6.3 % of the evaluation half), while a file holding wiki:eval, or half of it, shares 85 %.
NGRAM = 13  # words per n-gram
# data is refused when this share of its distinct n-grams occur in one evaluation text, or when it holds this share
# of that text's distinct n-grams
MAX_SHARE = 0.20
VERSION = 1  # of the normalisation and hash: part of every cache key

_NON_WORD = re.compile(r"\W+")
_SPACE, _DOC = 32, 10  # word and document separators in the normalised bytes
_P = 0x100000001B3  # odd, so invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
PIECE_BYTES = 1 << 21  # normalised text hashed at a time (longer documents are cut at a space)
_POWERS: dict = {}


def normalise(text: str) -> str:
    """Lower case, every run of non-word characters one space, no space at either end."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def _powers(base: int, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64 (cached; uint64 arithmetic wraps mod 2^64)."""
    have = _POWERS.get(base)
    if have is None or len(have) < n:
        size = max(n, PIECE_BYTES + 1)
        have = np.empty(size, dtype=np.uint64)
        have[0] = 1
        have[1:] = np.cumprod(np.full(size - 1, base, dtype=np.uint64))
        _POWERS[base] = have
    return have[:n]


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _hash_piece(b: np.ndarray, n: int) -> np.ndarray:
    """Hashes of the word n-grams of normalised bytes ``b`` (words split by spaces, documents by newlines);
    an n-gram never spans two documents."""
    sep = (b == _SPACE) | (b == _DOC)
    word = ~sep
    starts = np.flatnonzero(word & np.concatenate(([True], sep[:-1])))
    ends = np.flatnonzero(word & np.concatenate((sep[1:], [True]))) + 1
    if len(starts) < n:
        return np.zeros(0, dtype=np.uint64)
    doc = np.cumsum(b == _DOC)  # documents begun before each byte
    first, last = starts[: len(starts) - n + 1], ends[n - 1:]
    keep = doc[first] == doc[last - 1]
    first, last = first[keep], last[keep]
    # prefix sums of b[j] * P^-j: the hash of b[s:e] = sum b[j] P^(e-1-j) = P^(e-1) * (S[e] - S[s])
    s = np.zeros(len(b) + 1, dtype=np.uint64)
    np.cumsum(b.astype(np.uint64) * _powers(_P_INV, len(b)), out=s[1:])
    return _mix(_powers(_P, len(b))[last - 1] * (s[last] - s[first]))


def _pieces(documents: Iterable[str]) -> Iterable[bytes]:
    """Normalised documents joined by newlines, in pieces of about :data:`PIECE_BYTES` (a longer document is
    cut at a space: the n-grams across the cut are lost, a few in a million)."""
    batch, size = [], 0
    for text in documents:
        b = normalise(text).encode("utf-8")
        while len(b) > PIECE_BYTES:
            cut = b.rfind(b" ", 0, PIECE_BYTES)
            cut = cut if cut > 0 else PIECE_BYTES
            yield b[:cut]
            b = b[cut + 1:]
        if size + len(b) > PIECE_BYTES and batch:
            yield b"\n".join(batch)
            batch, size = [], 0
        if b:
            batch.append(b)
            size += len(b) + 1
    if batch:
        yield b"\n".join(batch)


class NgramCounter:
    """The distinct n-grams of text fed a document at a time (a pool's sources stream theirs)."""

    def __init__(self, n: int = NGRAM):
        self.n = n
        self._parts: list[np.ndarray] = []
        self._pending: list[str] = []
        self._pending_bytes = 0

    def add(self, text: str) -> None:
        self._pending.append(text)
        self._pending_bytes += len(text)
        if self._pending_bytes >= PIECE_BYTES:
            self._flush()

    def _flush(self) -> None:
        for piece in _pieces(self._pending):
            self._parts.append(np.unique(_hash_piece(np.frombuffer(piece, dtype=np.uint8), self.n)))
        self._pending, self._pending_bytes = [], 0
        if len(self._parts) > 16:  # merge, so memory follows the distinct n-grams, not the text
            self._parts = [np.unique(np.concatenate(self._parts))]

    def hashes(self) -> np.ndarray:
        """Sorted distinct n-gram hashes (uint64)."""
        self._flush()
        return np.unique(np.concatenate(self._parts)) if self._parts else np.zeros(0, dtype=np.uint64)


def ngram_hashes(documents: Iterable[str], n: int = NGRAM) -> np.ndarray:
    """Sorted distinct hashes of the word n-grams of ``documents`` (uint64)."""
    counter = NgramCounter(n)
    for d in documents:
        counter.add(d)
    return counter.hashes()


def shared_count(a: np.ndarray, b: np.ndarray) -> int:
    """How many values two sorted distinct arrays share (the smaller is looked up in the larger)."""
    if len(a) > len(b):
        a, b = b, a
    if not len(a) or not len(b):
        return 0
    i = np.searchsorted(b, a).clip(max=len(b) - 1)
    return int(np.count_nonzero(b[i] == a))


@dataclass
class Overlap:
    """The text of ``data`` against the evaluation text ``eval``: distinct n-grams of each and shared."""

    data: str
    eval: str
    data_ngrams: int
    eval_ngrams: int
    shared: int

    @property
    def data_share(self) -> float:
        return self.shared / self.data_ngrams if self.data_ngrams else 0.0

    @property
    def eval_share(self) -> float:
        return self.shared / self.eval_ngrams if self.eval_ngrams else 0.0

    @property
    def refused(self) -> bool:
        return self.shared > 0 and (max(self.data_share, self.eval_share) >= MAX_SHARE)


def builtin_eval_splits() -> list[str]:
    """Every built-in evaluation split (the names in BUILTIN_CORPORA that end in ``:eval``)."""
    return [name for name in BUILTIN_CORPORA if name.endswith(":eval")]


def _overlap_dir(cache_dir) -> Path:
    return cache_root(cache_dir) / "overlap"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:60]


_HASHES: dict = {}  # content hash -> distinct n-gram hashes, the last few texts hashed in this process
_HASHES_KEPT = 8


def corpus_ngrams(corpus: Corpus, *, cache_dir=None) -> np.ndarray:
    """The distinct n-gram hashes of ``corpus``; cached in the tcal cache for a built-in evaluation split."""
    key = corpus.content_hash
    if key in _HASHES:
        return _HASHES[key]
    path = _overlap_dir(cache_dir) / f"{_slug(corpus.name)}-{key[:16]}-n{NGRAM}-v{VERSION}.npy"
    hashes = None
    kept = corpus.name in BUILTIN_CORPORA and corpus.name.endswith(":eval")  # the other built-ins keep their result
    if kept and path.is_file():
        try:
            hashes = np.load(path)
        except (OSError, ValueError):
            pass  # a damaged entry: rebuilt below
    if hashes is None:
        hashes = ngram_hashes(corpus.documents)
        if kept:
            atomic_save_npy(path, hashes)
    while len(_HASHES) >= _HASHES_KEPT:
        _HASHES.pop(next(iter(_HASHES)))
    _HASHES[key] = hashes
    return hashes


def is_text(spec) -> bool:
    """Whether ``spec`` names text (a corpus) rather than token ids (a pool directory, a ``.npy`` file, a tensor)
    or nothing (``none``)."""
    if isinstance(spec, Corpus):
        return True
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip() or spec.strip().lower() == "none":
        return False
    if spec in BUILTIN_CORPORA or spec.startswith("text:"):
        return True
    if path_exists(spec):
        p = Path(spec).expanduser()
        return not (p.suffix == ".npy" or (p.is_dir() and (p / "manifest.json").is_file()))
    return not spec.strip().lower().endswith(".npy")


def text_parts(spec) -> list:
    """The parts of ``spec`` that are text: a mixture ``a+b`` (of built-ins or paths) split, token ids dropped."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    parts = [spec]
    if isinstance(spec, str):
        split = spec_parts(spec, "+")
        if len(split) > 1 and any(p in BUILTIN_CORPORA or p.startswith(PATH_STARTS) or path_exists(p) for p in split):
            parts = split
    return [p for p in parts if is_text(p)]


_BUILTIN: dict = {}  # (cache root, name) -> Corpus: a built-in corpus's text does not change within a cache


def _builtin(name: str, cache_dir, *, download: bool) -> Corpus:
    """A built-in corpus, read once per process; ``download=False``: NotInCache where its package is missing."""
    key = (str(cache_root(cache_dir)), name)
    if key not in _BUILTIN:
        if download:
            _BUILTIN[key] = as_corpus(name, cache_dir=cache_dir)
        else:
            with cached_only():
                _BUILTIN[key] = as_corpus(name, cache_dir=cache_dir)
    return _BUILTIN[key]


def _corpus(spec, cache_dir) -> Corpus:
    return _builtin(spec, cache_dir, download=True) if isinstance(spec, str) and spec in BUILTIN_CORPORA \
        else as_corpus(spec, cache_dir=cache_dir)


def present_eval_splits(cache_dir=None) -> list[Corpus]:
    """The built-in evaluation splits whose packages are in the tcal cache (nothing is downloaded)."""
    out = []
    for name in builtin_eval_splits():
        try:
            out.append(_builtin(name, cache_dir, download=False))
        except NotInCache:
            continue
    return out


def eval_corpora(eval_specs: Sequence = (), *, cache_dir=None) -> list[Corpus]:
    """The evaluation side: the given evaluation text (specs or Corpus objects; token ids skipped) and every
    built-in evaluation split in the cache, each text once."""
    corpora, seen = [], set()
    given = [_corpus(p, cache_dir) for spec in eval_specs for p in text_parts(spec)]
    for c in given + present_eval_splits(cache_dir):
        if c.content_hash not in seen:
            seen.add(c.content_hash)
            corpora.append(c)
    return corpora


_RESULTS: dict = {}  # (data content hash, evaluation key) -> [Overlap], within one process


def overlaps(data, evals: Sequence[Corpus], *, cache_dir=None) -> list[Overlap]:
    """``data`` (one corpus: spec, path, text or Corpus) against each evaluation text of ``evals``.

    The result for a built-in corpus is cached in the tcal cache; any result is kept for the process, so a
    command's check and the library's own check of the same text cost one pass."""
    corpus = _corpus(data, cache_dir)
    key = hashlib.sha256(json.dumps([NGRAM, VERSION, [c.content_hash for c in evals]]).encode()).hexdigest()[:16]
    if (corpus.content_hash, key) in _RESULTS:
        return _RESULTS[(corpus.content_hash, key)]
    record = None
    result = None
    if corpus.name in BUILTIN_CORPORA:
        record = _overlap_dir(cache_dir) / "checks" / f"{_slug(corpus.name)}-{corpus.content_hash[:16]}-{key}.json"
        try:
            result = [Overlap(**o) for o in json.loads(record.read_text())]
        except (OSError, ValueError, TypeError):
            result = None
    if result is None:
        mine = corpus_ngrams(corpus, cache_dir=cache_dir)
        result = []
        for ev in evals:
            theirs = corpus_ngrams(ev, cache_dir=cache_dir)
            result.append(Overlap(corpus.name, ev.name, len(mine), len(theirs), shared_count(mine, theirs)))
        if record is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_json(record, [asdict(o) for o in result])
    _RESULTS[(corpus.content_hash, key)] = result
    return result


def refusal(o: Overlap, role: str) -> str:
    """The one-line error for an overlap that is refused."""
    return (f"{role} {o.data!r} contains evaluation text: {o.data_share:.1%} of its {NGRAM}-word sequences "
            f"occur in {o.eval}, covering {o.eval_share:.1%} of it (the limit is {MAX_SHARE:.0%} of either); "
            "remove that text from it, or use a built-in :calib split")


def check_no_eval_text(data, eval_specs=(), *, role: str = "training data", cache_dir=None) -> list[Overlap]:
    """Refuse ``data`` (a corpus, or a mixture ``a+b`` of them: each part, and the mixture as a whole) whose text
    overlaps evaluation text: the
    ``eval_specs`` (a spec or a sequence of them; token ids skipped) and every built-in ``:eval`` split in the
    cache. Data that is token ids (a pool, a ``.npy`` file, a tensor) is not text and passes (a pool was
    checked when it was built). Returns every overlap measured."""
    if isinstance(eval_specs, (str, os.PathLike, Corpus)):
        eval_specs = [eval_specs]
    parts = text_parts(data)
    if not parts:
        return []
    evals = eval_corpora(eval_specs, cache_dir=cache_dir)
    found = []
    for part in parts:
        for o in overlaps(part, evals, cache_dir=cache_dir):
            if o.refused:
                raise TcalError(refusal(o, role))
            found.append(o)
    if len(parts) > 1:  # the whole mixture: parts each under the limit can together hold most of an evaluation text
        name = data if isinstance(data, str) else "+".join(map(str, parts))
        mine = np.unique(np.concatenate([corpus_ngrams(_corpus(p, cache_dir), cache_dir=cache_dir) for p in parts]))
        found += _checked(name, mine, evals, role, cache_dir)
    return found


def _checked(name: str, hashes: np.ndarray, evals: Sequence[Corpus], role: str, cache_dir) -> list[Overlap]:
    """Text already cut into n-gram hashes against each evaluation text: the overlaps, or the refusal."""
    found = []
    for ev in evals:
        theirs = corpus_ngrams(ev, cache_dir=cache_dir)
        o = Overlap(name, ev.name, len(hashes), len(theirs), shared_count(hashes, theirs))
        if o.refused:
            raise TcalError(refusal(o, role))
        found.append(o)
    return found


def check_ngrams(name: str, hashes: np.ndarray, *, role: str = "pool source", cache_dir=None) -> list[Overlap]:
    """Refuse text already cut into n-gram hashes (a pool source, hashed as it streamed) that overlaps a
    built-in evaluation split in the cache; returns the overlaps."""
    return _checked(name, hashes, eval_corpora((), cache_dir=cache_dir), role, cache_dir)
