"""``tcal bench``'s rows, one registry: each row times one model (the teacher or the hybrid) in one engine
(:data:`tcal.engines.ENGINES`). The ``tcal`` engine's rows run the model tcal loads (:mod:`tcal.engines.speed`
measures them); a row of an engine that reads an export runs a file written for it (a GGUF of the teacher in its
family's llama.cpp architecture, or of the hybrid in the Qwen3.5 layout), timed by the engine's runner. Torch-free:
``tcal bench --help`` lists them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRow:
    name: str  # what --rows takes
    model: str  # the model it times: "teacher" or "hybrid"
    engine: str  # the key of the engine that runs it
    how: str  # what it measures, for --help
    fast_decoder: bool = False  # runs tcal's FastDecoder (its family must say fast_decoder)
    batched: bool = False  # --batch-sizes times it too
    cuda: bool = False  # needs CUDA
    # what its engine runs: "tcal" (the model tcal loads) or an export format ("gguf"); the engine's own `reads`
    # (tests/test_registries.py holds them equal), kept here so the rows need not import the engine registry
    reads: str = "tcal"


BENCH_ROWS: dict[str, BenchRow] = {r.name: r for r in (
    BenchRow("teacher-eager", "teacher", "tcal", "HF forward + DynamicCache"),
    BenchRow("teacher-compiled", "teacher", "tcal", "transformers' compiled StaticCache decode", cuda=True),
    BenchRow("hybrid-eager", "hybrid", "tcal", "HF forward + DynamicCache"),
    BenchRow("teacher-fast", "teacher", "tcal", "tcal FastDecoder", fast_decoder=True, batched=True),
    BenchRow("hybrid-fast", "hybrid", "tcal", "tcal FastDecoder", fast_decoder=True, batched=True),
    BenchRow("generate", "hybrid", "tcal", "end-to-end HF generate vs FastDecoder.generate on the hybrid",
             fast_decoder=True),
    BenchRow("teacher-llama.cpp", "teacher", "llama.cpp", "the teacher as a GGUF of its family's llama.cpp "
             "architecture, run by llama.cpp: pip install 'tcal[gguf]'", reads="gguf"),
    BenchRow("hybrid-llama.cpp", "hybrid", "llama.cpp", "the hybrid as a GGUF of the Qwen3.5 layout, run by "
             "llama.cpp: pip install 'tcal[gguf]'", reads="gguf"),
)}


def rows_of(engine: str) -> tuple[str, ...]:
    """The rows ``engine`` runs, in registry order."""
    return tuple(name for name, r in BENCH_ROWS.items() if r.engine == engine)


def rows_help() -> str:
    """--rows' help: every row and what it measures."""
    return "comma list of: " + "; ".join(f"{name} ({r.how}{'; CUDA' if r.cuda else ''})"
                                         for name, r in BENCH_ROWS.items())
