"""RoPE as tcal reads it from a teacher config, and how the GGUFs tcal writes hold it.

A GDN layer has no position encoding (RoPE is dropped by design, docs/method.md); a kept attention layer keeps the
teacher's RoPE whatever its kind, in tcal and in the Qwen3.5 layout's transformers checkpoint (whose config carries
the teacher's ``rope_parameters``: ``llama3``, ``linear``, ... and transformers computes them the same way).
llama.cpp's files are another matter: tcal writes no RoPE scaling keys, so a GGUF holds plain RoPE, plus whatever a
family's :class:`GGUFRope` adds (Llama 3's frequency factors, :mod:`tcal.families.llama`) and refuses otherwise.
"""
from __future__ import annotations

DEFAULT_THETA = 10000.0


def rope_parameters(config) -> dict:
    """The config's RoPE as one dict with ``rope_type`` (``default`` where unset) and ``rope_theta``."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(config, "rope_theta", DEFAULT_THETA))
    return rope


class GGUFRope:
    """How a GGUF that tcal writes holds a family's RoPE, in llama.cpp's architecture ``arch`` (the family's own for a
    plain teacher, ``qwen35`` for a hybrid). This base class, every family's unless its module gives another: plain
    RoPE only. A family whose scaling llama.cpp can hold overrides both methods."""

    def blocker(self, rope: dict, arch: str) -> str | None:
        """Why a GGUF of ``arch`` cannot hold this RoPE (a config's :func:`rope_parameters`; one line), or None."""
        kind = rope.get("rope_type", "default")
        if kind == "default":
            return None
        return f"the teacher's RoPE is {kind!r}; llama.cpp's {arch} applies no RoPE scaling in the GGUFs tcal writes"

    def tensors(self, config, arch: str) -> dict[str, list[float]]:
        """The tensors (llama.cpp name -> float32 values) a GGUF of ``arch`` stores besides the weights to hold the
        RoPE of ``config``; called only where :meth:`blocker` says None."""
        return {}


PLAIN_ROPE = GGUFRope()
