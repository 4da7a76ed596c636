"""tcal: convert Transformer LMs into hybrid attention / Gated DeltaNet models (Taylor-Calibrate init).

``import tcal`` is cheap (no torch): the public API below is imported on first use. tcal's model
classes are registered with transformers' Auto classes as soon as those are imported, so after
``import tcal`` a saved hybrid loads with ``AutoModelForCausalLM.from_pretrained(dir)``, without
``trust_remote_code``.
"""
from __future__ import annotations

import importlib

from tcal.conversion.inits import INITS, InitSpec, register_init
from tcal.utils.errors import TcalError
from tcal.utils.import_hooks import after_import
from tcal.utils.moved import install

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "convert": "tcal.conversion.convert",
    "load_corpus": "tcal.data.corpora",
    "token_windows": "tcal.data.tokens",
    "load_teacher": "tcal.data.teachers",
    "perplexity": "tcal.evaluate",
    "perplexity_report": "tcal.evaluate",
    "niah": "tcal.evaluate.tasks.niah.ruler",
    "humaneval": "tcal.evaluate.tasks.humaneval.problems",
    "HybridConfig": "tcal.models.configuration_hybrid",
    "HybridForCausalLM": "tcal.models.modeling_hybrid",
}

# old module path -> where the module lives now: the old path still imports it (tcal.utils.moved)
MOVED = {
    "tcal.evaluate.humaneval": "tcal.evaluate.tasks.humaneval.problems",
    "tcal.evaluate.niah": "tcal.evaluate.tasks.niah.ruler",
    "tcal.evaluate.harness": "tcal.evaluate.tasks.lm_eval.harness",
    "tcal.evaluate.kl": "tcal.modules.distill_loss",
    "tcal.utils.config": "tcal.utils.command_config",
    "tcal.modules.config": "tcal.modules.gdn_shape",
    "tcal.taylor.config": "tcal.taylor.stage_config",
    "tcal.train.config": "tcal.train.options",
    "tcal.conversion.initialise": "tcal.conversion.apply_init",
}
install(MOVED)

__all__ = ["INITS", "InitSpec", "TcalError", "__version__", "register_init", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tcal' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _register_config() -> None:
    importlib.import_module("tcal.models.configuration_hybrid")


def _register_model() -> None:
    importlib.import_module("tcal.models.modeling_hybrid")


# configuration_auto is complete before anything can read a checkpoint's config; modeling_auto
# before AutoModelForCausalLM can build one. Registering the model class only then keeps
# transformers' own, half-imported modules out of the way.
after_import("transformers.models.auto.configuration_auto", _register_config, wait_for=("tcal", "transformers"))
after_import("transformers.models.auto.modeling_auto", _register_model, wait_for=("tcal", "transformers"))
