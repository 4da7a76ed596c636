"""What an engine is to tcal: :class:`Engine`, one per engine in :data:`tcal.engines.ENGINES`.

An engine has a name, what it reads (a tcal export of a format, or the model tcal loads), how tcal checks it, and,
as far as tcal knows it:

- for an engine that runs exports, its rule (which exports it runs as the hybrid, which with rounding and how much,
  which not and why: a function of the export's :class:`Facts` giving an :class:`EngineRow`) and the command that
  serves an export with it;
- for an engine tcal runs itself, its :class:`Runner`: how tcal checks it is installed, finds what it opens for a
  model spec, opens a model (a :class:`Generator`, which generates greedily) and times an export (``tcal bench``).

Torch-free: a runner imports what it runs with inside its methods, so ``tcal --help`` stays light.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

EXACT, ROUNDING, CANNOT = "exactly", "with rounding", "cannot"


@dataclass
class Facts:
    """What the engine rules read of an export."""
    fmt: str  # hf or gguf
    kind: str  # hf: float32 / bfloat16; gguf: the file type
    layer_types: list[str]
    interval: int | None  # the period when the placement is Qwen3.5's own, else None
    qkv_bias: bool  # the kept attention layers carry q/k/v biases
    o_bias: bool  # ... and a nonzero o_proj bias
    linearised: bool  # some kept attention layer's q/k norm is the linearised one (tiny scaled weights)
    gdn_head_dim: int

    @classmethod
    def of(cls, layout, fmt: str, kind: str) -> Facts:
        cfg, sd = layout.config, layout.state_dict
        o_bias = any(k.endswith("self_attn.o_proj.bias") and bool(v.ne(0).any()) for k, v in sd.items())
        return cls(fmt, kind, list(cfg["layer_types"]), cfg.get("full_attention_interval"), bool(cfg["qkv_bias"]),
                   o_bias, bool(layout.scaled), int(cfg["linear_key_head_dim"]))

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]


@dataclass
class EngineRow:
    engine: str  # the engine's name as people write it
    versions: str
    runs: str  # EXACT, ROUNDING or CANNOT
    how: str  # the settings it needs and the rounding, or why it cannot

    def line(self) -> str:
        return f"{self.engine} {self.runs}: {self.how}"


class Generator:
    """A model opened in an engine: greedy continuations of text prompts whose special tokens are written out.
    ``tokenizer`` is what the prompts are built with (its chat template, its BOS), ``where`` says for reports what ran
    the model, ``chunk`` is how many prompts one :meth:`generate` call should take where the caller keeps work
    between calls. Close it when done (or use it as a context manager)."""

    where: str = ""
    tokenizer: object = None
    chunk: int = 8

    def generate(self, prompts: Sequence[str], stops: Sequence[str], *, max_new_tokens: int, progress: bool = False,
                 desc: str = "generate") -> list[str]:
        """One continuation per prompt, in order, each ended at the first of ``stops`` (the stop itself may be
        kept: callers cut at it), at the model's end of turn or after ``max_new_tokens``."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what :meth:`Runner.open` took (a llama.cpp context); the model tcal loaded stays the caller's."""

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Runner:
    """How tcal runs an engine itself. A runner states only what its engine does."""

    def require(self, purpose: str) -> None:
        """A one-line TcalError naming ``purpose`` where the engine is not installed (before any work)."""

    def locate(self, model: str):
        """What :meth:`open` opens for the model spec a command was given (a file for an engine that reads one), or
        None where the engine runs the model the command loads itself."""
        return None

    def open(self, model, tokenizer=None, *, threads: int | None = None, batch_size: int | None = None) -> Generator:
        """``model`` (what :meth:`locate` found, or the model the command loaded, with its tokenizer) opened for
        generation."""
        raise NotImplementedError(f"{type(self).__name__} does not generate")

    def bench(self, name: str, model, contexts: list[int], *, decode_tokens: int, reps: int, vocab_size: int,
              threads: int | None = None, device: str = "cpu", cache_len: int | None = None) -> list[dict]:
        """``tcal bench``'s rows of ``model`` run in this engine, one per context: {"model": name, "context",
        "prefill_tok_s", "decode_ms", ...}. ``model``: the export written for the engine (a GGUF's path), or the
        model the command loaded where the engine :attr:`Engine.uses_model`; ``cache_len``: the longest context any
        row reaches (one compiled cache for all of them)."""
        raise NotImplementedError(f"{type(self).__name__} does not time exports")


@dataclass(frozen=True)
class Engine:
    key: str  # what --engines and --engine take
    name: str  # as reports write it
    reads: str  # what it runs: "hf" or "gguf" (a tcal export of that format), or "tcal" (what tcal loads)
    checked: str  # how tcal checks that it runs what it is given
    rule: Callable[[Facts, dict | None], EngineRow] | None = None  # how it runs an export (None: not an export engine)
    serve: Callable[[str, Facts], str] | None = None  # the command that serves an export written to a directory
    runner: Runner | None = None  # how tcal runs it itself (None: tcal checks it, but does not run it)
    opens: str = ""  # what it generates with, for --engine's help: "a GGUF: a .gguf file, ..."

    @property
    def generates(self) -> bool:
        """``tcal eval --engine`` generates with it (HumanEval)."""
        return self.runner is not None

    @property
    def uses_model(self) -> bool:
        """It runs the model the command loads (its dtype and device are the command's), not a file of its own."""
        return self.reads == "tcal"
