"""Evaluation: held-out perplexity (perplexity.py) and RULER-style long-context retrieval (niah.py)."""
from tcal.evaluate.perplexity import perplexity, perplexity_report, window_nll, window_ppl

__all__ = ["perplexity", "perplexity_report", "window_nll", "window_ppl"]
