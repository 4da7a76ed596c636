"""Token pools (tcal.data.pool) and their sources (tcal.data.pool_sources), offline."""
import numpy as np
import pytest
import torch
from helpers import DATA_WORDS as WORDS

from tcal.data.corpora import Corpus
from tcal.data.pool import build_pool, load_pool, read_manifest, sample_windows
from tcal.data.pool_sources import POOL_SOURCES, SourceUnavailable, detag_brown, html_to_text, resolve_source
from tcal.data.tokens import corpus_tokens, tokenizer_id
from tcal.utils.errors import TcalError

pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_html_to_text_drops_navigation():
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
    raw = "\n\n\tThe/at cat/nn ,/, he/pps said/vbd ,/, ``/`` is/bez n't/* here/rb ''/'' ./.\n\n\tNew/jj para/nn ./.\n"
    assert detag_brown(raw) == 'The cat, he said, "isn\'t here".\n\nNew para.'


def _pool_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(" ".join(WORDS))  # 17 tokens
    (src / "b.txt").write_text("the cat sat on a mat")  # 6 tokens
    return src


def test_build_and_load_pool(tmp_path, tok):
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
    with pytest.raises(TcalError, match="not a tcal pool"):
        load_pool(tmp_path)


def test_resolve_source_names(tmp_path):
    assert {"sotu", "brown", "python-doc"} <= set(POOL_SOURCES)
    name, fn, note = resolve_source(f"dir:{tmp_path}", tmp_path / "cache")
    assert name.startswith("dir:") and callable(fn)
