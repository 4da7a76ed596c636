"""How many distillation tokens each initialisation needs (``tcal recover``).

For each init (``copy``, ``taylor``, ...): convert the teacher with the same kept layers and
seed, then distil with the same data, data order, schedule and token budget
(:func:`tcal.distill.distill`). The teacher's held-out PPL is computed once with the same
evaluation protocol as the curves. Outputs (``OUT/``, written by renaming ``OUT.partial/``
once every run is finished)::

    <init>/               each distillation run (final model, curve.csv, curve.png, report.*)
    recovery.png          all curves, held-out PPL vs training tokens, log y
    recovery.md / .json   tokens to reach 1.1x / 1.2x / 1.5x / 2x teacher PPL and the copy
                          run's final PPL, per init, and the ratio copy / init per target
    report.md, tcal_config.json

Tokens to a target: the first evaluation point at or below the target PPL. A target never
reached is reported as ``> N`` (N = the tokens the run trained on), never extrapolated. Where
reached, a linear interpolation (in PPL, between the two evaluation points that bracket the
target) is given as well, labelled as such.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tcal.atomic import publish_dir, write_json
from tcal.config import arg
from tcal.convert import init_function, parse_inits
from tcal.distill import (
    SCHEDULES,
    DistillConfig,
    TrainOptions,
    _load_model,
    _save_model,
    changed_settings,
    distill,
    eval_windows_for,
    finished_report,
    has_checkpoint,
    load_model_and_tokenizer,
    load_token_stream,
    partial_dir,
)
from tcal.errors import TcalError

log = logging.getLogger(__name__)

__all__ = [
    "TARGET_FACTORS",
    "RecoverConfig",
    "plot_recovery",
    "replot",
    "run_recover",
    "table_markdown",
    "target_table",
    "tokens_to_target",
]

TARGET_FACTORS = (1.1, 1.2, 1.5, 2.0)
BASELINE = "copy"


@dataclass
class RecoverConfig(TrainOptions):
    teacher: str = arg("smollm2-135m", "teacher: built-in name, local HF directory, .gguf file or hub id")
    keep: str = arg("0,4,8,12,16,20,24,28", "layers kept as softmax attention: a list like 0,4,8")
    inits: str = arg("copy,taylor", "initialisations to compare, comma-separated (copy is the baseline)")
    data: str = arg("", "training tokens: a token pool directory (tcal.pool), a .npy file or a corpus spec")
    tokens: int = arg(20_000_000, "training-token budget of every run (rounded up to whole steps)")
    out: str = arg("runs/recover", "output directory (written atomically; progress in OUT.partial/)")
    calib: str = arg("wiki:calib", "calibration corpus for the inits that need one (taylor, phase1, phase2)")
    calib_window: int = arg(512, "calibration sequence length in tokens")
    calib_windows: int = arg(32, "number of calibration sequences (the first N windows)")
    align_steps: int = arg(300, "Phase 2 alignment steps per layer (inits with Phase 2)")
    use_short_conv: bool = arg(False, "causal depthwise short conv (width 4) before q/k/v activations")
    output_gate: bool = arg(True, "SiLU output gate (W_g) on the per-head RMSNorm")
    # Constant after warm-up: the curve up to t tokens does not depend on the budget, so the
    # tokens-to-target numbers are a property of the init, not of --tokens.
    schedule: str = arg("constant", "learning-rate schedule after the warm-up", choices=SCHEDULES)
    eval_every: int = arg(500_000, "evaluate every N training tokens (and at 0 tokens and at the end)")
    eval_early: int = arg(6, "extra early evaluations at eval-every/2, /4, ... (this many)")


# ---------------------------------------------------------------------------------------------
# The target table (pure functions)
# ---------------------------------------------------------------------------------------------


def _points(curve) -> list[tuple[int, float]]:
    pts = []
    for r in curve:
        t, p = (r["tokens"], r["eval_ppl"]) if isinstance(r, dict) else r
        pts.append((int(t), float(p)))
    return sorted(pts)


def tokens_to_target(curve, target: float) -> dict:
    """When a curve (rows with ``tokens``/``eval_ppl``, or (tokens, ppl) pairs) first reaches ``target``.

    Returns ``reached``, ``tokens`` (first evaluation point with PPL <= target, else None),
    ``interp`` (linear interpolation in PPL between the bracketing points; equals ``tokens``
    when the first point already qualifies), ``budget`` (last evaluated tokens) and ``display``
    (``"1,234"`` or ``"> N"``).
    """
    pts = _points(curve)
    if not pts:
        raise TcalError("empty curve")
    budget = pts[-1][0]
    prev = None
    for t, p in pts:
        if p <= target:
            interp = float(t)
            if prev is not None and math.isfinite(prev[1]) and prev[1] > p:
                t0, p0 = prev
                interp = t0 + (p0 - target) / (p0 - p) * (t - t0)
            return {"reached": True, "tokens": t, "interp": interp, "budget": budget, "display": f"{t:,}"}
        prev = (t, p)
    return {"reached": False, "tokens": None, "interp": None, "budget": budget, "display": f"> {budget:,}"}


def _ratio(base: dict, other: dict) -> dict:
    """copy tokens / init tokens, with bounds where a run never reached the target."""
    if base["reached"] and other["reached"]:
        if other["tokens"] == 0:
            return {"value": None if base["tokens"] == 0 else math.inf, "bound": "=",
                    "display": "n/a (both at 0)" if base["tokens"] == 0 else "inf (reached before training)"}
        v = base["tokens"] / other["tokens"]
        return {"value": v, "bound": "=", "display": f"{v:.2f}x"}
    if not base["reached"] and other["reached"]:
        if other["tokens"] == 0:
            return {"value": math.inf, "bound": "=", "display": "inf (reached before training)"}
        v = base["budget"] / other["tokens"]
        return {"value": v, "bound": ">", "display": f"> {v:.2f}x"}
    if base["reached"] and not other["reached"]:
        v = base["tokens"] / other["budget"] if other["budget"] else math.inf
        return {"value": v, "bound": "<", "display": f"< {v:.2f}x"}
    return {"value": None, "bound": None, "display": "n/a (neither reached)"}


def target_table(curves: dict, teacher_ppl: float, *, baseline: str = BASELINE,
                 factors: Sequence[float] = TARGET_FACTORS) -> dict:
    """Tokens each run needs to reach each target, and the ratio baseline / run.

    ``curves``: ``{init: curve}`` (see :func:`tokens_to_target`). Targets: ``f x teacher_ppl``
    for each factor, and the baseline run's final PPL when the baseline is among the curves.
    Returns ``{"teacher_ppl", "baseline", "inits", "targets": [{"name", "ppl", "runs": {init:
    tokens_to_target}, "ratio": {init: {"value", "bound", "display"}}}]}``.
    """
    if not curves:
        raise TcalError("no curves to tabulate")
    targets = [(f"{f:g}x teacher PPL", f * teacher_ppl) for f in factors]
    if baseline in curves:
        final = _points(curves[baseline])[-1][1]
        targets.append((f"{baseline} final PPL", final))
    rows = []
    for name, ppl in targets:
        runs = {init: tokens_to_target(c, ppl) for init, c in curves.items()}
        ratio = {}
        if baseline in runs:
            ratio = {init: _ratio(runs[baseline], r) for init, r in runs.items() if init != baseline}
        rows.append({"name": name, "ppl": ppl, "runs": runs, "ratio": ratio})
    return {"teacher_ppl": teacher_ppl, "baseline": baseline, "inits": list(curves), "targets": rows}


def table_markdown(table: dict) -> str:
    inits = table["inits"]
    base = table["baseline"]
    others = [i for i in inits if i != base] if base in inits else []
    head = ["target", "PPL"] + [f"{i}: tokens" for i in inits] + [f"{base}/{i}" for i in others]
    head += [f"{i}: interp." for i in inits]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["targets"]:
        cells = [row["name"], f"{row['ppl']:.2f}"]
        cells += [row["runs"][i]["display"] for i in inits]
        cells += [row["ratio"][i]["display"] for i in others]
        cells += [f"{row['runs'][i]['interp']:,.0f}" if row["runs"][i]["reached"] else "-" for i in inits]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Teacher PPL {table['teacher_ppl']:.3f}. \"tokens\": the first evaluation point at or below the target "
        "(\"> N\": not reached within the N tokens trained; never extrapolated). "
        f"\"{base}/init\": {base}'s tokens divided by the init's (\"> r\" / \"< r\": bounds where one run did not "
        "reach the target). \"interp.\": linear interpolation in PPL between the two evaluation points that "
        "bracket the target (an estimate, not a measured point).",
    ]
    return "\n".join(lines) + "\n"


def plot_recovery(curves: dict, teacher_ppl: float, path, *, table: dict | None = None, title: str = "") -> str | None:
    """Left: whole curves, log PPL. Right: linear zoom on the targets, each marked where a run first
    reaches it (a run that copy-init starts thousands of PPL above would flatten the targets otherwise)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover
        log.warning("no plot (%s)", e)
        return None
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {}
    for init, curve in curves.items():
        pts = _points(curve)
        xs, ys = [t / 1e6 for t, _ in pts], [p for _, p in pts]
        (line,) = full.plot(xs, ys, "o-", ms=3, label=init)
        zoom.plot(xs, ys, "o-", ms=3, label=init, color=line.get_color())
        colors[init] = line.get_color()
    targets = table["targets"] if table is not None else []
    for ax in (full, zoom):
        ax.axhline(teacher_ppl, color="k", lw=1.2, label=f"teacher {teacher_ppl:.2f}")
        for row in targets:
            ax.axhline(row["ppl"], color="gray", lw=0.6, ls=":")
        ax.set_xlabel("distillation tokens (millions)")
        ax.grid(True, which="both", alpha=0.3)
    full.set_yscale("log")
    full.set_ylabel("held-out PPL")
    full.set_title("all evaluations (log scale)", fontsize=10)
    # Zoom: from just under the teacher to a little above the highest target.
    top = max([teacher_ppl * 2.2] + [row["ppl"] * 1.15 for row in targets])
    zoom.set_ylim(teacher_ppl * 0.95, top)
    for row in targets:
        zoom.annotate(f"{row['name']} ({row['ppl']:.1f})", (1.0, row["ppl"]), xycoords=("axes fraction", "data"),
                      xytext=(-4, 2), textcoords="offset points", ha="right", va="bottom", fontsize=7, color="gray")
        for init, hit in row["runs"].items():
            if hit.get("reached") and init in colors:
                zoom.plot([hit["tokens"] / 1e6], [row["ppl"]], marker="v", ms=7, color=colors[init], ls="none")
    zoom.set_title("zoom on the targets (first point at or below each target: \u25bc)", fontsize=10)
    zoom.legend(loc="lower left", bbox_to_anchor=(0.0, 0.08), fontsize=8)  # below the targets, above the teacher
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def replot(run_dir) -> str | None:
    """Redraw ``recovery.png`` of a finished ``tcal recover`` directory from its JSON and curves."""
    from tcal.distill import read_curve

    run_dir = Path(run_dir)
    summary_path = run_dir / "recovery.json"
    if not summary_path.is_file():
        raise TcalError(f"{summary_path} not found: pass the output directory of a finished `tcal recover`")
    summary = json.loads(summary_path.read_text())
    curves = {init: read_curve(run_dir / init / "curve.csv") for init in summary["inits"]}
    keep = ",".join(str(i) for i in summary["keep"])
    return plot_recovery(curves, summary["teacher_ppl"], run_dir / "recovery.png", table=summary["table"],
                         title=f"{summary['teacher']}, attention kept at {keep}")


