"""llama.cpp through llama-cpp-python (the extra ``tcal[gguf]``): the one place tcal imports it and opens a GGUF.

Every use goes through :func:`module` (the import, or a one-line error saying what needs it and how to install it)
and :func:`load` (a ``llama_cpp.Llama`` on a GGUF, llama.cpp's own log lines off, a file it cannot load a one-line
error): the export's check, the llama.cpp engine's generation (``--engine llama.cpp``) and timing (tcal bench's
llama.cpp rows), the quantiser, the benchmarks and the tests.
"""
from __future__ import annotations

import contextlib
import os

from tcal.utils.errors import TcalError

# ggml's type ids for the KV cache: f32 where a comparison must not round the cache, f16 (llama.cpp's default) as a
# server runs it
KV_TYPES = {"f32": 0, "f16": 1}


def module(purpose: str = "running a GGUF"):
    """The ``llama_cpp`` module; a TcalError naming ``purpose`` where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        raise TcalError(f"{purpose} needs llama-cpp-python: pip install 'tcal[gguf]'") from None
    return llama_cpp


@contextlib.contextmanager
def quiet():
    """llama.cpp's own log lines off (its quantiser logs every tensor, its loader warns about a vocabulary-only
    load's missing context length); tcal reports what it did itself. llama-cpp-python's callback cannot be
    quietened by its logger's level (``Llama()`` resets that level, and its map of llama.cpp's levels predates
    llama.cpp's own: warnings arrive as errors), so a silent callback stands in for it meanwhile."""
    import ctypes

    lc = module()
    from llama_cpp import _logger

    silent = lc.llama_log_callback(lambda level, text, user_data: None)  # referenced until restored
    lc.llama_log_set(silent, ctypes.c_void_p(0))
    try:
        yield
    finally:
        lc.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def load(path, n_ctx: int = 512, *, purpose: str = "running a GGUF", threads: int | None = None, gpu_layers: int = 0,
         kv_cache: str = "f16", logits_all: bool = False, vocab_only: bool = False, n_batch: int = 512,
         n_ubatch: int | None = None):
    """A ``llama_cpp.Llama`` on the GGUF at ``path``: ``n_ctx`` tokens of context, ``threads`` CPU threads (default:
    every core) for decode and batches, ``gpu_layers`` offloaded (-1: all), the KV cache in ``kv_cache`` (``f32`` or
    ``f16``), every position's logits kept with ``logits_all``, or the tokenizer alone with ``vocab_only``."""
    lc = module(purpose)
    threads = threads or os.cpu_count() or 1
    kv = KV_TYPES[kv_cache]
    try:
        with quiet():
            return lc.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch or n_batch,
                            n_threads=threads, n_threads_batch=threads, n_gpu_layers=gpu_layers, logits_all=logits_all,
                            vocab_only=vocab_only, type_k=kv, type_v=kv, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise TcalError(f"llama.cpp (llama-cpp-python {lc.__version__}) cannot load {path} ({e}); check the file, or "
                        "pip install -U 'tcal[gguf]' if this build predates its architecture (qwen35)") from None


def gpu_offload() -> bool:
    """Whether this llama.cpp build can run layers on a GPU."""
    return bool(module().llama_supports_gpu_offload())
