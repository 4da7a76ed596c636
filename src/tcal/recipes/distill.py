"""`tcal distill`: distil a saved hybrid against its frozen teacher's logits.

``OUT.partial/`` holds the run while it is in progress (checkpoints for ``--resume``, ``curve.csv``
for watching; :mod:`tcal.utils.partial`). At the end ``OUT/`` is written in one rename: the final model
(safetensors) and tokenizer, ``curve.csv``, ``curve.png``, ``report.json``, ``report.md``, ``tcal_config.json``;
then the files tcal wrote into the partial directory are removed.

Under ``torchrun --nproc_per_node N -m tcal distill ...`` every rank runs this recipe; rank 0
alone creates, writes and removes directories, writes reports and prints (see
:mod:`tcal.train.distributed` for what is sharded).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from tcal.train.options import TrainOptions
from tcal.utils.command_config import OutArgs, TeacherArgs, arg


@dataclass
class DistillConfig(TrainOptions, TeacherArgs, OutArgs):
    hybrid: str = arg("runs/convert", "the hybrid to distill: a directory written by `tcal convert`")
    data: str = arg("", "training tokens: a token pool directory (tcal pool), a .npy file or a corpus spec")
    tokens: int = arg(1_000_000, "training-token budget (rounded up to whole steps)")
    out: str = arg("runs/distill", "output directory (written atomically; progress in OUT.partial/)")


def start_partial(out, resume: bool, settings: dict | None = None, free=None):
    """The run's unfinished work (:func:`tcal.utils.partial.open_work`): ``OUT.partial`` resumed where it holds a
    checkpoint (with ``resume``, and the same ``settings`` but ``free`` ones), started over where it holds none,
    refused where tcal did not write it."""
    from tcal.train.checkpoint import has_checkpoint, legacy_run
    from tcal.train.options import RESUME_FREE, changed_settings
    from tcal.utils.partial import open_work

    free = RESUME_FREE if free is None else free
    return open_work(out, "distill", settings=settings, resume=resume, progress=lambda w: has_checkpoint(out),
                     changed=lambda saved, now: changed_settings(saved, now, free=free), legacy=legacy_run)


@contextlib.contextmanager
def removed_unless_resumable(out, work, enabled: bool = True):
    """A run that fails before its first checkpoint leaves no partial directory behind: there is
    nothing to resume, and it must not block the next run. ``enabled``: whether this process owns
    the output (rank 0 under torchrun)."""
    from tcal.train.checkpoint import has_checkpoint

    try:
        yield
    except BaseException:
        if enabled and not has_checkpoint(out):
            work.discard()
        raise


def finish_run(out, report: dict, student, tokenizer, cfg, *, title: str, tasks=(), work=None) -> None:
    """Write a finished run's directory in one rename and discard its unfinished work (``work``: its
    :class:`~tcal.utils.partial.Work`); ``tasks``: what the curve points scored (their report lines)."""
    from tcal.report.plots import plot_curve
    from tcal.train.checkpoint import partial_dir, save_model
    from tcal.train.curve import curve_csv
    from tcal.utils.atomic import atomic_dir, write_json
    from tcal.utils.partial import Work

    out = Path(out)
    work = work if work is not None else Work(partial_dir(out), "distill")
    resolved = {"stage": "distill", **report["config"],
                "resolved": {k: report[k] for k in ("device", "precision", "total_steps", "tokens_per_step",
                                                    "warmup_steps", "train_windows")}}
    with atomic_dir(out) as tmp:
        save_model(student, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if report.get("best") and (work.path / "best").is_dir():  # the checkpoint the development answers picked
            (tmp / "best").mkdir()
            work.take("best", tmp / "best")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "best")
        (tmp / "curve.csv").write_text(curve_csv(report["curve"]))
        plot_curve(report["curve"], tmp / "curve.png", teacher_ppl=report["teacher_ppl"], title=title,
                   teacher_probes=report.get("teacher_probes"))
        write_json(tmp / "tcal_config.json", resolved)
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(report_markdown(report, cfg, tasks))
    work.discard()


def run(cfg: DistillConfig, *, callback=None) -> dict:
    """``tcal distill``: load the hybrid and the teacher, distil, write ``cfg.out``."""
    from tcal.train import distributed as D
    from tcal.train.options import check_train_options, curve_tasks
    from tcal.utils.runtime import resolve_device

    check_train_options(cfg, cfg.tokens)
    tasks = curve_tasks(cfg, "tcal distill")
    world = D.init_from_env(resolve_device(cfg.device), cfg.dist_timeout)  # one plain process outside torchrun
    try:
        return _run(cfg, world, callback, tasks)
    finally:
        D.destroy(world)


def _run(cfg: DistillConfig, world, callback, tasks) -> dict:
    import torch

    from tcal.data.streams import eval_windows_for
    from tcal.data.teacher_table import default_eval
    from tcal.data.teachers import load_tokenizer_dir
    from tcal.data.tokens import window_prefix
    from tcal.train import distributed as D
    from tcal.train.checkpoint import finished_report, has_checkpoint, load_model_and_tokenizer
    from tcal.train.options import changed_settings
    from tcal.train.trainer import distill
    from tcal.utils.atomic import check_out, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_dtype

    main = world.is_main()
    say = print if main else (lambda *a, **k: None)
    # every argument is checked before a model loads
    cfg.resolve_eval(default_eval(cfg.teacher))
    D.check_batch_split(cfg.batch_size, cfg.micro_batch, world.world_size)
    settings = dataclasses.asdict(cfg)
    if cfg.resume:
        done = finished_report(cfg.out)
        if done is not None and not has_checkpoint(cfg.out) and not changed_settings(done.get("config", {}), settings):
            say(f"{cfg.out} is already finished; nothing to resume")
            return done
    out = check_out(cfg.out, "distill", cfg.overwrite)
    # a pool, a .npy file or an instruct set holds token ids (a pool's text was checked when it was built)
    check_training_data(cfg, [text for t in tasks for text in t.texts()])
    partial = D.on_main(world, lambda: start_partial(out, cfg.resume, settings))
    resuming = cfg.resume and has_checkpoint(out)
    if not resuming and not (Path(cfg.hybrid) / "config.json").is_file():
        raise TcalError(f"--hybrid {cfg.hybrid} is not a model directory; write one with `tcal convert --out DIR`")
    # several processes: the models load on the CPU and the trainer shards or places them
    device = world.device if not world.distributed else "cpu"
    teacher, tok_t = load_model_and_tokenizer(cfg.teacher, dtype=resolve_dtype(cfg.teacher_dtype), device=device)
    student = tok_s = None
    if not resuming:
        student, tok_s = load_model_and_tokenizer(cfg.hybrid, dtype=torch.float32, device=device)
    elif Path(cfg.hybrid).is_dir():  # the checkpoint holds the weights only: the hybrid's tokenizer is still its own
        tok_s = load_tokenizer_dir(cfg.hybrid, required=False)
    tokenizer = tok_s or tok_t
    train_tokens, train_mask, mix_tokens, info = training_streams(cfg, tokenizer)
    eval_ids, _ = eval_windows_for(cfg.eval, tokenizer, cfg.eval_window, cfg.eval_windows)
    probes = curve_probes(tasks, tokenizer, teacher)
    # every training window starts with the tokenizer's BOS where it puts one before every text (Gemma)
    prefix = tuple(window_prefix(tokenizer)) if tokenizer is not None else ()
    with removed_unless_resumable(out, partial, enabled=main):
        report, student = distill(student, teacher, cfg, tokens=cfg.tokens, train_tokens=train_tokens,
                                  eval_ids=eval_ids, partial=partial, settings=settings, callback=callback,
                                  world=world, probes=probes, prefix=prefix, train_mask=train_mask,
                                  mix_tokens=mix_tokens)
    report.update(budget_tokens=cfg.tokens, data=info)
    if not main:
        return report
    if report["status"] == "paused":
        print(f"tcal distill: paused at {report['tokens']:,} of {report['total_steps'] * report['tokens_per_step']:,} "
              f"tokens; rerun with --resume to continue ({partial.path})", file=sys.stderr)
        partial.write_json("report.partial.json", report)
        return report
    finish_run(out, report, student, tokenizer, cfg, title=f"distill {out.name}", tasks=tasks, work=partial)
    tp = report["train_tokens_per_s"]
    print(f"PPL {report['zero_shot_ppl']:.2f} -> {report['final_ppl']:.2f} after {report['tokens']:,} tokens "
          f"(teacher {report['teacher_ppl']:.2f}); {tp:,.0f} tokens/s, peak memory "
          f"{human_bytes(report['peak_memory']['bytes'])}" + (f" (rank 0 of {world.world_size})"
                                                              if world.distributed else ""))
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return report


def check_training_data(cfg, extra_eval=()) -> None:
    """--data and --mix-data hold no evaluation text: neither --eval's nor the ``extra_eval`` texts the curve's tasks
    read (a pool or an instruct set was checked when it was built)."""
    from tcal.data.corpora import check_disjoint
    from tcal.data.overlap import check_no_eval_text

    check_instruct_data(cfg)
    for spec in (cfg.data, cfg.mix_data) if cfg.mix_data.strip() else (cfg.data,):
        for evaluated in (cfg.eval, *extra_eval):
            check_disjoint(spec, evaluated)
        check_no_eval_text(spec, [cfg.eval, *extra_eval], role="training data")


def check_instruct_data(cfg) -> None:
    """An instruct set is read at its own window length, as --data only (before any model loads)."""
    import json

    from tcal.data.instruct import MANIFEST, is_instruct_set
    from tcal.utils.errors import TcalError

    if cfg.mix_data.strip() and is_instruct_set(cfg.mix_data):
        raise TcalError(f"--mix-data {cfg.mix_data} is an instruct set (tcal instruct); --mix-data takes raw text to "
                        "mix beside one (a token pool, a .npy file or a corpus): give the instruct set as --data")
    if is_instruct_set(cfg.data):
        seq_len = json.loads((Path(cfg.data).expanduser() / MANIFEST).read_text()).get("seq_len")
        if seq_len != cfg.seq_len:
            raise TcalError(f"--data {cfg.data} is an instruct set of {seq_len}-token windows: use --seq-len {seq_len}")


def training_streams(cfg, tokenizer):
    """(tokens, answer mask or None, --mix-data's tokens or None, what was read) of a run's training data; an
    instruct set (tcal instruct) must be read at its own window length."""
    from tcal.data.streams import load_token_stream, load_training_data
    from tcal.utils.errors import TcalError

    tokens, mask, info = load_training_data(cfg.data, tokenizer)
    if mask is not None and cfg.seq_len != info["seq_len"]:
        raise TcalError(f"--data {cfg.data} is an instruct set of {info['seq_len']}-token windows: "
                        f"use --seq-len {info['seq_len']}")
    if mask is not None and cfg.recall_frac > 0 and not cfg.mix_data.strip():
        raise TcalError("--recall-frac copies spans into raw text and --data is an instruct set, whose windows are "
                        "whole answers: give the raw text as --mix-data, or drop --recall-frac")
    mix = None
    if cfg.mix_data.strip():
        mix, mix_info = load_token_stream(cfg.mix_data, tokenizer)
        info = {**info, "mix": {**mix_info, "frac": cfg.mix_frac}}
    return tokens, mask, mix, info


def curve_probes(tasks, tokenizer, teacher) -> dict:
    """The scorers of every curve point, one per column, from the run's tasks (:func:`tcal.train.options.curve_tasks`):
    prompts built once from the tokenizer, lengths checked against the teacher's position limit."""
    from tcal.utils.errors import TcalError

    texts = [t.name for t in tasks if t.text]
    if texts and tokenizer is None:
        raise TcalError(f"{', '.join(texts)} write{'s' if len(texts) == 1 else ''} and read text, and neither the "
                        "hybrid nor the teacher directory has a tokenizer; save one there or leave "
                        f"{'it' if len(texts) == 1 else 'them'} out of --tasks")
    probes = {}
    for t in tasks:
        t.prepare(teacher, tokenizer, teacher=teacher)
        probes.update(t.probes())
    return probes


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


def report_markdown(report: dict, cfg, tasks=()) -> str:
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
    lines += [
        f"Peak memory: {human_bytes(report['peak_memory']['bytes'])} ({report['peak_memory']['kind']}).",
        "",
        "Curve: curve.csv, curve.png.",
        "",
    ]
    return "\n".join(lines)
