"""Perplexity protocol on tiny random models (no downloads); one integration test on the real teacher."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_teacher, word_tokenizer

from tcal.data.corpora import Corpus
from tcal.data.tokens import token_windows
from tcal.evaluate import perplexity, perplexity_report, window_nll, window_ppl
from tcal.utils.errors import TcalError

WORDS = "the cat sat on a mat . dog ran far away and then came back home to".split()
TEXT = " ".join(WORDS * 12)  # 204 tokens


def make_tokenizer():
    return word_tokenizer(WORDS)


def tiny_llama(vocab_size, seed=0):
    return tiny_teacher("llama", seed, vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, max_position_embeddings=256)


class Uniform(torch.nn.Module):
    """Every next token equally likely: PPL must equal the vocabulary size."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kw):
        from types import SimpleNamespace

        b, t = input_ids.shape
        return SimpleNamespace(logits=torch.zeros(b, t, self.vocab) + 0 * self.dummy)


pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_uniform_model_ppl_is_vocab_size():
    tok = make_tokenizer()
    ppl = perplexity(Uniform(len(tok)), tok, TEXT, window=16, windows=4, progress=False)
    assert ppl == pytest.approx(len(tok), rel=1e-6)


def test_matches_hand_computed_nll():
    tok = make_tokenizer()
    model = tiny_llama(len(tok))
    ids = token_windows(TEXT, tok, window=32, n_windows=5)
    with torch.no_grad():
        logits = model(ids).logits
    lp = F.log_softmax(logits[:, :-1].double(), -1)
    nll = -lp.gather(-1, ids[:, 1:, None]).mean().item()
    rep = perplexity_report(model, tok, TEXT, window=32, windows=5, batch_size=2, progress=False)
    assert rep["nll"] == pytest.approx(nll, rel=1e-5)
    assert rep["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    # batch size does not change the number
    assert perplexity(model, tok, TEXT, window=32, windows=5, batch_size=5, progress=False) == pytest.approx(rep["ppl"], rel=1e-5)
    # an already-cut tensor gives the same
    assert perplexity_report(model, tok, ids, progress=False)["ppl"] == pytest.approx(rep["ppl"], rel=1e-6)
    assert window_ppl(model, ids, batch_size=3, progress=False) == pytest.approx(rep["ppl"], rel=1e-6)


def test_protocol_fields():
    tok = make_tokenizer()
    model = tiny_llama(len(tok))
    model.train()
    rep = perplexity_report(model, tok, Corpus("toy", [TEXT]), window=20, windows=3, progress=False)
    assert model.training  # restored
    assert rep["window"] == 20 and rep["windows"] == 3 and rep["stride"] == 20
    assert rep["tokens"] == 3 * 19
    assert rep["data"] == "toy" and len(rep["data_hash"]) == 16
    assert rep["dtype"] == "float32" and rep["device"] == "cpu"
    assert math.isfinite(rep["ppl"]) and rep["ppl"] == pytest.approx(math.exp(rep["nll"]))
    rep2 = perplexity_report(model, tok, Corpus("toy", [TEXT]), window=20, windows=3, stride=10, progress=False)
    assert rep2["stride"] == 10 and rep2["ppl"] != rep["ppl"]


def test_file_path_data(tmp_path):
    tok = make_tokenizer()
    p = tmp_path / "t.txt"
    p.write_text(TEXT)
    model = tiny_llama(len(tok))
    assert perplexity(model, tok, str(p), window=16, windows=2, progress=False) == pytest.approx(
        perplexity(model, tok, TEXT, window=16, windows=2, progress=False), rel=1e-6)


def test_too_small_corpus_is_an_error():
    tok = make_tokenizer()
    with pytest.raises(TcalError, match=r"has 204 tokens, 64 windows of 512 asked"):
        perplexity(Uniform(len(tok)), tok, TEXT, progress=False)


def test_bad_windows_tensor():
    with pytest.raises(TcalError):
        window_nll(Uniform(5), torch.zeros(3, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    tok = make_tokenizer()
    model = tiny_llama(len(tok))
    cpu = perplexity(model, tok, TEXT, window=32, windows=4, progress=False)
    gpu = perplexity(model.cuda(), tok, TEXT, window=32, windows=4, progress=False)
    assert gpu == pytest.approx(cpu, rel=1e-3)


@pytest.mark.integration
def test_teacher_ppl_small_protocol(monkeypatch):
    from tcal.data.teachers import load_teacher

    monkeypatch.delenv("TCAL_CACHE", raising=False)  # the user's cache: convert once
    model, tok = load_teacher("smollm2-135m")
    rep = perplexity_report(model, tok, "wiki:eval", window=256, windows=4, progress=False)
    assert math.isfinite(rep["ppl"]) and 1 < rep["ppl"] < 100
    assert rep["tokens"] == 4 * 255


def test_device_mismatch_is_an_error():
    tok = make_tokenizer()
    with pytest.raises(TcalError, match="move the model"):
        perplexity(Uniform(len(tok)), tok, TEXT, window=16, windows=2, device="meta", progress=False)
