"""The commands' workspace: a tiny Llama teacher with a word-level tokenizer, and disjoint
calibration / evaluation texts (no downloads)."""
import random

import pytest
from helpers import tiny_teacher, word_tokenizer

WORDS = ("the cat sat on a mat dog ran far away and then came back home to old red big small tree house "
         "river hill road town king queen sun moon star day night").split()


@pytest.fixture(autouse=True)
def _cache(tmp_cache):
    pass


@pytest.fixture()
def workspace(tmp_path):
    """A tiny Llama teacher with a word-level tokenizer, and disjoint calibration / evaluation texts."""
    tok = word_tokenizer(WORDS)
    teacher = tiny_teacher("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                           max_position_embeddings=256, eos_token_id=0, bos_token_id=0)
    teacher.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    rng = random.Random(0)
    (tmp_path / "calib.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    (tmp_path / "eval.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(1500)))
    return tmp_path
