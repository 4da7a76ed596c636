"""A distillation run's report: report.md (the run, its held-out PPL before and after, the curve tasks' scores
against the teacher's, throughput and memory) and every file of its output directory but the model
(:func:`run_files`)."""
from __future__ import annotations


def run_files(report: dict, cfg, *, title: str, tasks=()) -> dict:
    """The files of a finished distillation's directory besides the model (:func:`tcal.train.checkpoint.publish_run`
    writes them): curve.csv, curve.png, tcal_config.json, report.json, report.md. ``tasks``: what the curve points
    scored."""
    from tcal.report.plots import plot_curve
    from tcal.train.curve import curve_csv, timing_csv

    picks = next(((c, t.heading(c)) for t in tasks if t.picks_best for c in t.columns()), None)
    resolved = {"stage": "distill", **report["config"],
                "resolved": {k: report[k] for k in ("device", "precision", "total_steps", "tokens_per_step",
                                                    "warmup_steps", "train_windows")}}
    return {"curve.csv": curve_csv(report["curve"]), "timing.csv": timing_csv(report.get("timing") or []),
            "curve.png": lambda path: plot_curve(report["curve"], path, teacher_ppl=report["teacher_ppl"], title=title,
                                                 teacher_probes=report.get("teacher_probes"), best_by=picks),
            "tcal_config.json": resolved, "report.json": report, "report.md": distill_markdown(report, cfg, tasks)}


def human_bytes(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def probe_table(report: dict, tasks) -> list[str]:
    """The curve tasks' scores at every curve point against the teacher's, as markdown lines (none if off)."""
    names = list(report.get("teacher_probes") or {})
    if not names:
        return []
    teacher = report["teacher_probes"]
    lines = ["Probes at every curve point: " + "; ".join(t.describe() for t in tasks) + ":", "",
             "| training tokens | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
             "| teacher | " + " | ".join(f"{teacher[n]:.2f}" for n in names) + " |"]
    lines += [f"| {r['tokens']:,} | " + " | ".join(f"{r[n]:.2f}" if n in r else "-" for n in names) + " |"
              for r in report["curve"]]
    return lines + [""]


def timing_table(report: dict) -> list[str]:
    """Where the run's time went, as markdown lines: each curve point's seconds per probe and per write, the training
    between points, the first step (compiling) apart from the steady steps, the teacher's scores (none if unrecorded)."""
    rows = report.get("timing") or []
    lines = []
    speed = report.get("train_speed") or {}
    if speed.get("first_step_s"):
        steady = speed.get("steady_tokens_per_s")
        lines += [f"Training: first step of each session (compiling) {', '.join(f'{x:.1f}' for x in speed['first_step_s'])}"
                  f" s; steady {'n/a' if steady is None else f'{steady:,.0f}'} tokens/s over {speed['steady_steps']} "
                  f"steps ({speed['steady_s']:.1f} s).", ""]
    teacher = report.get("teacher_seconds") or {}
    if teacher:
        took = ", ".join(f"{k} {v:.1f} s" for k, v in teacher.items() if isinstance(v, (int, float))
                         and not isinstance(v, bool))
        lines += [f"Teacher's scores: {took or 'n/a'}" + (" (computed by an earlier call or run of this experiment, "
                  "read back here)" if teacher.get("read_back") else "") + ".", ""]
    if not rows:
        return lines
    keys: dict[str, None] = {}
    for r in rows:
        keys.update((k, None) for k in r if k not in ("tokens", "step"))
    cols = list(keys)
    lines += ["Seconds per curve point (timing.csv; `train`: training since the point before):", "",
              "| tokens | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
    lines += [f"| {r['tokens']:,} | " + " | ".join("-" if r.get(c) is None else f"{r[c]:,.1f}" for c in cols) + " |"
              for r in rows]
    return lines + [""]


def distill_markdown(report: dict, cfg, tasks=()) -> str:
    data = report.get("data") or {}
    n_data = data.get("tokens")
    data_line = f"- training data: {data.get('name', cfg.data)}"
    if isinstance(n_data, int):
        data_line += (f" ({n_data:,} tokens = {report['train_windows']:,} windows of {cfg.seq_len}; "
                      f"{report['epochs']:.2f} epochs used)")
    if cfg.recall_frac > 0:
        data_line += (f"; {cfg.recall_frac:.0%} of the sequences end with a copy of an earlier {cfg.recall_span}-token "
                      "span of themselves (recall mix)")
    teacher = report.get("teacher_ppl")
    tp = report.get("train_tokens_per_s")
    spread = ""
    if (report.get("world_size") or 1) > 1:
        placed = {"shard": "sharded", "replicate": "replicated"}.get(report.get("teacher_placement"), "?")
        spread = f"; {report['world_size']} processes (student sharded with FSDP2, teacher {placed})"
    lines = [
        f"# Distillation of {cfg.hybrid}",
        "",
        f"- teacher: {cfg.teacher}",
        data_line,
        f"- trained: {report['tokens']:,} tokens in {report['steps']:,} steps of {report['tokens_per_step']:,} "
        f"tokens ({cfg.batch_size} x {cfg.seq_len}); parameters: {cfg.train} ({report['trainable_params']:,})",
        f"- objective: (1 - {cfg.ce_weight}) KL(teacher || student) + {cfg.ce_weight} CE, chunks of {cfg.kl_chunk} "
        f"rows; AdamW lr {cfg.lr}, {cfg.schedule} schedule, {report['warmup_steps']} warm-up steps, "
        f"weight decay {cfg.weight_decay}, grad clip {cfg.grad_clip}",
        f"- evaluation: {cfg.eval}, first {report['eval']['windows']} windows of {report['eval']['window']} tokens",
        f"- device: {report['device']}, {report['precision']}{spread}",
        "",
        "| model | held-out PPL |",
        "|---|---|",
        f"| teacher | {teacher:.3f} |" if teacher else "| teacher | n/a |",
        f"| student before distillation | {report['zero_shot_ppl']:.3f} |",
        f"| student after {report['tokens']:,} tokens | {report['final_ppl']:.3f} |",
        "",
    ]
    lines += probe_table(report, tasks)
    if tp:
        lines.append(f"Throughput: {tp:,.0f} training tokens/s (training steps only; evaluation and checkpoints "
                     f"excluded). Wall time {report['elapsed_s']:.1f} s over {report['segments']} session(s).")
    lines += timing_table(report)
    lines += [
        f"Peak memory: {human_bytes(report['peak_memory']['bytes'])} ({report['peak_memory']['kind']}).",
        "",
        "Curve: curve.csv, curve.png; time per point: timing.csv.",
        "",
    ]
    return "\n".join(lines)
