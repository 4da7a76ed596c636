"""Evaluation: held-out perplexity (perplexity.py), RULER-style long-context retrieval (niah.py), HumanEval
(humaneval.py, sandbox.py), the harness (harness.py) and speed; the Task interface every command evaluates through
(task.py, tasks/). Imported lazily, so that the command line reads the task registry without torch."""
from __future__ import annotations

import importlib
import sys
import types

__all__ = ["perplexity", "perplexity_report", "window_nll", "window_ppl"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("tcal.evaluate.perplexity"), name)
    raise AttributeError(f"module 'tcal.evaluate' has no attribute {name!r}")


class _Package(types.ModuleType):
    # Importing the submodule tcal.evaluate.perplexity binds its name on this package; the name stays the function
    # perplexity(), as `from tcal.evaluate import perplexity` has always given.
    def __setattr__(self, name, value):
        if name == "perplexity" and isinstance(value, types.ModuleType):
            value = value.perplexity
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