# ---------------------------------------------------------------------------------------------
# Conversion with init arguments
# ---------------------------------------------------------------------------------------------


def _init_kwargs(fn, calib_ids, align_steps: int, progress: bool) -> dict:
    params = inspect.signature(fn).parameters
    kw = {}
    if "calib_ids" in params:
        kw["calib_ids"] = calib_ids
    if "align" in params:
        from tcal.align import AlignConfig

        kw["align"] = AlignConfig(steps=align_steps)
    if "progress" in params:
        kw["progress"] = progress
    return kw


def convert_with(teacher, keep, init: str, *, seed: int, init_kwargs: dict, **gdn_options):
    """``tcal.convert`` with arguments for the init strategy; returns (hybrid, init record)."""
    import tcal

    hybrid = tcal.convert(teacher, keep=keep, init=init, seed=seed, **gdn_options, **init_kwargs)
    return hybrid, hybrid.tcal_record


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist() if obj.numel() <= 64 else f"tensor{tuple(obj.shape)}"
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------


def _distill_config(cfg: RecoverConfig, init: str, run_dir: Path) -> DistillConfig:
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainOptions)}
    return DistillConfig(**shared, hybrid=f"{cfg.teacher} keep={cfg.keep} init={init}", teacher=cfg.teacher,
                         data=str(cfg.data), tokens=cfg.tokens, out=str(run_dir))


