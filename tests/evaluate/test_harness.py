"""lm-evaluation-harness on a loaded model and the offline local tasks: passages drawn from held-out
text only and deterministically, the harness's numbers from a tiny model, an oracle that must score
1.0 (and a wrong one 0.0), and bad input."""
import math
import sys
from collections import Counter

import pytest
import torch
from helpers import story_text, tiny_teacher, word_tokenizer

from tcal.evaluate.tasks.lm_eval import harness
from tcal.evaluate.tasks.lm_eval.harness import (
    INSTALL_HINT,
    LOCAL_TASKS,
    MAX_CONTEXT_WORDS,
    MIN_CONTEXT_WORDS,
    NEIGHBOURS,
    check_source,
    local_docs,
    parse_tasks,
    plan,
)
from tcal.utils.errors import TcalError


@pytest.fixture()
def corpus_dir(tmp_path):
    """Two documents of made-up sentences (a directory of .txt files is a two-document corpus)."""
    d = tmp_path / "text"
    d.mkdir()
    (d / "a.txt").write_text(story_text(400, seed=0))
    (d / "b.txt").write_text(story_text(300, seed=1))
    return d


@pytest.fixture()
def tok(corpus_dir):
    words = sorted({w for p in corpus_dir.iterdir() for w in p.read_text().replace(".", " ").split()})
    return word_tokenizer(words, extra=["."])


def _docs(corpus_dir):
    return [p.read_text() for p in sorted(corpus_dir.iterdir())]


def test_local_docs_are_passages_of_the_source_and_repeat_for_a_seed(corpus_dir):
    texts = _docs(corpus_dir)
    a = local_docs("tcal_lastword", str(corpus_dir), seed=0)
    assert a == local_docs("tcal_lastword", str(corpus_dir), seed=0)
    assert [d["offset"] for d in a] != [d["offset"] for d in local_docs("tcal_lastword", str(corpus_dir), seed=1)]
    assert local_docs("tcal_lastword", str(corpus_dir), limit=7, seed=0) == a[:7]  # a limit keeps a prefix
    assert {d["document"] for d in a} == {0, 1} and len(a) > 40
    for d in a:
        text = texts[d["document"]]
        ctx, word = d["context"], d["word"]
        # the passage is the source text itself, cut right before " word"
        assert text[d["offset"]:d["offset"] + len(ctx) + 1 + len(word)] == ctx + " " + word
        assert text[d["offset"] + len(ctx) + 1 + len(word)] in ".!?"
        assert d["target"] == " " + word and not ctx[-1].isspace()
        assert MIN_CONTEXT_WORDS <= len(ctx.split()) <= MAX_CONTEXT_WORDS
        assert word.lower() in ctx.lower().replace(".", " ").split()  # the word is in its context
    by_doc = {}
    for d in sorted(a, key=lambda d: (d["document"], d["offset"])):  # passages never overlap
        prev = by_doc.get(d["document"], -1)
        assert d["offset"] > prev
        by_doc[d["document"]] = d["offset"] + len(d["context"]) + len(d["word"])


def test_cloze_choices_are_the_word_and_three_of_similar_frequency(corpus_dir):
    texts = _docs(corpus_dir)
    docs = local_docs("tcal_cloze", str(corpus_dir), seed=0)
    assert docs == local_docs("tcal_cloze", str(corpus_dir), seed=0)
    assert local_docs("tcal_cloze", str(corpus_dir), limit=5, seed=0) == docs[:5]
    labels = Counter(d["label"] for d in docs)
    assert set(labels) == {0, 1, 2, 3}  # the true word is not always in the same place
    for d in docs:
        assert len(set(d["choices"])) == 4 and d["choices"][d["label"]] == d["word"]
        counts = Counter(w.strip(".") for w in texts[d["document"]].split())
        ranking = sorted(counts, key=lambda w: (-counts[w], w))
        r = ranking.index(d["word"])
        for c in d["choices"]:
            assert abs(ranking.index(c) - r) <= NEIGHBOURS  # a word of this document, of nearly the same count


def test_sources_must_be_held_out_and_bad_input_is_one_line(corpus_dir):
    for spec in ("shakespeare:calib", "shakespeare", "wiki:calib"):
        with pytest.raises(TcalError, match="not an evaluation split") as e:
            check_source(spec)
        assert "\n" not in str(e.value)
    check_source("shakespeare:eval")
    for limit in (0, -3):
        with pytest.raises(TcalError, match="at least 1"):
            local_docs("tcal_lastword", str(corpus_dir), limit=limit)
    with pytest.raises(TcalError, match="local tasks: tcal_lastword, tcal_cloze"):
        local_docs("tcal_nope", str(corpus_dir))
    with pytest.raises(TcalError, match="no passage"):
        local_docs("tcal_cloze", "text:Too short. To hold a passage.")
    with pytest.raises(TcalError, match="local offline tasks: tcal_lastword, tcal_cloze"):
        parse_tasks("tcal_lastword,tcal_lastwords")
    with pytest.raises(TcalError, match="no lm-eval task"):
        parse_tasks(" , ")
    assert parse_tasks("tcal_cloze, hellaswag,tcal_cloze") == ["tcal_cloze", "hellaswag"]


