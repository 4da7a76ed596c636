"""`tcal recover`: how many distillation tokens each initialisation needs.

For each init (``copy``, ``taylor``, ...): convert the teacher with the same kept layers and
seed, then distil with the same data, data order, schedule and token budget. The teacher's
held-out PPL is computed once with the same evaluation protocol as the curves. Outputs
(``OUT/``, written by renaming ``OUT.partial/`` once every run is finished)::

    <init>/               each distillation run (final model, curve.csv, curve.png, report.*)
    recovery.png          all curves, held-out PPL vs training tokens
    recovery.md / .json   tokens to reach 1.1x / 1.2x / 1.5x / 2x teacher PPL and the copy
                          run's final PPL, per init, and the ratio copy / init per target
    report.md, tcal_config.json
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tcal.evaluate.tasks import settings as as_record
from tcal.taylor.budget import CalibArgs
from tcal.train.options import SCHEDULES, DistillConfig, TrainOptions
from tcal.utils.command_config import GDNArgs, OutArgs, TeacherArgs, arg

# Settings a resumed recovery may change. Unlike distill, a change of --compile is refused here too.
RESUME_FREE = {"resume", "max_minutes", "stop_after_tokens", "progress", "out", "device", "teacher_placement",
               "dist_timeout"}


@dataclass
class RecoverConfig(TrainOptions, TeacherArgs, CalibArgs, GDNArgs, OutArgs):
    keep: str = arg("0,4,8,12,16,20,24,28", "layers kept as softmax attention: a list like 0,4,8")
    inits: str = arg("copy,taylor", "initialisations to compare, comma-separated (copy is the baseline)")
    data: str = arg("", "training tokens: a token pool directory (tcal pool), a .npy file or a corpus spec")
    tokens: int = arg(20_000_000, "training-token budget of every run (rounded up to whole steps)")
    out: str = arg("runs/recover", "output directory (written atomically; progress in OUT.partial/)")
    calib_window: int = arg(512, "calibration sequence length in tokens (a distillation run is GPU work; "
                                 "it affords 16x the reference's calibration tokens); recover's own, whatever "
                                 "--calib-budget says: the long budget's are --calib-window 4096 --calib-windows 64")
    calib_windows: int = arg(32, "number of calibration sequences (the first N windows)")
    # Constant after warm-up: the curve up to t tokens does not depend on the budget, so the
    # tokens-to-target numbers are a property of the init, not of --tokens.
    schedule: str = arg("constant", "learning-rate schedule after the warm-up", choices=SCHEDULES)
    eval_every: int = arg(500_000, "evaluate every N training tokens (and at 0 tokens and at the end)")
    eval_early: int = arg(6, "extra early evaluations at eval-every/2, /4, ... (this many)")
    keep_init: bool = arg(False, "also keep each init's weights before training as OUT/<init>-init (a loadable "
                                 "hybrid with its tokenizer), for zero-shot evaluation beside the trained one")


def _distill_config(cfg: RecoverConfig, init: str, run_dir: Path) -> DistillConfig:
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainOptions)}
    # The teacher stays whole: the next init calibrates with it, and calibration calls it a different
    # number of times on each rank (layer-parallel Phase 2, the KL stage on rank 0), which a sharded
    # teacher (a collective in every forward) cannot do.
    shared["teacher_placement"] = "replicate"
    return DistillConfig(**shared, hybrid=f"{cfg.teacher} keep={cfg.keep} init={init}", teacher=cfg.teacher,
                         data=str(cfg.data), tokens=cfg.tokens, out=str(run_dir))


def _start(cfg: RecoverConfig, world, tasks, given):
    """Check every argument, then open (or reopen, with --resume) the partial directory (rank 0)."""
    from tcal.conversion.inits import get_init, init_readers, parse_inits
    from tcal.conversion.policy import parse_keep, parse_policy
    from tcal.data.corpora import check_disjoint
    from tcal.data.overlap import check_no_eval_text
    from tcal.evaluate.plan import run_words
    from tcal.train import distributed as D
    from tcal.train.data import check_training_data
    from tcal.train.options import CURVE
    from tcal.utils.atomic import check_out
    from tcal.utils.errors import TcalError
    from tcal.utils.flags import refuse_unread

    # check_train_options ran in run(), before the process group was joined
    D.check_batch_split(cfg.batch_size, cfg.micro_batch, world.world_size)
    if cfg.teacher_placement == "shard":
        raise TcalError("tcal recover keeps the teacher on every rank (it calibrates with it between runs); "
                        "drop --teacher-placement shard, or convert with tcal convert and run tcal distill")
    from tcal.conversion.resolve import resolve_teacher_args

    resolve_teacher_args(cfg)
    out = check_out(cfg.out, "recover", cfg.overwrite)
    inits = parse_inits(cfg.inits)
    keep = parse_keep(cfg.keep)
    if isinstance(keep, str):
        raise TcalError(f"--keep {cfg.keep!r}: tcal recover takes the kept layers as a list like 0,4,8 (every init "
                        "converts the same ones); a policy picks them per teacher: see which with tcal convert --keep "
                        f"{cfg.keep} and list them")
    parse_policy(keep, num_layers=None)
    if not str(cfg.data).strip():
        raise TcalError("no training data given; pass --data POOL_DIR (tcal pool), a .npy token file or a corpus spec")
    recall = cfg.recall_on(world.device)
    refuse_unread(given, init_readers(inits, recall=recall, chat=cfg.chat_kl() and not recall),
                  run_words(CURVE, tasks, f"tcal recover --inits {','.join(inits)}"))
    if any(get_init(i).calibrated for i in inits):
        cfg.check_calib()
    check_training_data(cfg, [text for t in tasks for text in t.texts()])  # a pool or an instruct set: token ids
    check_disjoint(cfg.calib, cfg.eval, role="calibration")
    if any(get_init(i).calibrated for i in inits):
        check_no_eval_text(cfg.calib, [cfg.eval], role="calibration data")
    work = D.on_main(world, lambda: _open_work(cfg, out))
    return inits, keep, work


def _open_work(cfg: RecoverConfig, out: Path):
    """The recovery's unfinished work in OUT.partial (:func:`tcal.utils.partial.open_work`): resumed with
    --resume and the same settings, started over where it holds nothing to resume, refused where tcal did not
    write it."""
    from tcal.train.options import changed_settings
    from tcal.utils.partial import open_work, read_settings

    return open_work(out, "recover", settings=read_settings(as_record(cfg)), resume=cfg.resume,
                     progress=lambda w: has_progress(w.path),
                     changed=lambda saved, now: changed_settings(saved, now, free=RESUME_FREE), legacy=legacy_work)


def legacy_work(work: Path):
    """(the files, the settings) of a recovery's partial folder from a tcal that did not mark it: known by its
    recover_config.json; else None."""
    from tcal.utils.atomic import tree_files

    try:
        settings = json.loads((work / "recover_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict):
        return None
    files = [p.name for p in work.iterdir() if p.is_file() and (p.name in ("recover_config.json", "teacher_ppl.json",
                                                                            "teacher_scores.json")
                                                                or p.name.endswith(".init.json"))]
    for d in work.iterdir():
        # a saved conversion, a finished run (its report.json) or one kept as <init>-init
        if d.is_dir() and (d.name.endswith((".converted", "-init")) or (d / "report.json").is_file()):
            files += [f"{d.name}/{f}" for f in tree_files(d, skip=())]
    return files, settings


def has_progress(work: Path) -> bool:
    """Whether a recovery's partial directory holds anything to resume: a saved conversion or a run
    with a checkpoint or a finished output."""
    from tcal.train.checkpoint import finished_report, has_checkpoint

    if not work.is_dir():
        return False
    if any(work.glob("*.init.json")):
        return True
    return any(d.is_dir() and (has_checkpoint(d) or finished_report(d) is not None) for d in work.iterdir())


def _teacher_ppl(cfg: RecoverConfig, work, teacher, held_out) -> float:
    """The teacher's PPL once, with the same protocol as every curve point (``held_out``: the ppl task of --eval;
    kept across resumes)."""
    tfile = work.path / "teacher_ppl.json"
    if tfile.is_file():
        return json.loads(tfile.read_text())["ppl"]
    ppl = held_out.score(teacher, progress=cfg.progress)
    work.write_json("teacher_ppl.json", {"ppl": ppl, "eval": cfg.eval, "window": cfg.eval_window,
                                         "windows": cfg.eval_windows})
    return ppl


def teacher_key(cfg, tasks) -> dict:
    """What the teacher's curve scores depend on: the teacher, its dtype, the held-out PPL protocol and every curve
    task with the flags it reads (a change of any recomputes them)."""
    def plain(v):
        return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)

    return {"teacher": cfg.teacher, "teacher_dtype": cfg.teacher_dtype, "eval": cfg.eval,
            "eval_window": cfg.eval_window, "eval_windows": cfg.eval_windows,
            "tasks": {t.name: {"specs": [str(x) for x in t.specs],
                               **{n: plain(getattr(t.opts, n, None)) for n in t.option_names()}} for t in tasks}}


def _teacher_scores(cfg, work, teacher, probes, tasks) -> tuple[dict | None, dict]:
    """The teacher's score on every curve probe, computed once per experiment (``teacher_scores.json`` in the
    partial folder, keyed by :func:`teacher_key`): every init and every resumed call reads them. Returns (scores
    or None without probes, seconds per probe: 0 where read back)."""
    from tcal.train.trainer import timed_probes

    if not probes:
        return None, {}
    key = teacher_key(cfg, tasks)
    tfile = work.path / "teacher_scores.json"
    if tfile.is_file():
        saved = json.loads(tfile.read_text())
        if saved.get("key") == key and set(saved.get("probes", {})) == set(probes):
            return saved["probes"], {**saved.get("seconds", {}), "read_back": True}
    scores, seconds = timed_probes(probes, teacher)
    seconds = {k: round(v, 3) for k, v in seconds.items()}
    work.write_json(tfile.name, {"key": key, "probes": scores, "seconds": seconds})
    return scores, seconds


def _converted_student(cfg: RecoverConfig, init: str, keep, teacher, tokenizer, work, world):
    """The init's weights before training, converted now or loaded from an earlier call: a call
    killed between a long calibration and the first checkpoint does not calibrate again. Under
    torchrun every rank converts (calibration spreads its layers over the ranks) and rank 0 saves."""
    import torch

    from tcal.conversion.convert import convert_with_record
    from tcal.conversion.inits import get_init
    from tcal.data.streams import eval_windows_for
    from tcal.train import distributed as D
    from tcal.train.checkpoint import load_model, save_model
    from tcal.utils.runtime import model_device

    main = world.is_main()
    converted, info_file = work.path / f"{init}.converted", work.path / f"{init}.init.json"
    if D.on_main(world, lambda: converted.is_dir() and info_file.is_file()):
        if main:
            print(f"{init}: converted earlier, loaded from {converted}")
        return load_model(converted), json.loads(info_file.read_text())
    spec = get_init(init)
    kw = {}
    if spec.calibrated:
        # the first windows of --calib: a corpus (tokenised), a .npy token file or a token pool
        budget = cfg.budget(str(model_device(teacher)))
        calib_ids, _ = eval_windows_for(cfg.calib, tokenizer, cfg.calib_window, cfg.calib_windows)
        kw = {"calib_ids": calib_ids, "align": budget.align, "progress": cfg.progress and main}
        if spec.kl:
            kw.update(kl=budget.kl, tokenizer=tokenizer, **cfg.kl_options(budget))
    t1 = time.time()
    torch.manual_seed(cfg.seed)
    conv = convert_with_record(teacher, keep, init, seed=cfg.seed, use_short_conv=cfg.use_short_conv,
                               output_gate=cfg.output_gate, **kw)
    info = {"init": init, "convert_s": time.time() - t1,
            # the resolved Phase 2 / KL-stage settings: the budget presets change between versions
            "calib": {"data": cfg.calib, "window": cfg.calib_window, "windows": cfg.calib_windows,
                      "align": dataclasses.asdict(kw["align"]),
                      **({"kl": dataclasses.asdict(kw["kl"])} if spec.kl else {})}
            if spec.calibrated else None,
            "init_report": jsonable(conv.record)}

    def save():
        with work.dir(converted.name) as tmp:
            save_model(conv.hybrid, tmp)
        work.write_json(info_file.name, info)  # last: it marks the saved conversion complete
        print(f"{init}: converted in {info['convert_s']:.1f} s")

    D.on_main(world, save)
    return conv.hybrid, info


def run(cfg: RecoverConfig, *, callback=None) -> dict:
    """Convert with each init, distil each the same way, tabulate tokens-to-target. Under torchrun
    every rank runs this; rank 0 alone writes and prints."""
    from tcal.train import distributed as D
    from tcal.train.options import check_train_options, curve_tasks
    from tcal.utils.flags import as_given
    from tcal.utils.runtime import resolve_device

    given = as_given(cfg)
    check_train_options(cfg, cfg.tokens)
    tasks = curve_tasks(cfg, "tcal recover")
    world = D.init_from_env(resolve_device(cfg.device), cfg.dist_timeout)
    try:
        inits, keep, work = _start(cfg, world, tasks, given)
        try:
            return _run(cfg, inits, keep, work, callback, world, tasks)
        except BaseException:
            if world.is_main() and not has_progress(work.path):  # nothing a rerun could resume
                work.discard()
            raise
    finally:
        D.destroy(world)


def _run(cfg: RecoverConfig, inits, keep, work, callback, world, tasks) -> dict:
    import torch

    from tcal.data.tokens import window_prefix
    from tcal.evaluate.plan import held_out
    from tcal.report.distill_report import run_files
    from tcal.train import checkpoint as C
    from tcal.train import distributed as D
    from tcal.train.data import training_streams
    from tcal.train.probes import best_column, curve_probes
    from tcal.train.trainer import distill
    from tcal.utils.runtime import resolve_dtype

    main = world.is_main()
    say = print if main else (lambda *a, **k: None)
    device = world.device
    t0 = time.time()
    teacher, tokenizer = C.load_model_and_tokenizer(cfg.teacher, dtype=resolve_dtype(cfg.teacher_dtype), device=device)
    load_s = time.time() - t0
    train_tokens, train_mask, mix_tokens, data_info = training_streams(cfg, tokenizer)
    ppl = held_out([cfg.eval], cfg.eval_window, cfg.eval_windows)  # --eval: every curve's eval_ppl
    ppl.prepare(teacher, tokenizer)
    eval_ids = ppl.windows()
    probes = curve_probes(tasks, tokenizer, teacher)  # the same prompts for every init
    prefix = tuple(window_prefix(tokenizer)) if tokenizer is not None else ()  # Gemma's BOS starts every window
    teacher_ppl = D.on_main(world, lambda: _teacher_ppl(cfg, work, teacher, ppl))
    say(f"teacher {cfg.teacher}: PPL {teacher_ppl:.3f} on {cfg.eval} ({cfg.eval_windows} x {cfg.eval_window})")
    # the teacher's probe scores once for every init and every resumed call (teacher_scores.json)
    teacher_probes, teacher_seconds = D.on_main(world, lambda: _teacher_scores(cfg, work, teacher, probes, tasks))
    if teacher_probes:
        say(f"teacher {cfg.teacher}: " + ", ".join(f"{k} {v:.3f}" for k, v in teacher_probes.items())
            + ("" if teacher_seconds.get("read_back") else
               f" ({sum(v for k, v in teacher_seconds.items() if k in teacher_probes):.1f} s)"))
    reports, init_info = {}, {}
    # --max-minutes bounds this whole call (conversions included); each run gets what is left.
    deadline = t0 + cfg.max_minutes * 60 if cfg.max_minutes else None
    for init in inits:
        run_dir = work.path / init
        info_file = work.path / f"{init}.init.json"
        done = C.finished_report(run_dir)
        if done is not None and done.get("status") == "done" and not C.partial_dir(run_dir).exists():
            reports[init] = done
            D.on_main(world, lambda: work.adopt(init))  # published by a run killed before it was recorded
            init_info[init] = json.loads(info_file.read_text()) if info_file.is_file() else {}
            say(f"{init}: finished earlier, final PPL {done['final_ppl']:.3f}")
            continue
        if deadline is not None and D.any_rank(time.time() >= deadline, world):
            say(f"tcal recover: --max-minutes reached before run {init}; rerun with --resume ({work.path})",
                file=sys.stderr)
            return {"status": "paused", "init": init, "work": str(work.path)}
        student, info = None, {}
        if not C.has_checkpoint(run_dir):
            student, info = _converted_student(cfg, init, keep, teacher, tokenizer, work, world)
        elif info_file.is_file():
            info = json.loads(info_file.read_text())
        dcfg = _distill_config(cfg, init, run_dir)
        if deadline is not None:  # a positive remainder: at worst the run checkpoints right after step 0
            dcfg.max_minutes = max((deadline - time.time()) / 60, 1e-6)
        partial = D.on_main(world, lambda: C.start_partial(run_dir, True, as_record(dcfg)))
        report, student = distill(student, teacher, dcfg, tokens=cfg.tokens, train_tokens=train_tokens,
                                  eval_ids=eval_ids, partial=partial, teacher_ppl=teacher_ppl,
                                  teacher_probes=teacher_probes, teacher_seconds=teacher_seconds,
                                  settings=as_record(dcfg), callback=callback, world=world,
                                  probes=probes, prefix=prefix, train_mask=train_mask, mix_tokens=mix_tokens,
                                  best_by=best_column(tasks))
        report.update(budget_tokens=cfg.tokens, data=data_info, init=init)
        if report["status"] != "done":
            say(f"tcal recover: paused in run {init}; rerun with --resume to continue ({work.path})",
                file=sys.stderr)
            return {"status": "paused", "init": init, "work": str(work.path)}

        def publish(student=student, partial=partial):
            files = run_files(report, dcfg, title=f"distill {run_dir.name}", tasks=tasks)
            C.publish_run(run_dir, student, tokenizer, files, best=bool(report.get("best")), work=partial)
            work.adopt(init)
            converted = f"{init}.converted"
            if cfg.keep_init and (work.path / converted).is_dir():
                if tokenizer is not None:  # a loadable hybrid with its tokenizer
                    saved = tokenizer.save_pretrained(work.path / converted)
                    work.record(*(Path(f).relative_to(work.path).as_posix() for f in saved))
                work.move(converted, f"{init}-init")
            else:
                work.remove(converted)  # the run's output holds the trained weights

        D.on_main(world, publish)
        del student
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        reports[init], init_info[init] = report, info
        steady = (report.get("train_speed") or {}).get("steady_tokens_per_s")
        say(f"{init}: PPL {report['zero_shot_ppl']:.2f} -> {report['final_ppl']:.2f} after {report['tokens']:,} "
            f"tokens ({report['train_tokens_per_s']:,.0f} tokens/s"
            + (f", {steady:,.0f} after the first step" if steady else "") + ")")
    return D.on_main(world, lambda: _finish(cfg, work, inits, keep, reports, init_info, teacher_ppl, data_info,
                                            load_s, tasks))


def _finish(cfg, work, inits, keep, reports, init_info, teacher_ppl, data_info, load_s, tasks=()) -> dict:
    from tcal.report.plots import plot_recovery, plot_scores
    from tcal.report.targets import score_table, score_table_markdown, table_markdown, target_table
    from tcal.utils.atomic import written_files

    curves = {init: reports[init]["curve"] for init in inits}
    table = target_table(curves, teacher_ppl)
    run_keys = ("zero_shot_ppl", "final_ppl", "tokens", "steps", "epochs", "train_tokens_per_s", "train_s",
                "elapsed_s", "peak_memory", "device", "precision", "trainable_params", "teacher_probes", "best",
                "train_speed", "timing", "teacher_seconds")
    summary = {
        "status": "done", "teacher": cfg.teacher, "teacher_ppl": teacher_ppl, "keep": keep, "inits": inits,
        "eval": {"data": cfg.eval, "window": cfg.eval_window, "windows": cfg.eval_windows},
        "data": data_info, "table": jsonable(table),
        "runs": {init: {k: reports[init].get(k) for k in run_keys}
                 | {"convert_s": init_info.get(init, {}).get("convert_s"), "calib": init_info.get(init, {}).get("calib")}
                 for init in inits},
        "teacher_load_s": load_s,
    }
    md = table_markdown(table)
    teacher_probes = next((r.get("teacher_probes") for r in reports.values() if r.get("teacher_probes")), None) or {}
    for column, label in ((c, lab) for t in tasks for c, lab in t.targets().items() if c in teacher_probes):
        # recovery judged by what the runs write (HumanEval's answers), beside PPL
        scores = score_table(curves, column, teacher_probes[column])
        summary[column] = jsonable(scores)
        md += f"\n## {label}: tokens to reach each share of the teacher's\n\n" + score_table_markdown(scores)
        plot_scores(curves, column, teacher_probes[column], work.path / f"recovery-{column}.png",
                    title=f"{cfg.teacher}: the answers it writes", label=label)
        work.record(f"recovery-{column}.png")
    best = {init: reports[init].get("best") for init in inits if reports[init].get("best")}
    if best:
        summary["best"] = best
        picked = next((t.heading(c) for t in tasks if t.picks_best for c in t.columns()), "score")
        md += (f"\nBest checkpoint per run (the lowest {picked}; OUT/<init>/best): "
               + "; ".join(f"{i} at {b['tokens']:,} tokens" for i, b in best.items()) + "\n")
    work.write_text("recovery.md", md)
    work.write_json("recovery.json", summary)
    plot_recovery(curves, teacher_ppl, work.path / "recovery.png", table=table,
                  title=f"{cfg.teacher}, attention kept at {cfg.keep}")
    work.record("recovery.png")
    work.write_text("report.md", _report_markdown(cfg, summary, md))
    work.write_json("tcal_config.json", {"stage": "recover", **as_record(cfg)})
    for name in ("recover_config.json", "teacher_ppl.json", "teacher_scores.json"):  # what a resumed run reads
        work.remove(name)
    out = work.publish(cfg.out)
    print(md)
    print(f"wrote {out}: {', '.join(written_files(out))}")
    return summary


def replot(run_dir) -> str | None:
    """Redraw ``recovery.png`` of a finished ``tcal recover`` directory from its JSON and curves."""
    from tcal.report.plots import plot_recovery
    from tcal.train.curve import read_curve
    from tcal.utils.errors import TcalError

    run_dir = Path(run_dir)
    summary_path = run_dir / "recovery.json"
    if not summary_path.is_file():
        raise TcalError(f"{summary_path} not found: pass the output directory of a finished `tcal recover`")
    summary = json.loads(summary_path.read_text())
    curves = {init: read_curve(run_dir / init / "curve.csv") for init in summary["inits"]}
    keep = ",".join(str(i) for i in summary["keep"])
    return plot_recovery(curves, summary["teacher_ppl"], run_dir / "recovery.png", table=summary["table"],
                         title=f"{summary['teacher']}, attention kept at {keep}")


def jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "numel") and hasattr(obj, "tolist"):  # a tensor
        return obj.tolist() if obj.numel() <= 64 else f"tensor{tuple(obj.shape)}"
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


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
        "| init | PPL before | PPL after | tokens | train tokens/s | first step s | steady tokens/s | convert s | "
        "peak memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for init, r in summary["runs"].items():
        mem = (r.get("peak_memory") or {}).get("bytes")
        conv = r.get("convert_s")
        speed = r.get("train_speed") or {}
        first = ", ".join(f"{x:.1f}" for x in speed.get("first_step_s") or []) or "-"
        steady = "-" if speed.get("steady_tokens_per_s") is None else f"{speed['steady_tokens_per_s']:,.0f}"
        lines.append(
            f"| {init} | {r['zero_shot_ppl']:.2f} | {r['final_ppl']:.2f} | {r['tokens']:,} | "
            f"{r['train_tokens_per_s']:,.0f} | {first} | {steady} | {'-' if conv is None else f'{conv:.1f}'} | "
            f"{'-' if mem is None else f'{mem / 2 ** 30:.2f} GiB'} |"
        )
    for init, r in summary["runs"].items():
        from tcal.report.distill_report import timing_table

        t = timing_table(r)
        if t:
            lines += ["", f"## Where {init}'s time went", "", *t]
    lines += ["", "## Tokens to reach each target", "", table_md,
              "Curves: recovery.png; per run: <init>/curve.csv.", ""]
    return "\n".join(lines)