def run_recover(cfg: RecoverConfig, *, callback=None) -> dict:
    """``tcal recover``: convert with each init, distil each the same way, tabulate tokens-to-target."""
    from tcal.cli import parse_keep, resolve_device, resolve_dtype
    from tcal.data import check_disjoint
    from tcal.distill import _check_config

    _check_config(cfg, cfg.tokens)
    inits = parse_inits(cfg.inits)
    keep = parse_keep(cfg.keep)
    if isinstance(keep, str):
        raise TcalError(f"--keep {cfg.keep!r} is not a list of layer indices like 0,4,8")
    check_disjoint(cfg.data, cfg.eval)
    check_disjoint(cfg.calib, cfg.eval, role="calibration")
    out = Path(cfg.out)
    work = partial_dir(out)
    if work.exists() and not cfg.resume:
        raise TcalError(f"{work} holds an interrupted recovery run; pass --resume to continue it, or delete it")
    if work.exists():
        saved_file = work / "recover_config.json"
        saved = json.loads(saved_file.read_text()) if saved_file.is_file() else {}
        # Unlike distill, a change of --compile is refused here too.
        diff = changed_settings(saved, dataclasses.asdict(cfg),
                                free={"resume", "max_minutes", "stop_after_tokens", "progress", "out", "device"})
        if saved and diff:
            raise TcalError(f"cannot resume {work}: settings changed ({', '.join(diff)}); use the same settings")
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / "recover_config.json", dataclasses.asdict(cfg))

    device = resolve_device(cfg.device)
    t0 = time.time()
    teacher, tokenizer = load_model_and_tokenizer(cfg.teacher, dtype=resolve_dtype(cfg.teacher_dtype), device=device)
    load_s = time.time() - t0
    train_tokens, data_info = load_token_stream(cfg.data, tokenizer)
    eval_ids, _ = eval_windows_for(cfg.eval, tokenizer, cfg.eval_window, cfg.eval_windows)

    # Teacher PPL once, same protocol as every curve point.
    tfile = work / "teacher_ppl.json"
    if tfile.is_file():
        teacher_ppl = json.loads(tfile.read_text())["ppl"]
    else:
        from tcal.evaluate import window_ppl

        teacher_ppl = window_ppl(teacher, eval_ids, batch_size=4, progress=cfg.progress, desc="teacher PPL")
        write_json(tfile, {"ppl": teacher_ppl, "eval": cfg.eval, "window": cfg.eval_window,
                           "windows": cfg.eval_windows})
    print(f"teacher {cfg.teacher}: PPL {teacher_ppl:.3f} on {cfg.eval} ({cfg.eval_windows} x {cfg.eval_window})")

    calib_ids = None
    reports, init_info = {}, {}
    # --max-minutes bounds this whole call (conversions included); each run gets what is left.
    deadline = t0 + cfg.max_minutes * 60 if cfg.max_minutes else None
    for init in inits:
        run_dir = work / init
        dcfg = _distill_config(cfg, init, run_dir)
        done = finished_report(run_dir)
        if done is not None and done.get("status") == "done" and not partial_dir(run_dir).exists():
            reports[init] = done
            init_info[init] = json.loads((work / f"{init}.init.json").read_text()) if (
                work / f"{init}.init.json").is_file() else {}
            print(f"{init}: finished earlier, final PPL {done['final_ppl']:.3f}")
            continue
        student, info = None, {}
        if deadline is not None and time.time() >= deadline:
            print(f"tcal recover: --max-minutes reached before run {init}; rerun with --resume ({work})",
                  file=sys.stderr)
            return {"status": "paused", "init": init, "work": str(work)}
        # The init's weights before training: a call killed between conversion and the first checkpoint
        # (a long calibration, then the first compiled step) does not calibrate again on resume.
        converted = work / f"{init}.converted"
        if not has_checkpoint(run_dir) and converted.is_dir() and (work / f"{init}.init.json").is_file():
            student = _load_model(converted)
            info = json.loads((work / f"{init}.init.json").read_text())
            print(f"{init}: converted earlier, loaded from {converted}")
        elif not has_checkpoint(run_dir):
            fn = init_function(init)
            needs_calib = "calib_ids" in inspect.signature(fn).parameters
            if needs_calib and calib_ids is None:
                calib_ids, _ = eval_windows_for(cfg.calib, tokenizer, cfg.calib_window, cfg.calib_windows)
            kw = _init_kwargs(fn, calib_ids if needs_calib else None, cfg.align_steps, cfg.progress)
            t1 = time.time()
            torch.manual_seed(cfg.seed)
            student, init_report = convert_with(
                teacher, keep, init, seed=cfg.seed, init_kwargs=kw,
                use_short_conv=cfg.use_short_conv, output_gate=cfg.output_gate,
            )
            info = {"init": init, "convert_s": time.time() - t1,
                    "calib": None if not needs_calib else {"data": cfg.calib, "window": cfg.calib_window,
                                                           "windows": cfg.calib_windows},
                    "init_report": _jsonable(init_report)}
            tmp = work / f"{init}.converted.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            _save_model(student, tmp)
            shutil.rmtree(converted, ignore_errors=True)
            tmp.rename(converted)
            write_json(work / f"{init}.init.json", info)  # last: it marks the saved conversion complete
            print(f"{init}: converted in {info['convert_s']:.1f} s")
        elif (work / f"{init}.init.json").is_file():
            info = json.loads((work / f"{init}.init.json").read_text())
        if deadline is not None:  # a positive remainder: at worst the run checkpoints right after step 0
            dcfg.max_minutes = max((deadline - time.time()) / 60, 1e-6)
        report = distill(student, teacher, dcfg, train_tokens=train_tokens, eval_ids=eval_ids, tokenizer=tokenizer,
                         teacher_ppl=teacher_ppl, data_info=data_info, extra_report={"init": init},
                         callback=callback)
        del student
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if report["status"] != "done":
            print(f"tcal recover: paused in run {init}; rerun with --resume to continue ({work})", file=sys.stderr)
            return {"status": "paused", "init": init, "work": str(work)}
        shutil.rmtree(converted, ignore_errors=True)  # the run's own output now holds the trained weights
        reports[init] = report
        init_info[init] = info
        print(f"{init}: PPL {report['zero_shot_ppl']:.2f} -> {report['final_ppl']:.2f} after {report['tokens']:,} "
              f"tokens ({report['train_tokens_per_s']:,.0f} tokens/s)")

    curves = {init: reports[init]["curve"] for init in inits}
    table = target_table(curves, teacher_ppl)
    summary = {
        "status": "done",
        "teacher": cfg.teacher,
        "teacher_ppl": teacher_ppl,
        "keep": keep,
        "inits": inits,
        "eval": {"data": cfg.eval, "window": cfg.eval_window, "windows": cfg.eval_windows},
        "data": data_info,
        "table": _jsonable(table),
        "runs": {init: {k: reports[init].get(k) for k in (
            "zero_shot_ppl", "final_ppl", "tokens", "steps", "epochs", "train_tokens_per_s", "train_s",
            "elapsed_s", "peak_memory", "device", "precision", "trainable_params")}
            | {"convert_s": init_info.get(init, {}).get("convert_s")} for init in inits},
        "teacher_load_s": load_s,
    }
    md = table_markdown(table)
    (work / "recovery.md").write_text(md)
    write_json(work / "recovery.json", summary)
    plot_recovery(curves, teacher_ppl, work / "recovery.png", table=table,
                  title=f"{cfg.teacher}, attention kept at {cfg.keep}")
    (work / "report.md").write_text(_report_markdown(cfg, summary, md))
    write_json(work / "tcal_config.json", {"stage": "recover", **dataclasses.asdict(cfg)})
    (work / "recover_config.json").unlink(missing_ok=True)
    (work / "teacher_ppl.json").unlink(missing_ok=True)
    publish_dir(work, out)
    print(md)
    print(f"wrote {out}")
    return summary


