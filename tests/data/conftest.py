"""The data tests' tokenizer: word-level, <eos> = 0, one token per word of DATA_WORDS."""
import pytest
from helpers import DATA_WORDS, word_tokenizer


@pytest.fixture
def tok():
    return word_tokenizer(DATA_WORDS)
