"""`tcal.convert`: teacher + which layers to keep + an init -> initialised hybrid."""
from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from tcal.conversion.apply_init import initialise
from tcal.conversion.inits import get_init
from tcal.conversion.policy import global_layers_note
from tcal.conversion.select import SelectionConfig, select_layers
from tcal.conversion.surgery import build_hybrid
from tcal.conversion.target import DEFAULT_TARGET, target_options
from tcal.data.corpora import Corpus
from tcal.data.instruct import chat_windows, check_template, code_tasks, pack, pad_id, read_samples, render_texts
from tcal.data.overlap import check_no_eval_text
from tcal.data.tokens import mixed_windows
from tcal.models.configuration_hybrid import HybridConfig
from tcal.models.modeling_hybrid import HybridForCausalLM
from tcal.taylor.kl_stage import KLData
from tcal.taylor.pipeline import Calibration, as_calibration_ids, split_calibration
from tcal.utils.command_config import DEFAULT_CALIB
from tcal.utils.errors import TcalError, TcalWarning

# The reference's calibration budget: 4 sequences of 256 tokens.
CALIB_WINDOW, CALIB_WINDOWS = 256, 4


@dataclass
class Conversion:
    hybrid: HybridForCausalLM
    record: dict = field(default_factory=dict)  # init, selection, calibration, per-stage detail, timings


def split_options(options: dict) -> tuple[dict, dict]:
    """GDN construction options (HybridConfig gdn_* fields) vs init switches."""
    fields = HybridConfig.__dataclass_fields__
    gdn, rest = {}, {}
    for k, v in options.items():
        (gdn if (k if k.startswith("gdn_") else f"gdn_{k}") in fields else rest)[k] = v
    return gdn, rest


def calibration_ids(calib, tokenizer, window: int = CALIB_WINDOW, windows: int = CALIB_WINDOWS) -> torch.Tensor:
    """(windows, window) token ids of the calibration corpus (the first windows, a fixed protocol);
    a mixture ``"wiki:calib+sotu:calib"`` takes an equal share of each, interleaved. Text that overlaps a
    built-in evaluation split is refused (:func:`tcal.data.overlap.check_no_eval_text`)."""
    if tokenizer is None:
        raise TcalError("calibrated inits read text: pass tokenizer= (the teacher's) or calib_ids=")
    check_no_eval_text(calib, role="calibration data")  # every built-in evaluation split in the cache
    return mixed_windows(calib, tokenizer, window=window, n_windows=windows)


CHAT = "chat:"