def _report_markdown(cfg: RecoverConfig, summary: dict, table_md: str) -> str:
    lines = [
        f"# Recovery: {cfg.teacher}, attention kept at {cfg.keep}",
        "",
        f"- inits: {', '.join(summary['inits'])} (same layers, data, data order (seed {cfg.seed}), schedule, budget)",
        f"- distillation: {cfg.tokens:,} tokens per init on {summary['data'].get('name', cfg.data)}, "
        f"{cfg.batch_size} x {cfg.seq_len} tokens per step, AdamW lr {cfg.lr}, {cfg.schedule} schedule, "
        f"KL(teacher || student) with CE weight {cfg.ce_weight}, training {cfg.train}",
        f"- evaluation: {cfg.eval}, first {cfg.eval_windows} windows of {cfg.eval_window} tokens; "
        f"teacher PPL {summary['teacher_ppl']:.3f}",
        f"- calibration (inits that need it): {cfg.calib}, {cfg.calib_windows} x {cfg.calib_window} tokens",
        "",
        "| init | PPL before | PPL after | tokens | train tokens/s | convert s | peak memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for init, r in summary["runs"].items():
        mem = (r.get("peak_memory") or {}).get("bytes")
        conv = r.get("convert_s")
        lines.append(
            f"| {init} | {r['zero_shot_ppl']:.2f} | {r['final_ppl']:.2f} | {r['tokens']:,} | "
            f"{r['train_tokens_per_s']:,.0f} | {'-' if conv is None else f'{conv:.1f}'} | "
            f"{'-' if mem is None else f'{mem / 2 ** 30:.2f} GiB'} |"
        )
    lines += ["", "## Tokens to reach each target", "", table_md,
              "Curves: recovery.png; per run: <init>/curve.csv.", ""]
    return "\n".join(lines)
