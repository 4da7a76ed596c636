"""Token streams and windows of corpora, and the token cache keyed by tokenizer."""
import numpy as np
import pytest
import torch
from helpers import DATA_WORDS as WORDS
from helpers import word_tokenizer

from tcal.data.corpora import Corpus
from tcal.data.tokens import (
    corpus_tokens,
    encode_documents,
    mixed_windows,
    mixture_parts,
    separator_id,
    token_windows,
    tokenizer_id,
    window_starts,
)
from tcal.utils.errors import TcalError

pytestmark = pytest.mark.usefixtures("tmp_cache")


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
    other = word_tokenizer(WORDS, extra=["zebra"])
    assert tokenizer_id(other) != tokenizer_id(tok)
    corpus_tokens(str(p), other)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 4
    # raw text is never cached
    corpus_tokens("the cat sat", tok)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 4


def test_separator_encode_and_window_starts(tok):
    assert separator_id(tok) == 0
    assert [len(d) for d in encode_documents(tok, ["the cat", "a dog ran"])] == [2, 3]
    assert list(window_starts(10, None, window=4, stride=4, respect_docs=False)) == [0, 4]
    assert list(window_starts(10, None, window=4, stride=2, respect_docs=False)) == [0, 2, 4, 6]


def test_mixed_windows_take_equal_shares_interleaved(tok, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(WORDS[:8] * 3))
    b.write_text(" ".join(WORDS[8:] * 3))
    spec = f"{a}+{b}"
    assert mixture_parts(spec) == [str(a), str(b)] and mixture_parts("wiki:calib") == ["wiki:calib"]
    assert mixture_parts(str(a)) == [str(a)]
    w = mixed_windows(spec, tok, window=3, n_windows=5)
    wa, wb = token_windows(str(a), tok, window=3, n_windows=3), token_windows(str(b), tok, window=3, n_windows=2)
    assert torch.equal(w, torch.stack([wa[0], wb[0], wa[1], wb[1], wa[2]]))  # a, b, a, b, a
    assert torch.equal(mixed_windows(str(a), tok, window=3, n_windows=2), wa[:2])
    from tcal.data.streams import eval_windows_for  # what tcal recover reads --calib with

    assert torch.equal(eval_windows_for(spec, tok, 3, 5)[0], w)
    with pytest.raises(TcalError, match="cannot mix 2 corpora"):
        mixed_windows(spec, tok, window=3, n_windows=1)
    with pytest.raises(TcalError, match="empty or repeated part"):
        mixture_parts(f"{a}+{a}")
    with pytest.raises(TcalError, match="tokens"):  # a budget larger than one part: its token count is named
        mixed_windows(spec, tok, window=3, n_windows=400)


def test_windows_start_with_the_bos_a_tokenizer_puts_before_every_text():
    """Gemma 3 (and Llama 3) tokenizers put a BOS before every text; each window then starts with it and holds
    the next window - 1 tokens of the stream, the windows still back to back. A tokenizer without one (SmolLM2's,
    this word tokenizer) keeps plain windows."""
    from tokenizers import processors

    from tcal.data.tokens import corpus_tokens, token_windows, window_prefix

    text = " ".join(WORDS * 6)
    plain = word_tokenizer(WORDS, extra=["<bos>"])
    assert window_prefix(plain) == []
    bos = word_tokenizer(WORDS, extra=["<bos>"])
    bos_id = bos.convert_tokens_to_ids("<bos>")
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                                         special_tokens=[("<bos>", bos_id)])
    assert window_prefix(bos) == [bos_id]
    stream = torch.from_numpy(corpus_tokens(text, bos, cache=False)[0].astype("int64"))
    w = token_windows(text, bos, window=8, n_windows=3)
    assert w.shape == (3, 8) and bool((w[:, 0] == bos_id).all())
    assert torch.equal(w[:, 1:].reshape(-1), stream[:21])
    assert torch.equal(token_windows(text, plain, window=8, n_windows=3).reshape(-1), stream[:24])