def chat_kl_data(spec: str, tokenizer, window: int, windows: int, heldout_frac: float = 0.25) -> KLData:
    """The KL stage's instruct windows for ``spec`` = ``chat:CODE`` (e.g. ``chat:code:calib``): the documented
    functions of the code corpus CODE as chat-format tasks with their own code as the answer, in the tokenizer's chat
    template, packed whole into ``windows`` windows of ``window`` tokens (the last ``heldout_frac`` held out), with
    the masks of their answer positions: the KL of the stage is on the answers, where an instruct model is used."""
    if not spec.startswith(CHAT):
        raise TcalError(f"KL-stage text {spec!r} is not chat:CODE (e.g. chat:code:calib)")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TcalError(f"--kl-data {spec} frames code tasks in the teacher's chat template, and its tokenizer has "
                        "none (not an instruct model's); use --kl-data calib")
    code = spec[len(CHAT):]
    check_no_eval_text(code, role="KL-stage text")
    ids, mask = None, None
    # about six tasks fit a 512-token window; read the tasks once, more only if they were too few
    for limit in (windows * max(4, window // 64), None):
        ids, mask = chat_windows(tokenizer, code_tasks(code, limit=limit), window)
        if ids.shape[0] >= windows:
            break
    if ids.shape[0] < windows:
        raise TcalError(f"{code} gives {ids.shape[0]} chat windows of {window} tokens, {windows} asked; use fewer "
                        "--kl-windows or a larger code corpus")
    train, held = split_calibration(windows, heldout_frac)
    return KLData(ids[train], ids[held], mask[train], mask[held], name=spec)


ANSWERS = "answers:"


def answers_kl_data(spec: str, tokenizer, window: int, windows: int, heldout_frac: float = 0.25) -> KLData:
    """The KL stage's instruct windows for ``spec`` = ``answers:FILE``: the prompts of a ``samples.jsonl`` (or
    ``.jsonl.xz``, or the folder of a `tcal instruct` run holding one) with the teacher's own answers to them, in its
    chat template, packed whole into windows of ``window`` tokens: ``windows`` in all, the training ones from the
    samples' train split and the held-out ones (``heldout_frac``) from their development split, with the masks of
    the answer positions. The teacher's own answers are the text an instruct model is used on: the KL is where it
    answers, on what it answers."""
    from pathlib import Path

    path = Path(spec[len(ANSWERS):]).expanduser()
    if path.is_dir():
        found = [path / n for n in ("samples.jsonl.xz", "samples.jsonl") if (path / n).is_file()]
        if not found:
            raise TcalError(f"--kl-data {spec}: {path} holds no samples.jsonl(.xz); give the samples file or the "
                            "folder of a `tcal instruct` run")
        path = found[0]
    if not path.is_file():
        raise TcalError(f"--kl-data {spec}: no such file {path}; give a samples.jsonl(.xz) of `tcal instruct`")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TcalError(f"--kl-data {spec} holds chat-format answers, and the teacher's tokenizer has no chat "
                        "template (not an instruct model's); use --kl-data calib")
    samples = read_samples(path)
    check_template(tokenizer, samples, path, "the teacher")
    # the answers and their prompts are training text: refused where they overlap any evaluation text
    check_no_eval_text(Corpus(f"answers:{path.name}", [s["prompt"] + "\n" + s["answer"] for s in samples]),
                       role="KL-stage text")
    held = max(1, round(windows * heldout_frac))
    parts = {}
    for split, want in (("train", windows - held), ("dev", held)):
        rendered = [render_texts(tokenizer, s["prompt"], s["answer"]) for s in samples if s["split"] == split]
        if not rendered:
            raise TcalError(f"--kl-data {spec}: no {split} samples; the KL stage trains on the train split and "
                            "picks its state on the development split")
        ids, mask = pack(rendered, window, pad_id(tokenizer))
        if ids.shape[0] < want:
            raise TcalError(f"--kl-data {spec}: its {split} samples fill {ids.shape[0]} windows of {window} tokens, "
                            f"{want} asked; use fewer --kl-windows")
        parts[split] = (ids[:want], mask[:want])
    (tr, trm), (ho, hom) = parts["train"], parts["dev"]
    return KLData(tr, ho, trm, hom, name=f"answers:{path.name}")


def kl_text(spec: str, tokenizer, window: int, windows: int) -> KLData:
    """The KL stage's own text for ``spec``: ``chat:CODE`` (code tasks with their own functions as the answers) or
    ``answers:FILE`` (the teacher's own answers)."""
    if spec.startswith(ANSWERS):
        return answers_kl_data(spec, tokenizer, window, windows)
    return chat_kl_data(spec, tokenizer, window, windows)


def stage_timings(detail: dict) -> dict:
    """Seconds spent in each Taylor-Calibrate stage that ran, from an init's record: where a conversion's time
    went (Phase 2's layers fitted side by side share one wall time, counted once)."""
    out: dict = {}
    if not isinstance(detail, dict):
        return out
    if detail.get("phase1"):
        out["phase1_s"] = sum(r.get("wall_s", 0.0) for r in detail["phase1"].values())
    if detail.get("phase2"):
        groups = {tuple(r.get("group", [layer])): r.get("group_wall_s", r.get("wall_s", 0.0))
                  for layer, r in detail["phase2"].items()}
        out["phase2_s"] = sum(groups.values())
    if detail.get("kl"):
        out["kl_stage_s"] = detail["kl"]["wall_s"]
    return out


def convert_with_record(
    teacher,
    keep: Sequence[int] | str,
    init: str = "copy",
    *,
    calib=DEFAULT_CALIB,
    tokenizer=None,
    calib_ids: torch.Tensor | Calibration | None = None,
    calib_window: int = CALIB_WINDOW,
    calib_windows: int = CALIB_WINDOWS,
    seed: int = 0,
    progress: bool = False,
    selection: SelectionConfig | None = None,
    target: str = DEFAULT_TARGET,
    share_weights: bool = False,
    kl_data: str | KLData | None = None,
    kl_windows: tuple[int, int] = (20, 512),
    **options,
) -> Conversion:
    """:func:`convert`, also returning what was done (the record written into reports)."""
    spec = get_init(init)
    # resolved (auto) and checked before any model work: a teacher the target cannot express fails here
    asked = target
    target = target_options(target, teacher.config, None if isinstance(keep, str) else list(keep))[0]
    gdn_options, init_options = split_options(options)
    record: dict = {"init": spec.name, "target": target, "timings": {}}
    data_name = "calib_ids" if calib_ids is not None else str(calib)
    if spec.calibrated and calib_ids is None:
        t0 = time.perf_counter()
        calib_ids = calibration_ids(calib, tokenizer, calib_window, calib_windows)
        record["timings"]["tokenise_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if isinstance(keep, str) or selection is not None:
        # ga scores its one-attention students with the init being asked for
        cfg = selection or SelectionConfig(data=str(calib), init=spec.name)
        ids = calib_ids.ids if isinstance(calib_ids, Calibration) else calib_ids
        sel = select_layers(teacher, keep, tokenizer=tokenizer, cfg=cfg, progress=progress,
                            calib_ids=ids if get_init(cfg.init).calibrated else None)
        keep = sel.layers
        record["selection"] = asdict(sel)
        record["target"] = target = target_options(asked, teacher.config, keep)[0]  # the family's rule, these layers
    record["timings"]["select_s"] = time.perf_counter() - t0
    note = global_layers_note(getattr(teacher.config, "layer_types", None), list(keep))
    if note:
        record["warnings"] = [note]
        warnings.warn(note, TcalWarning, stacklevel=2)

    t0 = time.perf_counter()
    hybrid = build_hybrid(teacher, keep, seed=seed, target=target, share_weights=share_weights, **gdn_options)
    record["timings"]["build_s"] = time.perf_counter() - t0
    if spec.calibrated:
        n, t = (calib_ids.ids if isinstance(calib_ids, Calibration) else as_calibration_ids(calib_ids)).shape
        record["calibration"] = {"data": data_name,
                                 "sequences": int(n), "tokens_per_sequence": int(t)}
    if isinstance(kl_data, str) and kl_data.strip() == "calib":
        kl_data = None
    if spec.kl and isinstance(kl_data, str):
        t0 = time.perf_counter()
        kl_data = kl_text(kl_data, tokenizer, window=kl_windows[1], windows=kl_windows[0])
        record["timings"]["kl_data_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    record["detail"] = initialise(hybrid, teacher, spec, calib_ids if spec.calibrated else None,
                                  progress=progress, **({"kl_data": kl_data} if spec.kl else {}), **init_options)
    record["timings"]["init_s"] = time.perf_counter() - t0
    record["timings"].update(stage_timings(record["detail"]))
    hybrid.config.tcal_init = spec.name
    return Conversion(hybrid, record)


def convert(teacher, keep: Sequence[int] | str, init: str = "copy", **kwargs) -> HybridForCausalLM:
    """Build a hybrid of ``teacher`` keeping ``keep`` as softmax attention, GDN elsewhere.

    - ``keep``: a list of layer indices, ``"0,4,8"``, or a policy ``"uniform:K"``, ``"ar:K"``,
      ``"ga:K"``, ``"niah:K"`` (K a count or a percentage, optionally ``@sliding`` / ``@full``) or ``"auto"``
      (:mod:`tcal.conversion.policy`); ar/ga score layers on a validation slice of the
      calibration corpus (:mod:`tcal.conversion.select`).
    - ``init``: one of ``tcal.INITS`` (copy, zero-gate, phase1, phase2, taylor, ...).
    - ``share_weights``: the hybrid uses the teacher's own tensors wherever it keeps them, so converting costs the
      memory of the GDN layers only; the teacher changes with anything that changes them in place (train the
      hybrid whole only after ``tcal.conversion.surgery.unshare``, or after saving and reloading it).
    - ``target``: ``"auto"`` (default: ``"qwen3_5"`` where the layout holds the teacher, else ``"native"``),
      ``"qwen3_5"`` or ``"native"``, the layout the hybrid must fit (:mod:`tcal.conversion.target`); a ``qwen3_5``
      hybrid exports with ``tcal export`` to the engines that run Qwen3.5.
    - Calibrated inits (Taylor-Calibrate) take ``calib_ids`` (token ids (N, T), or a prepared
      :class:`tcal.taylor.pipeline.Calibration`), or tokenise ``calib`` (default ``wiki:calib+shakespeare:calib``,
      disjoint from every ``:eval`` split) with ``tokenizer`` into ``calib_windows`` windows of
      ``calib_window`` tokens (reference: 4 x 256).
    - ``kl_data``: what the KL stage (inits with one, e.g. ``taylor``) fits on: None or ``"calib"``, the calibration
      sequences; ``"chat:CODE"`` (``chat:code:calib``), ``kl_windows`` = (windows, tokens) of chat-format code tasks
      with the KL on their answers (an instruct teacher's tokenizer), or a :class:`tcal.taylor.kl_stage.KLData`.
    - Remaining keyword options: GDN construction (``use_short_conv``, ``output_gate``, ``backend``...)
      or init switches (``align=AlignConfig(...)``, Phase-1 options such as ``zero_wa=True``).
    """
    return convert_with_record(teacher, keep, init, **kwargs).hybrid
