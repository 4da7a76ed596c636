"""A teacher's held-out perplexity kept in tcal's cache: read back only where the whole key matches."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_teacher, word_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_kept_score_is_read_back_only_for_the_same_key(cache):
    from tcal.evaluate.score_cache import cached

    calls = []

    def compute():
        calls.append(1)
        return {"ppl": 3.5}

    key = {"model": ["builtin", "t", "abc"], "tokens": "x"}
    assert cached("ppl", key, compute) == ({"ppl": 3.5}, False)
    assert cached("ppl", key, compute) == ({"ppl": 3.5}, True) and len(calls) == 1
    assert cached("ppl", {**key, "tokens": "y"}, compute) == ({"ppl": 3.5}, False) and len(calls) == 2
    # a damaged file is scored anew, not trusted
    for f in (cache / "scores").iterdir():
        f.write_text("{not json")
    assert cached("ppl", key, compute)[1] is False and len(calls) == 3


def test_model_identity_names_a_builtin_by_its_gguf_and_a_file_by_what_it_is(tmp_path):
    from tcal.data.teacher_table import TEACHERS
    from tcal.evaluate.score_cache import model_identity

    name = next(iter(TEACHERS))
    assert model_identity(name) == ["builtin", name, TEACHERS[name].sha256]
    f = tmp_path / "m.bin"
    f.write_bytes(b"1")
    first = model_identity(str(f))
    f.write_bytes(b"22")
    assert first is not None and model_identity(str(f)) != first
    assert model_identity("some-org/some-model") is None  # a hub id: never kept


def test_the_teachers_perplexity_is_scored_once_and_changes_with_its_text(cache, tmp_path):
    from tcal.evaluate.plan import held_out

    tok = word_tokenizer("a b c d e".split())
    model = tiny_teacher("llama", vocab_size=len(tok)).eval()
    text = tmp_path / "t.txt"
    text.write_text(" ".join("abcde"[i * 7 % 5] for i in range(400)))
    ppl = held_out([str(text)], 16, 3)
    ppl.check()
    first = ppl.reports(model, tok, kept_as=["builtin", "tiny", "0"])[str(text)]
    again = ppl.reports(model, tok, kept_as=["builtin", "tiny", "0"])[str(text)]
    assert first["cached"] is False and again["cached"] is True and again["ppl"] == first["ppl"]
    with torch.no_grad():  # other weights under another identity: scored anew
        other = ppl.reports(tiny_teacher("llama", vocab_size=len(tok), seed=1).eval(), tok,
                            kept_as=["builtin", "tiny", "1"])[str(text)]
    assert other["cached"] is False and other["ppl"] != first["ppl"]
    text.write_text(" ".join("abcde"[i * 3 % 5] for i in range(400)))  # the same file name, other text
    changed = held_out([str(text)], 16, 3)
    changed.check()
    assert changed.reports(model, tok, kept_as=["builtin", "tiny", "0"])[str(text)]["cached"] is False
    assert "cached" not in ppl.reports(model, tok)[str(text)]  # no identity: scored every time, nothing kept
