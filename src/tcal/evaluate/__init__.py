"""Evaluation: the Task interface every command evaluates through (task.py) and the tasks themselves, one module or
package each (tasks/: perplexity, retrieval, HumanEval, the harness, the development answers' KL), each task's own
library beside it; held-out likelihood and perplexity (likelihood.py), the sandbox that runs generated programs
(sandbox*.py) and speed (speed.py). Imported lazily, so that the command line reads the task registry without
torch."""
from __future__ import annotations

import importlib

__all__ = ["perplexity", "perplexity_report", "window_nll", "window_ppl"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("tcal.evaluate.likelihood"), name)
    raise AttributeError(f"module 'tcal.evaluate' has no attribute {name!r}")
