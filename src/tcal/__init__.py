"""tcal: convert Transformer LMs into hybrid attention / Gated DeltaNet models (Taylor-Calibrate init).

Importing tcal registers the ``tcal_hybrid`` model type with transformers' Auto classes, so a
saved hybrid loads with ``AutoModelForCausalLM.from_pretrained(dir)``.
"""
from tcal.convert import INITS, convert
from tcal.data import load_corpus, token_windows
from tcal.errors import TcalError
from tcal.evaluate import perplexity, perplexity_report
from tcal.hybrid import HybridConfig, HybridForCausalLM
from tcal.teachers import load_teacher

__version__ = "0.1.0"
__all__ = [
    "INITS", "HybridConfig", "HybridForCausalLM", "TcalError", "__version__", "convert", "load_corpus",
    "load_teacher", "perplexity", "perplexity_report", "token_windows",
]
