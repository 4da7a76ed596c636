"""`tcal ablate`: every initialisation strategy on identical layers and data, one table.

Calibration tokens come from the calibration split (the teacher's default, e.g. ``wiki:calib+shakespeare:calib``);
perplexity from the evaluation splits (the teacher's default domains); the two are disjoint and the report says
which is which. ``--tasks`` also scores the teacher and each init on evaluation tasks (``humaneval:20``: HumanEval
pass@1, generated code run under its tests; ``single@1024``: retrieval), a column each. The teacher's activations and
statistics are taken once (:func:`tcal.taylor.pipeline.prepare`) and shared by every calibrated init.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from tcal.conversion.policy import KEEP_HELP
from tcal.evaluate.plan import ADDS, SIZES, Command, OldFlag
from tcal.evaluate.tasks import task_args
from tcal.taylor.budget import CalibArgs
from tcal.utils.command_config import DeviceArgs, EvalArgs, OutArgs, TeacherArgs, arg

log = logging.getLogger("tcal")

BASELINES = ("copy", "zero-gate", "phase1", "phase2", "taylor-reference")
OURS = "taylor"
CPU_ALIGN_STEPS = 60
CPU_KL_STEPS = 10
EVAL_WINDOWS = 8
# A window's LM head and loss grow with the vocabulary: past this size (Gemma 3: 262,144, 5x SmolLM2's) the CPU
# default scores 3 windows per domain, to keep the default run within its 15 minutes on 2 cores.
LARGE_VOCAB = 131_072
LARGE_VOCAB_CPU_WINDOWS = 3


def default_eval_windows(device: str, vocab_size: int) -> int:
    """Evaluation windows per domain when --eval-windows is not given."""
    return LARGE_VOCAB_CPU_WINDOWS if device == "cpu" and vocab_size > LARGE_VOCAB else EVAL_WINDOWS


@dataclass
class AblateConfig(task_args(for_eval=False), TeacherArgs, CalibArgs, EvalArgs, OutArgs, DeviceArgs):
    keep: str = arg("auto", KEEP_HELP)
    inits: str = arg(",".join((*BASELINES, OURS)), "comma-separated strategies; the five baselines always belong in")
    align_steps: int | None = arg(None, "Phase 2 AdamW steps per layer (default: 60 on CPU, sized for a default "
                                        "run of about 15 minutes on 2 CPU cores; the budget's 300 on a GPU)")
    kl_steps: int | None = arg(None, "KL-stage steps (taylor; default: 10 on CPU, for the same reason; the "
                                     "budget's 100 on a GPU)")
    eval: str = arg("auto", "held-out evaluation domains, comma-separated (each is reported on its own; none may "
                            "overlap --calib); auto: the teacher's, wiki:eval,shakespeare:eval,sotu:eval, and "
                            "code:eval,wiki:eval for the code teachers")
    eval_windows: int | None = arg(None, "evaluation windows per domain (the first N, non-overlapping; 64 is the full "
                                         "protocol; default 8, and 3 on CPU for a vocabulary over 128K tokens, such "
                                         "as Gemma 3's, whose LM head makes each window dearer: both sized for a "
                                         "default run of about 15 minutes on 2 CPU cores, docs/results.md)")
    # the old spellings of --tasks, each mapped onto it (OLD_FLAGS)
    humaneval: bool = arg(False, "deprecated, use --tasks humaneval: HumanEval pass@1 of the teacher and each init")
    humaneval_limit: int | None = arg(None, "deprecated, use --tasks humaneval:N: the first N problems only")
    out: str = arg("runs/ablate", "output directory (written atomically)")
    seed: int = arg(0, "seed of the random parts of every init")
    progress: bool = arg(True, "progress bars")


# the old spellings of --tasks: what each stands for (tcal.evaluate.plan.fold)
OLD_FLAGS = (OldFlag("humaneval", ADDS, "humaneval"), OldFlag("humaneval_limit", SIZES, "humaneval", "count"))
ABLATE = Command("tcal ablate", teacher=True, old=OLD_FLAGS)


def _check(cfg: AblateConfig):
    """Every argument, before the teacher loads: (output directory, init names, the tasks that score the teacher and
    every init; their inputs read)."""
    from tcal.conversion.inits import init_readers, parse_inits
    from tcal.conversion.policy import parse_keep, parse_policy
    from tcal.conversion.resolve import resolve_teacher_args
    from tcal.data.corpora import as_corpus, check_disjoint
    from tcal.data.overlap import check_no_eval_text
    from tcal.data.tokens import mixture_parts
    from tcal.evaluate.plan import held_out, plan
    from tcal.utils.atomic import check_out
    from tcal.utils.flags import as_given
    from tcal.utils.runtime import resolve_device

    given, inits, found = as_given(cfg), parse_inits(cfg.inits), {}

    def readers(built):
        """Who reads the init flags, once the tasks passed the code-execution gate and the teacher's ``auto`` flags
        are resolved (the KL data is the teacher's)."""
        resolve_teacher_args(cfg, every_eval=True)
        found["out"] = check_out(cfg.out, "ablate", cfg.overwrite)
        recall = cfg.recall_on(resolve_device(cfg.device))
        return init_readers(inits, recall=recall, chat=cfg.chat_kl() and not recall)

    # HumanEval's problems are fetched and checked here, before the teacher loads
    tasks = plan(cfg, ABLATE, given=given, readers=readers, where=f"tcal ablate --inits {','.join(inits)}",
                 progress=cfg.progress)
    out = found["out"]
    parse_policy(parse_keep(cfg.keep), num_layers=None)
    cfg.check_calib()
    cfg.check_eval()
    check_disjoint(cfg.calib, cfg.eval, role="calibration")
    for spec in mixture_parts(cfg.calib):
        as_corpus(spec)
    held_out(cfg.eval_list(), cfg.eval_window, 1).check()
    check_no_eval_text(cfg.calib, cfg.eval_list() + [t for task in tasks for t in task.texts()],
                       role="calibration data")
    return out, inits, tasks


def run(cfg: AblateConfig) -> dict:
    from tcal.conversion.convert import calibration_ids, convert_with_record, kl_text
    from tcal.conversion.inits import get_init
    from tcal.conversion.policy import parse_keep
    from tcal.conversion.select import SelectionConfig, select_layers
    from tcal.data.teachers import load_teacher
    from tcal.evaluate.plan import held_out
    from tcal.evaluate.tasks import settings
    from tcal.report.plots import plot_ablation
    from tcal.taylor.pipeline import prepare
    from tcal.utils.atomic import atomic_dir, write_json, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_device

    out, inits, tasks = _check(cfg)
    device = resolve_device(cfg.device)
    budget = cfg.budget(device)
    align, kl = budget.align, budget.kl
    if device == "cpu":  # sized for a default run of about 15 minutes on 2 CPU cores (docs/results.md)
        align = dataclasses.replace(align, steps=CPU_ALIGN_STEPS if cfg.align_steps is None else cfg.align_steps)
        kl = dataclasses.replace(kl, steps=CPU_KL_STEPS if cfg.kl_steps is None else cfg.kl_steps)
    t_start = time.perf_counter()
    teacher, tok = load_teacher(cfg.teacher, device=device)
    if tok is None:
        raise TcalError(f"teacher {cfg.teacher} has no tokenizer; ablate needs one to read the corpora")
    L = teacher.config.num_hidden_layers
    sel = select_layers(teacher, parse_keep(cfg.keep), tokenizer=tok, cfg=SelectionConfig(data=cfg.calib),
                        progress=cfg.progress)
    keep = sel.layers
    gdn_layers = [i for i in range(L) if i not in keep]
    domains = cfg.eval_list()
    n_eval = (default_eval_windows(device, teacher.config.vocab_size) if cfg.eval_windows is None
              else cfg.eval_windows)
    ppl = held_out(domains, cfg.eval_window, n_eval, progress=cfg.progress)
    ppl.prepare(teacher, tok)
    for d in domains:
        ppl.windows(d)  # every domain cut before any model is scored

    for t in tasks:
        t.prepare(teacher, tok, teacher=teacher)

    def scores(model) -> dict:
        """Every task's record of ``model``, and its columns' scores."""
        records = {t.name: t.measure(model) for t in tasks}
        return {"records": records, "scores": {c: v for t in tasks for c, v in t.values(records[t.name]).items()}}

    teacher_eval = ppl.measure(teacher)
    teacher_tasks = scores(teacher)
    log.info("teacher PPL %s (%d x %d each)", teacher_eval["ppl_by_domain"], n_eval, cfg.eval_window)
    calibration, stats_s, kl_data = None, 0.0, None
    kl_opts = cfg.kl_options(budget)
    if kl_opts and any(get_init(i).kl for i in inits):  # one set of chat windows for every init with a KL stage
        kl_data = kl_text(kl_opts["kl_data"], tok, window=kl_opts["kl_windows"][1], windows=kl_opts["kl_windows"][0])
    if any(get_init(i).calibrated for i in inits):
        t0 = time.perf_counter()
        ids = calibration_ids(cfg.calib, tok, budget.window, budget.windows)
        calibration = prepare(teacher, ids, gdn_layers, heldout_frac=align.heldout_frac,
                              max_heldout=align.heldout_max_sequences, progress=cfg.progress)
        stats_s = time.perf_counter() - t0

    rows = []
    for init in inits:
        log.info("init %s", init)
        spec = get_init(init)
        options = {"calib_ids": calibration, "align": align, "progress": cfg.progress} if spec.calibrated else {}
        if spec.kl:
            options["kl"] = kl
            if kl_data is not None:
                options["kl_data"] = kl_data
        t0 = time.perf_counter()
        conv = convert_with_record(teacher, keep, init, seed=cfg.seed, share_weights=True, **options)
        convert_s = time.perf_counter() - t0
        res = ppl.measure(conv.hybrid)
        task_res = scores(conv.hybrid)
        detail = conv.record.get("detail", {})
        rows.append({
            "init": init, "ppl": res["ppl"], "ppl_by_domain": res["ppl_by_domain"], "convert_s": convert_s,
            "per_layer_s": convert_s / len(gdn_layers), "phase_seconds": _phase_seconds(detail),
            "heldout_fit": _heldout_fit(detail), **task_res["records"],
            **({"scores": task_res["scores"]} if tasks else {}),
        })
        log.info("  %s: PPL %.2f (convert %.1f s)", init, res["ppl"], convert_s)
        del conv
    copy_ppl = next((r["ppl"] for r in rows if r["init"] == "copy"), None)
    for r in rows:
        r["copy_over_init"] = copy_ppl / r["ppl"] if copy_ppl else None
    result = {
        "teacher": cfg.teacher, "teacher_ppl": teacher_eval["ppl"],
        "teacher_ppl_by_domain": teacher_eval["ppl_by_domain"],
        **{f"teacher_{name}": record for name, record in teacher_tasks["records"].items()},
        **({"tasks": [{"name": t.name, "title": t.label, "describe": t.describe(),
                       "headings": {c: t.heading(c) for c in t.columns()}} for t in tasks],
            "teacher_scores": teacher_tasks["scores"]} if tasks else {}),
        "keep": keep, "gdn_layers": gdn_layers,
        "converted_fraction": len(gdn_layers) / L, "selection": sel.policy,
        "kl_data": kl_data.record() if kl_data is not None else "the calibration windows",
        "calibration": {"data": cfg.calib, "windows": budget.windows, "window": budget.window, "budget": budget.name,
                        "align": dataclasses.asdict(align), "kl": dataclasses.asdict(kl),
                        **(calibration.record() if calibration is not None else {}),
                        "role": "teacher statistics, Phase 1 and Phase 2 training on the first 75% of the "
                                "sequences; the last 25% only pick Phase 2's best state"},
        "evaluation": {"data": cfg.eval, "domains": domains, "windows": n_eval, "window": cfg.eval_window,
                       "role": "held-out perplexity only, each domain on its own; disjoint from the calibration text"},
        "stats_s": stats_s, "stats_per_layer_s": stats_s / len(gdn_layers), "device": device,
        "rows": rows, "total_s": time.perf_counter() - t_start,
    }
    with atomic_dir(out) as tmp:
        write_json(tmp / "ablation.json", result)
        (tmp / "ablation.md").write_text(ablation_markdown(result))
        plot_ablation(result, tmp / "ablation.png", baselines=BASELINES)
        if calibration is not None:
            write_json(tmp / "teacher_stats.json", calibration.stats.to_dict())
        write_json(tmp / "tcal_config.json", {"stage": "ablate", **settings(cfg)})
    print(ablation_markdown(result))
    print(f"wrote {cfg.out} ({result['total_s']:.0f} s): {', '.join(written_files(out))}")
    return result


def _phase_seconds(detail: dict) -> dict:
    """Sum of per-layer wall times each phase recorded."""
    out = {}
    for phase in ("phase1", "phase2"):
        recs = detail.get(phase) or {}
        secs = [r.get("wall_s") for r in recs.values() if isinstance(r, dict)]
        secs = [s for s in secs if isinstance(s, (int, float))]
        if secs:
            out[phase] = sum(secs)
    if isinstance((detail.get("kl") or {}).get("wall_s"), (int, float)):
        out["kl"] = detail["kl"]["wall_s"]
    return out


def _heldout_fit(detail: dict) -> float | None:
    """Mean held-out cosine of the layer outputs after Phase 2 (if the strategy ran Phase 2)."""
    recs = detail.get("phase2") or {}
    vals = [r.get("heldout_cos") for r in recs.values() if isinstance(r, dict)]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def ablation_markdown(res: dict) -> str:
    from tcal.report.plots import fmt_ppl

    frac = res["converted_fraction"]
    cal, ev = res["calibration"], res["evaluation"]
    domains = ev.get("domains") or [ev["data"]]
    teacher = res.get("teacher_ppl_by_domain") or {domains[0]: res["teacher_ppl"]}
    lines = [
        f"## Ablation: {res['teacher']}, {len(res['gdn_layers'])}/{len(res['gdn_layers']) + len(res['keep'])} "
        f"layers converted ({frac:.0%}), attention kept at {res['keep']}",
        "",
        f"- calibration: `{cal['data']}`, {cal['windows']} x {cal['window']} tokens ({cal['role']})",
        f"- evaluation: {', '.join(f'`{d}`' for d in domains)}, first {ev['windows']} x {ev['window']} tokens of "
        f"each ({ev['role']})",
        f"- teacher PPL {', '.join(f'{teacher[d]:.2f} ({d})' for d in domains)}; capture + statistics "
        f"{res['stats_s']:.1f} s ({res['stats_per_layer_s']:.2f} s/layer) on {res['device']}",
    ]
    tasks = res.get("tasks") or []  # the evaluation tasks, a column each
    headings = {c: h for t in tasks for c, h in t["headings"].items()}
    for t in tasks:
        secs = res[f"teacher_{t['name']}"]["seconds"] + sum(r[t["name"]]["seconds"] for r in res["rows"])
        cols = list(t["headings"])
        got = (f"{res['teacher_scores'][cols[0]]:.3f}" if len(cols) == 1 else
               ", ".join(f"{res['teacher_scores'][c]:.3f} ({c})" for c in cols))
        lines.append(f"- {t['describe']}: teacher {got}; {secs:.0f} s of the run's {res['total_s']:.0f} s went "
                     f"to {t['title']}")
    lines += [
        "",
        "| init | " + " | ".join(f"{d} PPL | x teacher" for d in domains) + "".join(f" | {h}" for h in headings.values())
        + " | copy / init | held-out cos (Phase 2) | phase 1 s/layer | phase 2 s/layer | KL stage s | convert s |",
        "|---|" + "---:|---:|" * len(domains) + "---:|" * len(headings) + "---:|---:|---:|---:|---:|---:|",
    ]
    n = len(res["gdn_layers"])
    for r in res["rows"]:
        ps = r["phase_seconds"]
        by = r.get("ppl_by_domain") or {domains[0]: r["ppl"]}
        cos = f"{r['heldout_fit']:.3f}" if r["heldout_fit"] is not None else "-"
        cells = " | ".join(f"{fmt_ppl(by[d])} | {by[d] / teacher[d]:.2f}" for d in domains)
        cells += "".join(f" | {r['scores'][c]:.3f}" for c in headings)
        over = f"{r['copy_over_init']:.1f}x" if r["copy_over_init"] is not None else "-"  # without a copy row
        lines.append(
            f"| {r['init']} | {cells} | {over} | {cos} | {_fmt_s(ps.get('phase1'), n)} | "
            f"{_fmt_s(ps.get('phase2'), n)} | {_fmt_s(ps.get('kl'), 1)} | {r['convert_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _fmt_s(total, n) -> str:
    return f"{total / n:.2f}" if total is not None else "-"
