"""Plots of tcal's results, drawn with matplotlib's object-oriented API on an Agg canvas: nothing
here touches pyplot or switches the backend of a notebook that imports tcal."""
from __future__ import annotations

import math
import os

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from tcal.report.targets import curve_points
from tcal.train.curve import probe_fields
from tcal.utils.errors import TcalError


def fmt_ppl(x: float) -> str:
    """1,234 above a thousand, 12.3 below; nan/inf as they are."""
    if not math.isfinite(x):
        return str(x)
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _figure(figsize) -> Figure:
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _finish(fig: Figure, path, title: str = "", dpi: int = 110) -> str:
    """The title over all panels, a tight layout, the image written; returns the path."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return str(path)


def plot_curve(rows: list[dict], path, *, teacher_ppl: float | None = None, title: str = "",
               teacher_probes: dict | None = None, best_by: tuple[str, str] | None = None) -> str | None:
    """Eval PPL (log scale) and train loss against training tokens, and the probe scores (``--tasks``) when the rows
    hold any, each with the teacher's as a dashed line; returns the path or None. ``best_by``: (column, label) of the
    probe that picks the best checkpoint, a loss drawn beside the training loss."""
    # accuracies (passkey, pass@1) share a [0, 1] panel; the best checkpoint's loss goes beside the train loss
    best, best_label = best_by or (None, None)
    probes = [n for n in probe_fields(rows) if n != best]
    fig = _figure((16 if probes else 11, 4))
    axes = fig.subplots(1, 3 if probes else 2)
    a, b = axes[0], axes[1]
    x = [r["tokens"] for r in rows]
    a.plot(x, [r["eval_ppl"] for r in rows], "o-", ms=3, label="student")
    if teacher_ppl:
        a.axhline(teacher_ppl, color="k", ls="--", lw=1, label=f"teacher {teacher_ppl:.2f}")
    a.set_yscale("log")
    a.set_xlabel("training tokens")
    a.set_ylabel("held-out PPL")
    a.grid(True, which="both", alpha=0.3)
    a.legend()
    lr = [(r["tokens"], r["train_loss"]) for r in rows if not math.isnan(r["train_loss"])]
    if lr:
        b.plot(*zip(*lr), "o-", ms=3)
    b.set_xlabel("training tokens")
    b.set_ylabel("train loss (mean since previous eval)")
    b.grid(True, alpha=0.3)
    dev = [(r["tokens"], r[best]) for r in rows if best and isinstance(r.get(best), float)]
    if dev:
        b.plot(*zip(*dev), "s--", ms=3, color="C3", label=best_label)
        b.legend(fontsize=8)
    if probes:
        c = axes[2]
        for name in probes:
            pts = [(r["tokens"], r[name]) for r in rows if name in r]
            line, = c.plot(*zip(*pts), "o-", ms=3, label=name)
            if teacher_probes and name in teacher_probes:
                c.axhline(teacher_probes[name], color=line.get_color(), ls="--", lw=1)
        c.set_ylim(-0.03, 1.03)
        c.set_xlabel("training tokens")
        c.set_ylabel("accuracy (dashed: teacher)")
        c.grid(True, alpha=0.3)
        c.legend(fontsize=8)
    return _finish(fig, path, title)


def plot_scores(curves: dict, name: str, teacher_score: float, path, *, title: str = "", label: str | None = None) -> str:
    """One score (``humaneval`` pass@1) against distillation tokens, a line per init, the teacher's dashed with
    80 % and 90 % of it dotted."""
    fig = _figure((7, 4.2))
    ax = fig.subplots()
    for init, curve in curves.items():
        pts = sorted((r["tokens"] / 1e6, r[name]) for r in curve if isinstance(r.get(name), (int, float)))
        if pts:
            ax.plot(*zip(*pts), "o-", ms=4, label=init)
    ax.axhline(teacher_score, color="k", ls="--", lw=1, label=f"teacher {teacher_score:.3f}")
    for f in (0.8, 0.9):
        ax.axhline(f * teacher_score, color="gray", ls=":", lw=0.8)
        ax.annotate(f"{f:.0%} of the teacher", (1.0, f * teacher_score), xycoords=("axes fraction", "data"),
                    xytext=(-4, 2), textcoords="offset points", ha="right", va="bottom", fontsize=7, color="gray")
    ax.set_ylim(0, max(1e-3, teacher_score) * 1.15)
    ax.set_xlabel("distillation tokens (millions)")
    ax.set_ylabel(label or name)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, path, title)


def plot_calib_budget(series: dict, teacher: dict, path, *, title: str = "") -> str:
    """Zero-shot held-out PPL against calibration tokens, one panel per evaluation domain.

    ``series``: {method: [(tokens, {domain: ppl}), ...]}; ``teacher``: {domain: ppl}, drawn dashed."""
    domains = list(teacher) or sorted({d for pts in series.values() for _, ppl in pts for d in ppl})
    if not domains:
        raise TcalError("plot_calib_budget: no evaluation domain to draw")
    fig = _figure((4.6 * len(domains), 3.8))
    axes = fig.subplots(1, len(domains), squeeze=False)[0]
    for ax, dom in zip(axes, domains):
        for method, pts in series.items():
            xy = sorted((t, ppl[dom]) for t, ppl in pts if dom in ppl)
            if xy:
                ax.plot(*zip(*xy), "o-", ms=4, label=method)
        if dom in teacher:
            ax.axhline(teacher[dom], color="k", ls="--", lw=1, label=f"teacher {teacher[dom]:.2f}")
        ax.set_xscale("log")
        ax.set_xlabel("calibration tokens")
        ax.set_ylabel("zero-shot PPL")
        ax.set_title(dom)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _finish(fig, path, title)


def plot_recovery(curves: dict, teacher_ppl: float, path, *, table: dict | None = None, title: str = "") -> str | None:
    """Left: whole curves, log PPL. Right: linear zoom on the targets, each marked where a run first
    reaches it (a run that copy-init starts thousands of PPL above would flatten the targets otherwise)."""
    fig = _figure((13, 5))
    (full, zoom) = fig.subplots(1, 2)
    colors = {}
    for init, curve in curves.items():
        pts = curve_points(curve)
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
    return _finish(fig, path, title, dpi=120)


def plot_ablation(res: dict, path, baselines=()) -> None:
    """PPL / teacher PPL per init and held-out domain (log scale); baselines hatched, the others solid."""
    names = [r["init"] for r in res["rows"]]
    domains = res["evaluation"].get("domains") or [res["evaluation"]["data"]]
    teacher = res.get("teacher_ppl_by_domain") or {domains[0]: res["teacher_ppl"]}
    width = 0.8 / len(domains)
    fig = _figure((1.3 * len(names) + 2, 4.0))
    ax = fig.subplots()
    for j, d in enumerate(domains):
        vals = [(r.get("ppl_by_domain") or {domains[0]: r["ppl"]})[d] / teacher[d] for r in res["rows"]]
        xs = [i + (j - (len(domains) - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, vals, width, label=f"{d} (teacher {teacher[d]:.1f})", color=f"C{j}", edgecolor="white")
        for bar, name in zip(bars, names):
            if name in baselines:
                bar.set_hatch("//")
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("held-out PPL / teacher PPL")
    ax.set_title(f"{res['teacher']}: {res['converted_fraction']:.0%} of layers converted, zero-shot "
                 "(hatched: baselines)")
    ax.legend(fontsize=7)
    for label in ax.get_xticklabels():
        label.set_rotation(20)
        label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_selection(sel, path, teacher_ppl: float | None = None) -> None:
    fig = _figure((max(6, len(sel.scores) * 0.3), 3.5))
    ax = fig.subplots()
    colors = ["tab:red" if i in sel.layers else "tab:gray" for i in range(len(sel.scores))]
    ax.bar(range(len(sel.scores)), sel.scores, color=colors)
    if teacher_ppl:
        ax.axhline(teacher_ppl, color="k", lw=0.8, ls="--", label=f"teacher {teacher_ppl:.1f}")
        ax.legend()
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(sel.score_name.replace("_", " "))
    ax.set_title(f"{sel.policy}: kept layers in red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_stats(stats, path: str | os.PathLike) -> str:
    """Heat maps (layers x heads) of d_h (log colour scale) and both concentrations; writes ``path`` (png/pdf/svg)."""
    idx = sorted(stats)
    if not idx:
        raise TcalError("no layers in the statistics to plot")
    H = max(stats[i].num_heads for i in idx)
    nan = float("nan")

    def grid(name):
        return [list(getattr(stats[i], name) or [nan] * stats[i].num_heads) + [nan] * (H - stats[i].num_heads)
                for i in idx]

    panels = [
        ("distance", "mean attention distance d_h (tokens)", "viridis", True),
        ("distance_nosink", "d_h without the sink token (tokens)", "viridis", True),
        ("sink_mass", "attention on token 0 (sink)", "magma", False),
        ("concentration_minmax", "concentration c_h (min-max, reference)", "magma", False),
        ("concentration_absolute", "concentration c_h (absolute)", "magma", False),
    ]
    fig = _figure((4.2 * len(panels), 0.8 + 0.28 * len(idx) + 1.2))
    for k, (name, title, cmap, log) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        data = torch.tensor(grid(name)).numpy()
        norm = LogNorm(vmin=max(float(torch.tensor(grid(name)).nan_to_num(1e9).min()), 0.5)) if log else None
        im = ax.imshow(data, aspect="auto", cmap=cmap, norm=norm, vmin=None if log else 0.0, vmax=None if log else 1.0,
                       interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(idx)))
        ax.set_yticklabels([str(i) for i in idx], fontsize=6)
        ax.set_xticks(range(H))
        ax.set_xticklabels([str(h) for h in range(H)], fontsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return path




def context_label(n: int) -> str:
    """2048 -> "2K", 32768 -> "32K", 1000 -> "1000": how benchmark tables and plots name a context length."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_bench(rows: list[dict], path, *, title: str = "") -> str:
    """Two panels against context length (log scale): decode ms/token and prefill tokens/s, one line
    per benchmark row (``model`` name); cells with an error or without the number are left out."""
    fig = _figure((11, 4))
    decode, prefill = fig.subplots(1, 2)
    names = list(dict.fromkeys(r["model"] for r in rows))
    for i, name in enumerate(names):
        mine = sorted((r for r in rows if r["model"] == name and "error" not in r), key=lambda r: r["context"])
        for ax, key in ((decode, "decode_ms"), (prefill, "prefill_tok_s")):
            pts = [(r["context"], r[key]) for r in mine if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", ms=4, color=f"C{i}", label=name)
    contexts = sorted({r["context"] for r in rows})
    for ax, label in ((decode, "decode (ms / token, batch 1)"), (prefill, "prefill (tokens / s, batch 1)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [context_label(n) for n in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no measurements", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)
