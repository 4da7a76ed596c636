"""Batched greedy generation on tcal's static cache (``generate_fast``, what a curve point's HumanEval and passkey
prompts run on a GPU): the same text as ``generate()`` and as each prompt alone, left padding and GDN layers
included, with rows stopped by an end token or by the caller's test exactly where ``generate()`` stops them."""
import pytest
import torch
from helpers import target_hybrid, word_tokenizer

from tcal.engines import tcal_generate as G

WORDS = [f"w{i}" for i in range(95)]  # with <eos> and <unk>: the tiny models' 97 ids


@pytest.fixture(scope="module")
def model_and_tokenizer():
    hybrid, _ = target_hybrid("qwen2")
    return hybrid, word_tokenizer(WORDS)


def prompts(n=5):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        length = 2 + 3 * i  # different lengths: every batch is left-padded
        out.append(" ".join(WORDS[j] for j in torch.randint(0, 95, (length,), generator=g).tolist()))
    return out


def test_batched_fast_generation_equals_generate_and_each_prompt_alone(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ps = prompts()
    hf = G.generate_greedy(model, tok, ps, 20, batch_size=5, fast=False)
    batched = G.generate_fast(model, tok, ps, 20, batch_size=5)
    alone = [G.generate_fast(model, tok, [p], 20, batch_size=1)[0] for p in ps]
    assert batched == alone == hf
    assert all(15 <= len(t.split()) <= 20 for t in batched)  # nothing stopped them (<eos>, <unk> are not written)
    assert G.generate_greedy(model, tok, ps, 20, batch_size=2, fast=True) == hf  # batches of 2, the last one short


def test_rows_stop_where_generate_stops_them(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    ps = prompts()
    free = G.generate_greedy(model, tok, ps, 40, batch_size=5, fast=False)
    # an end token (a plain word here, so it stays in the text): the 4th word row 1 writes
    eos = tok.convert_tokens_to_ids(free[1].split()[3])
    # and the caller's test: row i is done once it has written 6 + 5 i words (past one text check for some rows)
    def done(i, text):
        return len(text.split()) >= 6 + 5 * i

    monkeypatch.setattr(G, "CHECK_EVERY", 8)
    ref = G.generate_greedy(model, tok, ps, 40, batch_size=5, fast=False, done=done, eos_token_id=eos)
    got = G.generate_fast(model, tok, ps, 40, batch_size=5, done=done, eos_token_id=eos)
    assert got == ref
    words = free[1].split()
    assert ref[1].split()[-1] == words[3] and len(ref[1].split()) <= 4  # stopped at its (first) end token
    assert [len(t.split()) for t in ref] != [40] * 5


def test_the_fast_path_is_the_default_on_cuda_only(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert not G.fast_path(model)  # a CPU model: generate() unless asked
