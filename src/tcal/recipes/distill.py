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

import sys
from pathlib import Path

from tcal.train.options import DistillConfig

__all__ = ["DistillConfig", "run"]


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

    from tcal.conversion.resolve import resolve_teacher_args
    from tcal.data.teachers import load_tokenizer_dir
    from tcal.data.tokens import window_prefix
    from tcal.evaluate.plan import held_out
    from tcal.evaluate.tasks import settings as as_record
    from tcal.report.distill_report import human_bytes, run_files
    from tcal.train import checkpoint as C
    from tcal.train import distributed as D
    from tcal.train.data import check_training_data, training_streams
    from tcal.train.options import changed_settings
    from tcal.train.probes import best_column, curve_probes
    from tcal.train.trainer import distill
    from tcal.utils.atomic import check_out, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.partial import read_settings
    from tcal.utils.runtime import resolve_dtype

    main = world.is_main()
    say = print if main else (lambda *a, **k: None)
    # every argument is checked before a model loads
    resolve_teacher_args(cfg, check=False)  # --eval auto: the teacher's home domain
    D.check_batch_split(cfg.batch_size, cfg.micro_batch, world.world_size)
    settings = read_settings(as_record(cfg))  # a resume compares the files read, not their spelling
    if cfg.resume:
        done = C.finished_report(cfg.out)
        if done is not None and not C.has_checkpoint(cfg.out) and not changed_settings(done.get("config", {}), settings):
            say(f"{cfg.out} is already finished; nothing to resume")
            return done
    out = check_out(cfg.out, "distill", cfg.overwrite)
    # a pool, a .npy file or an instruct set holds token ids (a pool's text was checked when it was built)
    check_training_data(cfg, [text for t in tasks for text in t.texts()])
    partial = D.on_main(world, lambda: C.start_partial(out, cfg.resume, settings))
    resuming = cfg.resume and C.has_checkpoint(out)
    if not resuming and not (Path(cfg.hybrid) / "config.json").is_file():
        raise TcalError(f"--hybrid {cfg.hybrid} is not a model directory; write one with `tcal convert --out DIR`")
    # several processes: the models load on the CPU and the trainer shards or places them
    device = world.device if not world.distributed else "cpu"
    teacher, tok_t = C.load_model_and_tokenizer(cfg.teacher, dtype=resolve_dtype(cfg.teacher_dtype), device=device)
    student = tok_s = None
    if not resuming:
        student, tok_s = C.load_model_and_tokenizer(cfg.hybrid, dtype=torch.float32, device=device)
    elif Path(cfg.hybrid).is_dir():  # the checkpoint holds the weights only: the hybrid's tokenizer is still its own
        tok_s = load_tokenizer_dir(cfg.hybrid, required=False)
    tokenizer = tok_s or tok_t
    train_tokens, train_mask, mix_tokens, info = training_streams(cfg, tokenizer)
    ppl = held_out([cfg.eval], cfg.eval_window, cfg.eval_windows)  # --eval: the curve's eval_ppl
    ppl.prepare(teacher, tokenizer)
    eval_ids = ppl.windows()
    probes = curve_probes(tasks, tokenizer, teacher)
    # every training window starts with the tokenizer's BOS where it puts one before every text (Gemma)
    prefix = tuple(window_prefix(tokenizer)) if tokenizer is not None else ()
    with C.removed_unless_resumable(out, partial, enabled=main):
        report, student = distill(student, teacher, cfg, tokens=cfg.tokens, train_tokens=train_tokens,
                                  eval_ids=eval_ids, partial=partial, settings=settings, callback=callback,
                                  world=world, probes=probes, prefix=prefix, train_mask=train_mask,
                                  mix_tokens=mix_tokens, best_by=best_column(tasks))
    report.update(budget_tokens=cfg.tokens, data=info)
    if not main:
        return report
    if report["status"] == "paused":
        print(f"tcal distill: paused at {report['tokens']:,} of {report['total_steps'] * report['tokens_per_step']:,} "
              f"tokens; rerun with --resume to continue ({partial.path})", file=sys.stderr)
        partial.write_json("report.partial.json", report)
        return report
    C.publish_run(out, student, tokenizer, run_files(report, cfg, title=f"distill {out.name}", tasks=tasks),
                best=bool(report.get("best")), work=partial)
    tp = report["train_tokens_per_s"]
    print(f"PPL {report['zero_shot_ppl']:.2f} -> {report['final_ppl']:.2f} after {report['tokens']:,} tokens "
          f"(teacher {report['teacher_ppl']:.2f}); {tp:,.0f} tokens/s, peak memory "
          f"{human_bytes(report['peak_memory']['bytes'])}" + (f" (rank 0 of {world.world_size})"
                                                              if world.distributed else ""))
    speed = report.get("train_speed") or {}
    if speed.get("first_step_s"):
        steady = speed.get("steady_tokens_per_s")
        print(f"first step {speed['first_step_s'][0]:.1f} s (compiling), then "
              f"{'n/a' if steady is None else f'{steady:,.0f}'} tokens/s; seconds per curve point in timing.csv")
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return report
