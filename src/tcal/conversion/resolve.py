"""One resolve step per command, before anything loads: the teacher read once (:class:`TeacherRef`: the built-in it
is or comes from, the family it loads as), every ``auto`` of the command's flags that follows the teacher turned into
what it stands for (``--calib``, ``--kl-data``, ``--eval``, ``tcal convert``'s ``--keep``), and a teacher of a family
tcal does not convert refused in one line. The settings that follow the machine (``--device``, ``--calib-budget``,
``--precision``) are resolved where they are used, from the device."""
from __future__ import annotations

import warnings

from tcal import families
from tcal.data.teacher_table import CODE_CALIB, TEACHERS, TeacherRef
from tcal.models.configuration_hybrid import HybridConfig
from tcal.utils.errors import TcalError, TcalWarning

AUTO = "auto"


def check_teacher_spec(teacher: TeacherRef | str) -> None:
    """Refuse, before it loads (a 1B model takes a minute to dequantise), a teacher whose family tcal does not
    convert: read from a local directory's config.json or a GGUF's header. A hub id or an unreadable file passes
    here and is checked once loaded."""
    teacher = teacher if isinstance(teacher, TeacherRef) else TeacherRef(teacher)
    kind, spec = teacher.family, teacher.spec
    if kind is None or kind == HybridConfig.model_type or families.find(kind):
        return  # a hybrid is refused once loaded, with the reason
    if kind.startswith("gguf:"):
        arch = kind[len("gguf:"):]
        if families.by_gguf_architecture(arch):
            return
        archs = sorted({f.gguf_architecture for f in families.FAMILIES.values() if f.gguf_architecture})
        raise TcalError(f"{spec} is a GGUF of architecture {arch!r}, which tcal does not convert; tcal converts "
                        f"{', '.join(archs)} GGUFs ({families.supported(lambda f: f.gguf_architecture)} models)")
    raise TcalError(f"unsupported architecture {kind!r} in {spec}; tcal converts {families.supported()} "
                    "decoder-only models")


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip() == AUTO


def apply_cpu_recipe(cfg, ref: TeacherRef, given) -> str | None:
    """``tcal convert`` on a CPU with ``--calib-budget auto``: the teacher's CPU recipe (:class:`CpuRecipe`) fills
    the budget and each of its flags the user left to its default (``given``: the flags as typed,
    :func:`tcal.utils.flags.as_given`). Returns the recipe's flags as the user would type them, or None where the
    teacher has no recipe or the budget was named."""
    recipe = ref.cpu_convert
    if recipe is None or not _is_auto(cfg.calib_budget):
        return None
    cfg.calib_budget = recipe.budget
    for name in ("align_steps", "kl_steps"):
        if getattr(given, name) is None:
            setattr(cfg, name, getattr(recipe, name))
    if _is_auto(given.kl_data):
        cfg.kl_data = recipe.kl_data
    if _is_auto(given.keep):
        cfg.keep = recipe.keep
    if _is_auto(given.fit_matmul):
        cfg.fit_matmul = recipe.fit_matmul
    return recipe.flags()


def resolve_teacher_args(cfg, teacher=None, *, every_eval: bool = False, keep_budget: str | None = None,
                         check: bool = True) -> TeacherRef:
    """A command's teacher (``teacher``, default ``cfg.teacher``) read once, and each of ``cfg``'s flags that says
    ``auto`` and follows the teacher resolved from it: ``--kl-data`` and ``--calib`` (the teacher's own text; said
    aloud where a teacher tcal does not know is named like a code model but gets the prose default), ``--eval`` (its
    home domain, or ``every_eval`` held-out domain), ``--keep`` where ``keep_budget`` names the calibration budget
    it follows (``tcal convert``). ``check``: refuse a teacher of a family tcal does not convert."""
    ref = teacher if isinstance(teacher, TeacherRef) else TeacherRef(cfg.teacher if teacher is None else teacher)
    if _is_auto(getattr(cfg, "kl_data", None)):
        cfg.kl_data = ref.kl_data
    if isinstance(getattr(cfg, "kl_data", None), str) and cfg.kl_data.strip() == "answers":
        path = ref.answers()
        if path is None:
            shipped = ", ".join(t.name for t in TEACHERS.values() if t.answers)
            raise TcalError(f"--kl-data answers: tcal ships the own answers of {shipped} only, not of {ref.spec}; "
                            "build them with `tcal instruct --teacher ...` and pass --kl-data answers:OUT")
        cfg.kl_data = f"answers:{path}"
    if _is_auto(getattr(cfg, "calib", None)):
        cfg.calib = ref.calib
        if ref.origin is None and "code" in ref.spec.lower():
            warnings.warn(f"--calib auto: {ref.spec} is not a built-in teacher (nor made from one), so it calibrates "
                          f"on the prose default {cfg.calib}; for a code model pass --calib {CODE_CALIB}",
                          TcalWarning, stacklevel=2)
    if _is_auto(getattr(cfg, "eval", None)):
        cfg.eval = ",".join(ref.eval if every_eval else ref.eval[:1])
    if keep_budget is not None and _is_auto(getattr(cfg, "keep", None)):
        cfg.keep = ref.convert_keep(keep_budget)
    if check:
        check_teacher_spec(ref)
    return ref
