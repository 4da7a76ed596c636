"""tcal: convert Transformer LMs into hybrid attention / Gated DeltaNet models (Taylor-Calibrate init).

Importing tcal registers the ``tcal_hybrid`` model type with transformers' Auto classes.
"""
from tcal.convert import INITS, convert
from tcal.errors import TcalError
from tcal.hybrid import HybridConfig, HybridForCausalLM

__version__ = "0.1.0"
__all__ = ["INITS", "HybridConfig", "HybridForCausalLM", "TcalError", "convert", "__version__"]
