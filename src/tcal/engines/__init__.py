"""The engines that run tcal's models, one :class:`~tcal.engines.engine.Engine` each in :data:`ENGINES`: its name,
what it reads, how tcal checks it, what it cannot run (its rule, :mod:`tcal.engines.rules`) and the command that
serves an export with it, and, for the engines tcal runs itself, its runner (opens a model, generates, times an
export). ``tcal export`` writes the table of the format's engines; ``tcal eval --engine`` takes the engines that
generate (``tcal`` itself and llama.cpp); ``tcal bench``'s rows each name the engine that runs them
(:mod:`tcal.engines.rows`).

Where engines run: ``tcal`` through transformers with tcal's classes (:mod:`tcal.engines.tcal_generate`), llama.cpp
through llama-cpp-python, which only :mod:`tcal.engines.llamacpp` imports and opens (its generation and its timing
beside it). Adding an engine: docs/extending.md, *Adding an engine*.
"""
from __future__ import annotations

from dataclasses import asdict

from tcal.engines.engine import CANNOT, EXACT, ROUNDING, Engine, EngineRow, Facts, Generator, Runner
from tcal.engines.rules import (
    llama_cpp_row,
    serve_llama_cpp,
    serve_sglang,
    serve_transformers,
    serve_vllm,
    sglang_row,
    transformers_row,
    vllm_row,
)
from tcal.engines.runners import LlamaCppRunner, TcalRunner

__all__ = ["CANNOT", "ENGINES", "EXACT", "GENERATING", "ROUNDING", "Engine", "EngineRow", "Facts", "Generator",
           "Runner", "engine_table", "export_engines", "generating_help", "get", "parse_engines", "required_blocker", "serve_commands",
           "table_record"]

ENGINES: dict[str, Engine] = {e.key: e for e in (
    Engine("tcal", "tcal", "tcal", "the model as tcal loads it (transformers with tcal's classes): every test",
           runner=TcalRunner(), opens="the model as tcal and transformers run it"),
    Engine("transformers", "transformers", "hf", "tcal export reloads the checkpoint in transformers and compares "
           "logits (float32 and bfloat16) and tokenisation; the tests do so in a process without tcal",
           transformers_row, serve_transformers),
    Engine("vllm", "vLLM", "hf", "its config code run by the tests on exported config.json files; its kernels and "
           "weight loader read, not run (they need a GPU)", vllm_row, serve_vllm),
    Engine("sglang", "SGLang", "hf", "likewise: its config code run, its kernels and weight loader read",
           sglang_row, serve_sglang),
    Engine("llama.cpp", "llama.cpp", "gguf", "tcal export reloads the GGUF in llama.cpp (llama-cpp-python, through "
           "tcal.engines.llamacpp) and compares logits and tokenisation", llama_cpp_row, serve_llama_cpp,
           runner=LlamaCppRunner(),
           opens="a GGUF: a .gguf file, a tcal export --format gguf directory, or a built-in teacher's own GGUF"),
)}
# tcal eval --engine
GENERATING = tuple(k for k, e in ENGINES.items() if e.generates)


def generating_help() -> str:
    """--engine's help: every engine that generates and what it generates with."""
    return " or ".join(f"{k} ({ENGINES[k].opens})" if ENGINES[k].opens else k for k in GENERATING)


def get(key: str) -> Engine:
    """The engine ``key`` names (a key of :data:`ENGINES`)."""
    from tcal.utils.errors import TcalError

    if key not in ENGINES:
        raise TcalError(f"unknown engine {key!r}; the engines are {', '.join(ENGINES)}")
    return ENGINES[key]


def export_engines(fmt: str) -> list[Engine]:
    """The engines that run an export of format ``fmt``, in the order reports list them."""
    return [e for e in ENGINES.values() if e.reads == fmt and e.rule is not None]


def engine_table(layout, fmt: str, kind: str, check: dict | None = None) -> list[EngineRow]:
    """The engines of the format and how each runs the export."""
    f = Facts.of(layout, fmt, kind)
    return [e.rule(f, check) for e in export_engines(fmt)]


def serve_commands(layout, fmt: str, kind: str, out: str) -> list[str]:
    """The command of each engine that can run the export written to ``out``."""
    f = Facts.of(layout, fmt, kind)
    return [e.serve(out, f) for e in export_engines(fmt) if e.rule(f, None).runs != CANNOT]


def table_record(rows: list[EngineRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def parse_engines(spec: str, fmt: str) -> list[Engine]:
    """'vllm,sglang' -> the engines; a TcalError for a name the format has no engine of."""
    from tcal.utils.errors import TcalError

    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    every = [e for e in ENGINES.values() if e.rule is not None]
    out = []
    for n in names:
        engine = ENGINES.get(n)
        if engine is None or engine.rule is None:
            raise TcalError(f"--engines {spec}: --format {fmt} is not for {n}; the engines are "
                            f"{', '.join(e.key for e in every)}")
        if engine.reads != fmt:
            raise TcalError(f"--engines {spec}: --format {fmt} is not for {n}; {n} runs --format {engine.reads}")
        out.append(engine)
    return out


def required_blocker(layout, fmt: str, kind: str, engines: list[Engine]) -> str | None:
    """The first engine of ``engines`` that cannot run the export, as one line, or None."""
    f = Facts.of(layout, fmt, kind)
    for e in engines:
        row = e.rule(f, None)
        if row.runs == CANNOT:
            return f"{row.engine} cannot run this hybrid: {row.how}"
    return None
