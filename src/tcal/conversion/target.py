"""Conversion targets: which layout a hybrid is built to fit (plain data, no torch).

``native``: tcal's own hybrid (the teacher's modeling code with GDN layers swapped in); it runs where
``import tcal`` runs. ``qwen3_5``: a hybrid that the Qwen3.5 dense layout expresses exactly, so that
``tcal export`` can hand it to the engines that run that layout (transformers without tcal, vLLM,
SGLang, llama.cpp). What the target changes, and why:

- GDN layers carry no bias and no q/k RMSNorm (the layout's ``in_proj_*`` have no bias and its GDN
  normalises q and k only by their l2 norm). Phase 1's exact write gate then folds its bias into
  ``b_proj``'s weights (:func:`tcal.taylor.formulas.exact_b_weight`). A teacher's q/k/v biases and q/k norm
  weights are not carried into the GDN layers; Phase 2 fits the layers without them.
- Every RMSNorm takes eps 1e-6 (:data:`LAYOUT_EPS`). The layout has one eps for all its norms, and
  the engines disagree on the l2 norm of q and k inside the GDN kernel: transformers, fla and vLLM add
  1e-6, llama.cpp adds the model's RMSNorm eps. With 1e-6 everywhere every engine computes the same model.
- Kept attention layers stay the teacher's; the export maps them (a zero output gate with o_proj x 2,
  and q/k RMSNorm made linear where the teacher has none: :mod:`tcal.export.qwen3_5`).
"""
from __future__ import annotations

from collections.abc import Sequence

from tcal import families
from tcal.utils.errors import TcalError

TARGETS = ("auto", "qwen3_5", "native")
# auto: qwen3_5 wherever the layout expresses the teacher (it measured as good as native at every budget:
# docs/results.md, *Serving layout*), native for the families it cannot (Gemma 3)
DEFAULT_TARGET = "auto"
LAYOUT_EPS = 1e-6

TARGET_HELP = ("layout the hybrid is built for: qwen3_5 (the Qwen3.5 dense layout that transformers, vLLM, SGLang and "
               "llama.cpp run; export it with tcal export), native (tcal's own, which carries a teacher's q/k/v "
               "biases and q/k norms into the GDN layers; runs where tcal is imported), or auto (qwen3_5 where the "
               "layout can express the teacher, native otherwise, e.g. Gemma 3)")


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise TcalError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return target


def layout_blocker(config, attention: Sequence[int] | None = None) -> str | None:
    """Why the Qwen3.5 layout cannot express a hybrid of this teacher config keeping ``attention`` as attention
    layers (None: whichever are kept), in one line, or None: the family's rule (:meth:`tcal.families.Family.
    layout_blocker`: its ``layout``, the common rules, its own ``layout_rule``)."""
    fam = families.find(families.model_type(config))
    if fam is None or not fam.layout:
        return (f"the teacher is a {families.model_type(config)!r} model; the Qwen3.5 layout holds "
                f"{families.supported(lambda f: f.layout)} decoder layers (two norms per layer, a SiLU MLP, unscaled "
                "embeddings)")
    return fam.layout_blocker(config, attention)


def resolve_target(target: str, config, attention: Sequence[int] | None = None) -> str:
    """``auto`` -> qwen3_5 where the layout expresses the teacher keeping ``attention`` as attention layers, else
    native; the others as they are."""
    check_target(target)
    if target == "auto":
        return "native" if layout_blocker(config, attention) else "qwen3_5"
    return target


def target_options(target: str, config, attention: Sequence[int] | None = None) -> tuple[str, dict, dict]:
    """(the resolved target, HybridConfig gdn_* options, teacher-config overrides) that build a hybrid for
    ``target`` keeping ``attention`` as attention layers. The native target changes nothing. Raises a TcalError
    when the teacher cannot be expressed."""
    target = resolve_target(target, config, attention)
    if target == "native":
        return target, {}, {}
    blocker = layout_blocker(config, attention)
    if blocker:
        raise TcalError(f"--target qwen3_5: {blocker}; convert with --target native")
    gdn = dict(gdn_qkv_bias=False, gdn_o_bias=False, gdn_qk_norm=False, gdn_beta_bias=False,
               gdn_output_gate=True, gdn_norm_eps=LAYOUT_EPS)
    return target, gdn, {"rms_norm_eps": LAYOUT_EPS}
