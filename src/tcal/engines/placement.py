"""Qwen3.5's periodic placement of attention layers: layer i is attention exactly when (i + 1) % K == 0. SGLang places
attention by K alone, llama.cpp's ``qwen35`` reads K where the GGUF has no per-layer list, and ``--keep interval:K``
converts to it."""
from __future__ import annotations


def interval_layers(period: int, num_layers: int) -> list[int]:
    """The layers Qwen3.5's periodic placement keeps as attention: i with (i + 1) % period == 0."""
    return [i for i in range(num_layers) if (i + 1) % period == 0]


def periodic_interval(layers: list[int], num_layers: int) -> int | None:
    """The period K of ``layers`` if they are exactly interval_layers(K, num_layers), else None."""
    want = sorted(layers)
    return next((k for k in range(2, num_layers + 1) if interval_layers(k, num_layers) == want), None)
