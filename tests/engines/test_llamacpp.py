"""The one llama.cpp loader: a missing llama-cpp-python or a file llama.cpp cannot load is a one-line TcalError."""
import pytest
from helpers import block_import

from tcal.engines import llamacpp
from tcal.utils.errors import TcalError


def test_a_missing_llama_cpp_names_what_needs_it(monkeypatch):
    block_import(monkeypatch, "llama_cpp")
    with pytest.raises(TcalError, match=r"^a llama.cpp row of tcal bench needs llama-cpp-python: pip install 'tcal\[gguf\]'$"):
        llamacpp.module("a llama.cpp row of tcal bench")


def test_a_file_llama_cpp_cannot_load_is_one_line(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(TcalError, match="cannot load .*bad.gguf") as e:
        llamacpp.load(tmp_path / "bad.gguf", 64)
    assert "\n" not in str(e.value)
