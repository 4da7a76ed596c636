"""The teacher families tcal converts: one module per family, each holding one :class:`Family` as ``FAMILY``.

The registry is this package's modules, found when it is imported: adding a family is adding a module
(docs/extending.md, *Add a family*). Every other part of tcal asks here::

    from tcal import families
    fam = families.of(teacher.config)          # a teacher's or a hybrid's config -> its Family (TcalError if none)
    fam.attention_weights(layer.self_attn)     # q/k/v/o tensors, fused or not
    families.supported()                       # "gemma3_text, llama, ..." for messages
"""
from __future__ import annotations

import importlib
import pkgutil

from tcal.families.family import Attention, AttentionWeights, Family, Mlp
from tcal.utils.errors import TcalError

__all__ = ["FAMILIES", "Attention", "AttentionWeights", "Family", "Mlp", "by_gguf_architecture", "find", "get",
           "model_type", "of", "supported"]


def _discover() -> dict[str, Family]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if isinstance(fam, Family):
            found[fam.name] = fam
    return found


# tcal name -> Family, in name order
FAMILIES: dict[str, Family] = _discover()


def find(kind: str | None) -> Family | None:
    """The family a name, a transformers model_type or a vision-language checkpoint's model_type stands for."""
    for fam in FAMILIES.values():
        if kind in (fam.name, fam.model_type) or (fam.vision_language and kind == fam.vision_language):
            return fam
    return None


def supported(where=lambda f: True) -> str:
    """The model types of the families ``where`` holds for, for messages."""
    return ", ".join(f.model_type for f in FAMILIES.values() if where(f))


def get(kind: str) -> Family:
    """:func:`find`, or a one-line TcalError naming the families tcal converts."""
    fam = find(kind)
    if fam is None:
        raise TcalError(f"unsupported architecture {kind!r}; tcal converts {supported()} decoder-only models")
    return fam


def model_type(config) -> str | None:
    """A config's model type; a tcal hybrid's is its teacher's."""
    base = getattr(config, "base_config", None)
    if base:
        return base.get("model_type")
    return getattr(config, "model_type", None)


def of(config) -> Family:
    """The family of a teacher's (or a hybrid's) config."""
    return get(model_type(config))


def by_gguf_architecture(arch: str) -> list[Family]:
    """The families whose GGUFs have llama.cpp architecture ``arch`` (Llama and Mistral share ``llama``)."""
    return [f for f in FAMILIES.values() if f.gguf_architecture == arch]
