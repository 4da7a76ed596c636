"""RoPE as tcal reads it from a teacher config, and the one rule about it: the GGUFs tcal writes carry plain RoPE.

A GDN layer has no position encoding (RoPE is dropped by design, docs/method.md); a kept attention layer keeps the
teacher's RoPE whatever its kind, in tcal and in the Qwen3.5 layout's transformers checkpoint (whose config carries
the teacher's ``rope_parameters``: ``llama3``, ``linear``, ... and transformers computes them the same way).
llama.cpp's files are written without any RoPE scaling keys, so a teacher whose RoPE is scaled is refused there.
"""
from __future__ import annotations

DEFAULT_THETA = 10000.0


def rope_parameters(config) -> dict:
    """The config's RoPE as one dict with ``rope_type`` (``default`` where unset) and ``rope_theta``."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(config, "rope_theta", DEFAULT_THETA))
    return rope


def gguf_rope_blocker(rope: dict, arch: str) -> str | None:
    """Why a GGUF of llama.cpp's architecture ``arch`` written by tcal cannot hold this RoPE (a config's
    :func:`rope_parameters`; one line), or None: tcal writes no RoPE scaling keys, so only plain RoPE fits."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    return f"the teacher's RoPE is {kind!r}; llama.cpp's {arch} applies no RoPE scaling in the GGUFs tcal writes"
