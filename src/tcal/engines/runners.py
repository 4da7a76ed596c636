"""How tcal runs the engines it runs itself: tcal's own (transformers with tcal's classes, on the model the command
loaded) and llama.cpp (on a GGUF, through llama-cpp-python). Torch-free: each method imports what it runs with."""
from __future__ import annotations

from tcal.engines.engine import Generator, Runner
from tcal.utils.errors import TcalError


class TcalRunner(Runner):
    """The model as tcal loads it: the command loads it once (its dtype and device), and generation batches prompts
    of similar length."""

    def open(self, model, tokenizer=None, *, threads: int | None = None, batch_size: int | None = None) -> Generator:
        from tcal.engines.tcal_generate import TcalGenerator, default_batch_size

        return TcalGenerator(model, tokenizer, batch_size or default_batch_size(model))

    def bench(self, name: str, model, contexts: list[int], *, decode_tokens: int, reps: int, vocab_size: int,
              threads: int | None = None, device: str = "cpu", cache_len: int | None = None) -> list[dict]:
        """The row ``name`` (:data:`tcal.engines.rows.BENCH_ROWS`: eager, FastDecoder, compiled, generate) of the
        loaded ``model`` on its own device, one per context (an error row where one fails)."""
        from tcal.engines import speed

        return [speed.measure_row(name, model, ctx, decode_tokens=decode_tokens, reps=reps,
                                  compiled_cache_len=cache_len) for ctx in contexts]


class LlamaCppRunner(Runner):
    """A GGUF in llama.cpp: the whole model as llama.cpp users run it (weights, tokenizer, chat template)."""

    def require(self, purpose: str) -> None:
        from tcal.engines.llamacpp import module

        module(purpose)

    def locate(self, model: str):
        """The GGUF that llama.cpp runs for MODEL: the file, the one .gguf in a directory (a ``tcal export --format
        gguf`` output), or a built-in teacher's own (quantised) GGUF."""
        from pathlib import Path

        from tcal.data.corpora import path_exists
        from tcal.data.teachers import BUILTIN_TEACHERS, builtin_gguf_path

        if model in BUILTIN_TEACHERS:
            return builtin_gguf_path(model)
        path = Path(model).expanduser()
        if path_exists(model) and path.is_file():
            if path.suffix.lower() != ".gguf":
                raise TcalError(f"--engine llama.cpp runs a GGUF, and {model} is not a .gguf file")
            return path
        if path_exists(model) and path.is_dir():
            found = sorted(path.glob("*.gguf"))
            if len(found) == 1:
                return found[0]
            if found:
                raise TcalError(f"{model} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); pass "
                                "one of them")
        raise TcalError(f"--engine llama.cpp runs a GGUF: pass a .gguf file, a tcal export --format gguf directory "
                        f"or a built-in teacher, not {model!r} (convert a hybrid with tcal export --format gguf "
                        "first)")

    def open(self, model, tokenizer=None, *, threads: int | None = None, batch_size: int | None = None) -> Generator:
        from tcal.engines.llamacpp_generate import LlamaCppGenerator

        return LlamaCppGenerator.open(model, threads=threads)

    def bench(self, name: str, model, contexts: list[int], *, decode_tokens: int, reps: int, vocab_size: int,
              threads: int | None = None, device: str = "cpu", cache_len: int | None = None) -> list[dict]:
        """``model``: the GGUF's path. On the GPU (every layer offloaded) when llama.cpp was built with CUDA and ``device`` is one, else on
        ``threads`` CPU threads."""
        from tcal.engines.llamacpp import gpu_offload
        from tcal.engines.llamacpp_speed import gguf_rows

        gpu = -1 if device.startswith("cuda") and gpu_offload() else 0
        return gguf_rows(name, model, contexts, decode_tokens=decode_tokens, reps=reps, vocab_size=vocab_size,
                         threads=threads, gpu_layers=gpu)