def test_missing_lm_eval_is_one_line_naming_the_extra(corpus_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if it were absent
    with pytest.raises(TcalError) as e:
        plan("tcal_lastword", source=str(corpus_dir))
    assert str(e.value) == INSTALL_HINT == "lm-eval is not installed: pip install 'tcal[eval]'"


class Oracle(torch.nn.Module):
    """A causal LM that has read ``texts``: after any ``k`` tokens that occur there it puts all its
    weight on the token that follows them; anywhere else it is uniform over the vocabulary. It
    knows the source text, not the task's documents, so it cannot echo a wrong label."""

    def __init__(self, tok, texts=(), k: int = 8):
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024)
        self.vocab, self.k, self.next = len(tok), k, {}
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            for i in range(k, len(ids)):
                self.next[tuple(ids[i - k:i])] = ids[i]
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the harness counts parameters

    @property
    def device(self):
        return self.anchor.device

    def tie_weights(self):
        pass

    def forward(self, input_ids, **_):
        from types import SimpleNamespace

        logits = torch.zeros(*input_ids.shape, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            for t in range(self.k - 1, len(row)):
                nxt = self.next.get(tuple(row[t - self.k + 1:t + 1]))
                if nxt is not None:
                    logits[b, t, nxt] = 30.0
        return SimpleNamespace(logits=logits)


def _metrics(res, task):
    return {r["metric"]: r for r in res[task]["rows"]}


def test_a_model_that_knows_the_text_scores_one_and_a_uniform_one_chance(corpus_dir, tok, tmp_cache):
    pytest.importorskip("lm_eval")
    src, n = str(corpus_dir), 12
    res = harness.lm_eval_tasks(Oracle(tok, _docs(corpus_dir)), tok, "tcal_lastword,tcal_cloze", limit=n,
                                source=src, batch_size=3)
    lw, cz = _metrics(res, "tcal_lastword"), _metrics(res, "tcal_cloze")
    assert lw["acc"]["value"] == 1.0 and lw["acc"]["samples"] == n
    assert 1.0 <= lw["perplexity"]["value"] < 1.001  # p(word) ~ 1 for every passage
    assert cz["acc"]["value"] == 1.0 and cz["acc_norm"]["value"] == 1.0
    # uniform: the argmax (token 0, <eos>) is never the word, and p(word) = 1 / vocabulary; every
    # choice is one equally likely token of six letters, so the harness's argmax takes choice 0
    res = harness.lm_eval_tasks(Oracle(tok), tok, "tcal_lastword,tcal_cloze", limit=n, source=src, batch_size=3)
    lw, cz = _metrics(res, "tcal_lastword"), _metrics(res, "tcal_cloze")
    assert lw["acc"]["value"] == 0.0 and lw["perplexity"]["value"] == pytest.approx(len(tok), rel=1e-4)
    first = sum(d["label"] == 0 for d in local_docs("tcal_cloze", src, limit=n)) / n
    assert cz["acc"]["value"] == pytest.approx(first) and cz["acc_norm"]["value"] == pytest.approx(first)
    assert first < 1.0


def test_the_harness_runs_a_tiny_model_and_reports_every_sample(corpus_dir, tok, tmp_cache):
    pytest.importorskip("lm_eval")
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    pad_before = tok.pad_token
    res = harness.lm_eval_tasks(model, tok, ["tcal_lastword", "tcal_cloze"], limit=6, source=str(corpus_dir),
                                batch_size=4)
    assert tok.pad_token == pad_before  # the caller's tokenizer is not changed by the harness
    assert list(res) == ["tcal_lastword", "tcal_cloze"]
    lw, cz = _metrics(res, "tcal_lastword"), _metrics(res, "tcal_cloze")
    assert set(lw) == {"acc", "perplexity"} and set(cz) == {"acc", "acc_norm"}
    assert 0.0 <= lw["acc"]["value"] <= 1.0 and lw["perplexity"]["value"] > 1.0
    assert all(r["stderr"] is not None and math.isfinite(r["stderr"]) and r["samples"] == 6
               for r in list(lw.values()) + list(cz.values()))
    # the harness scored exactly our passages: context and " word" as the continuation
    docs = local_docs("tcal_lastword", str(corpus_dir), limit=6)
    got = [s["arguments"] for s in res["tcal_lastword"]["samples"]["tcal_lastword"]]
    assert sorted(map(tuple, (a[0] for a in got))) == sorted((d["context"], d["target"]) for d in docs)
    assert len(res["tcal_cloze"]["samples"]["tcal_cloze"][0]["arguments"]) == 4  # one request per choice
    assert list((tmp_cache / "lm_eval").glob("tcal_*.jsonl"))  # the task data lives in the tcal cache


def test_local_task_names_match_the_registrys():
    from tcal.evaluate.tasks.lm_eval import LOCAL

    assert tuple(LOCAL_TASKS) == LOCAL


@pytest.mark.integration
def test_default_local_tasks_read_only_the_shakespeare_evaluation_split(monkeypatch):
    monkeypatch.delenv("TCAL_CACHE", raising=False)  # the user's cache: the plays are fetched once
    from tcal.data.corpora import load_corpus

    held_out, calib = load_corpus("shakespeare:eval"), load_corpus("shakespeare:calib")
    for task in LOCAL_TASKS:
        docs = local_docs(task, limit=200)
        assert len(docs) == 200
        for d in docs:
            passage = d["context"] + " " + d["word"]
            assert passage in held_out.documents[d["document"]]
            assert not any(passage in c for c in calib.documents)
