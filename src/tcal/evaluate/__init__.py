"""Evaluation: held-out perplexity (perplexity.py), RULER-style long-context retrieval (niah.py), HumanEval
(humaneval.py, sandbox.py), the harness (harness.py) and speed; the Task interface every command evaluates through
(task.py, tasks/). Imported lazily, so that the command line reads the task registry without torch."""
from __future__ import annotations

import importlib

__all__ = ["perplexity", "perplexity_report", "window_nll", "window_ppl"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("tcal.evaluate.perplexity"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tcal.evaluate' has no attribute {name!r}")
