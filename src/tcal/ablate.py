"""`tcal ablate`: every initialisation strategy on identical layers and data, one table.

Calibration tokens come from the calibration split (default ``wiki:calib``); perplexity from the
evaluation split (default ``wiki:eval``); the two are disjoint by construction and the report
says which is which. Teacher statistics are collected once and shared by every calibrated init.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from tcal.config import arg
from tcal.errors import TcalError

log = logging.getLogger(__name__)

BASELINES = "copy,zero-gate,phase1,phase2,taylor"
OURS = "taylor-exact-silent"


@dataclass
class AblateConfig:
    teacher: str = arg("smollm2-135m", "teacher: built-in name, local HF directory, .gguf file or hub id")
    keep: str = arg("uniform:50%", "layers kept as attention: list (0,4,8) or policy (uniform:K, ar:K, ga:K, K%)")
    inits: str = arg(f"{BASELINES},{OURS}", "comma-separated strategies; the five baselines always belong in")
    calib: str = arg("wiki:calib", "calibration corpus (disjoint from --eval)")
    calib_window: int = arg(256, "calibration sequence length (reference: 256)")
    calib_windows: int = arg(4, "calibration sequences (reference: 4); Phase 2 holds out the last quarter")
    align_steps: int = arg(150, "Phase 2 AdamW steps per layer (reference: 300; 150 keeps the default run under 15 min on 2 CPU cores)")
    eval: str = arg("wiki:eval", "held-out evaluation corpus")
    eval_window: int = arg(512, "evaluation window in tokens")
    eval_windows: int = arg(16, "evaluation windows (the first N, non-overlapping; 64 is the full protocol)")
    out: str = arg("runs/ablate", "output directory (written atomically)")
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")
    seed: int = arg(0, "seed of the random parts of every init")
    progress: bool = arg(True, "progress bars")


def run_ablate(cfg: AblateConfig) -> dict:
    import tcal
    from tcal.atomic import atomic_dir, write_json
    from tcal.cli import resolve_device
    from tcal.convert import UNCALIBRATED, calibration_ids, parse_inits
    from tcal.data import check_disjoint, token_windows
    from tcal.evaluate import perplexity_report
    from tcal.select import SelectionConfig, select_layers
    from tcal.stats import collect_stats, save_stats
    from tcal.teachers import load_teacher

    check_disjoint(cfg.calib, cfg.eval, role="calibration")
    inits = parse_inits(cfg.inits)
    device = resolve_device(cfg.device)
    t_start = time.perf_counter()
    teacher, tok = load_teacher(cfg.teacher, device=device)
    if tok is None:
        raise TcalError(f"teacher {cfg.teacher} has no tokenizer; ablate needs one to read the corpora")
    L = teacher.config.num_hidden_layers
    sel = select_layers(teacher, cfg.keep, tokenizer=tok, cfg=SelectionConfig(data=cfg.calib),
                        progress=cfg.progress)
    keep = sel.layers
    gdn_layers = [i for i in range(L) if i not in keep]
    calib_ids = calibration_ids(cfg.calib, tok, cfg.calib_window, cfg.calib_windows)
    eval_ids = token_windows(cfg.eval, tok, window=cfg.eval_window, n_windows=cfg.eval_windows)

    def ppl(model) -> dict:
        r = perplexity_report(model, tok, eval_ids, progress=False)  # window sizes come from eval_ids
        return {"ppl": r["ppl"], "seconds": r["seconds"]}

    teacher_eval = ppl(teacher)
    log.info("teacher PPL %.3f on %s (%d x %d)", teacher_eval["ppl"], cfg.eval, cfg.eval_windows, cfg.eval_window)
    t0 = time.perf_counter()
    stats = collect_stats(teacher, calib_ids, gdn_layers, progress=cfg.progress)
    stats_s = time.perf_counter() - t0

    from tcal.align import AlignConfig
    rows = []
    for init in inits:
        log.info("init %s", init)
        options = {} if init in UNCALIBRATED else {
            "calib_ids": calib_ids, "stats": stats, "align": AlignConfig(steps=cfg.align_steps),
            "progress": cfg.progress}
        t0 = time.perf_counter()
        hybrid = tcal.convert(teacher, keep=keep, init=init, seed=cfg.seed, **options)
        convert_s = time.perf_counter() - t0
        res = ppl(hybrid)
        detail = hybrid.tcal_record.get("detail", {})
        rows.append({
            "init": init, "ppl": res["ppl"], "convert_s": convert_s,
            "per_layer_s": convert_s / len(gdn_layers), "phase_seconds": _phase_seconds(detail),
            "heldout_fit": _heldout_fit(detail),
        })
        log.info("  %s: PPL %.2f (convert %.1f s)", init, res["ppl"], convert_s)
        del hybrid
    copy_ppl = next((r["ppl"] for r in rows if r["init"] == "copy"), None)
    for r in rows:
        r["copy_over_init"] = copy_ppl / r["ppl"] if copy_ppl else None
    result = {
        "teacher": cfg.teacher, "teacher_ppl": teacher_eval["ppl"], "keep": keep, "gdn_layers": gdn_layers,
        "converted_fraction": len(gdn_layers) / L, "selection": sel.policy,
        "calibration": {"data": cfg.calib, "windows": cfg.calib_windows, "window": cfg.calib_window,
                        "role": "teacher statistics, Phase 1 and Phase 2 (last 25% of sequences pick Phase 2's best state)"},
        "evaluation": {"data": cfg.eval, "windows": cfg.eval_windows, "window": cfg.eval_window,
                       "role": "held-out perplexity only; disjoint from the calibration split"},
        "stats_s": stats_s, "stats_per_layer_s": stats_s / len(gdn_layers), "device": device,
        "rows": rows, "total_s": time.perf_counter() - t_start,
    }
    with atomic_dir(cfg.out) as tmp:
        write_json(tmp / "ablation.json", result)
        (tmp / "ablation.md").write_text(ablation_markdown(result))
        plot_ablation(result, tmp / "ablation.png")
        save_stats(stats, tmp / "teacher_stats.json")
        write_json(tmp / "tcal_config.json", {"stage": "ablate", **dataclasses.asdict(cfg)})
    print(ablation_markdown(result))
    print(f"wrote {cfg.out} ({result['total_s']:.0f} s)")
    return result


def _phase_seconds(detail: dict) -> dict:
    """Sum of per-layer wall times each phase recorded (keys vary by strategy)."""
    out = {}
    for phase in ("phase1", "phase2"):
        recs = detail.get(phase) or {}
        secs = [r.get("seconds", r.get("wall_s")) for r in recs.values() if isinstance(r, dict)]
        secs = [s for s in secs if isinstance(s, (int, float))]
        if secs:
            out[phase] = sum(secs)
    return out


def _heldout_fit(detail: dict) -> float | None:
    """Mean held-out cosine of the layer outputs after Phase 2 (if the strategy ran Phase 2)."""
    recs = detail.get("phase2") or {}
    vals = [r.get("heldout_cos") for r in recs.values() if isinstance(r, dict)]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def ablation_markdown(res: dict) -> str:
    frac = res["converted_fraction"]
    lines = [
        f"## Ablation: {res['teacher']}, {len(res['gdn_layers'])}/{len(res['gdn_layers']) + len(res['keep'])} "
        f"layers converted ({frac:.0%}), attention kept at {res['keep']}",
        "",
        f"- calibration: `{res['calibration']['data']}`, {res['calibration']['windows']} x "
        f"{res['calibration']['window']} tokens ({res['calibration']['role']})",
        f"- evaluation: `{res['evaluation']['data']}`, first {res['evaluation']['windows']} x "
        f"{res['evaluation']['window']} tokens ({res['evaluation']['role']})",
        f"- teacher PPL {res['teacher_ppl']:.2f}; statistics {res['stats_s']:.1f} s "
        f"({res['stats_per_layer_s']:.2f} s/layer) on {res['device']}",
        "",
        "| init | held-out PPL | copy / init | x teacher | held-out cos (Phase 2) | phase 1 s/layer | phase 2 s/layer | convert s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n = len(res["gdn_layers"])
    for r in res["rows"]:
        ps = r["phase_seconds"]
        cos = f"{r['heldout_fit']:.3f}" if r["heldout_fit"] is not None else "-"
        lines.append(
            f"| {r['init']} | {_fmt(r['ppl'])} | {r['copy_over_init']:.1f}x | {r['ppl'] / res['teacher_ppl']:.1f} | "
            f"{cos} | {_fmt_s(ps.get('phase1'), n)} | {_fmt_s(ps.get('phase2'), n)} | {r['convert_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _fmt_s(total, n) -> str:
    return f"{total / n:.2f}" if total is not None else "-"


def plot_ablation(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["init"] for r in res["rows"]]
    vals = [r["ppl"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.8))
    ax.bar(names, vals, color=["tab:gray" if n in BASELINES.split(",") else "tab:blue" for n in names])
    ax.axhline(res["teacher_ppl"], color="k", ls="--", lw=0.8, label=f"teacher {res['teacher_ppl']:.1f}")
    ax.set_yscale("log")
    ax.set_ylabel(f"held-out PPL ({res['evaluation']['data']})")
    ax.set_title(f"{res['teacher']}: {res['converted_fraction']:.0%} of layers converted, zero-shot")
    for i, v in enumerate(vals):
        ax.text(i, v, _fmt(v), ha="center", va="bottom", fontsize=8)
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

