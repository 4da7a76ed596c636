"""Distillation settings (plain data, no torch): shared by `tcal distill` and `tcal recover`, and the tasks every
curve point scores (:func:`curve_tasks`)."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from tcal.evaluate.plan import ADDS, RENAMES, Command, OldFlag
from tcal.evaluate.tasks import settings, task_args
from tcal.utils.command_config import DeviceArgs, EvalArgs, OutArgs, TeacherArgs, arg
from tcal.utils.errors import TcalError
from tcal.utils.flags import Reader, check_seed
from tcal.utils.schedule import SCHEDULES

TRAIN_SETS = ("gdn", "all")


PRECISIONS = ("auto", "fp32", "bf16")


COMPILE_MODES = ("auto", "on", "off")


TEACHER_PLACEMENTS = ("auto", "replicate", "shard")


@dataclass
class TrainOptions(task_args(for_eval=False), EvalArgs, DeviceArgs):
    """Distillation settings shared by ``tcal distill`` and ``tcal recover``; ``--tasks`` are scored at every curve
    point, beside the held-out PPL."""

    seq_len: int = arg(512, "tokens per training sequence")
    batch_size: int = arg(16, "sequences per optimizer step (tokens per step = batch-size x seq-len)")
    micro_batch: int = arg(0, "sequences per forward/backward pass (gradient accumulation); 0 = batch-size")
    lr: float = arg(3e-4, "peak AdamW learning rate (betas 0.9, 0.95)")
    schedule: str = arg("cosine", "learning-rate schedule after the warm-up", choices=SCHEDULES)
    warmup: float = arg(0.02, "linear warm-up: a fraction of --tokens if < 1, else a number of tokens")
    min_lr_ratio: float = arg(0.1, "cosine schedule: final learning rate as a fraction of --lr")
    weight_decay: float = arg(0.01, "AdamW weight decay on matrices (biases, norms, A_log, dt_bias: none)")
    grad_clip: float = arg(1.0, "gradient-norm clip; 0 = off")
    ce_weight: float = arg(0.0, "loss = (1 - w) KL(teacher || student) + w next-token CE; w in [0, 1]")
    recall_frac: float = arg(0.0, "share of training sequences that end with a verbatim copy of an earlier span of "
                                  "themselves (KL on the copy asks the student to find text far back in its "
                                  "context, as retrieval does); 0 = plain text")
    recall_span: int = arg(256, "tokens in each copied span of --recall-frac (at most half of --seq-len)")
    mix_data: str = arg("", "a second training stream mixed into every batch (a token pool, .npy file or corpus): "
                            "raw text beside an instruct set given as --data; empty = none")
    mix_frac: float = arg(0.25, "share of every batch's sequences that --mix-data fills (rounded; at least one)")
    kl_chunk: int = arg(1024, "token rows per chunk of the vocabulary-wide KL (bounds the logits' memory)")
    train: str = arg("gdn", "parameters that train: the GDN layers only, or all", choices=TRAIN_SETS)
    gradient_checkpointing: bool = arg(False, "recompute decoder layers in the backward pass (less memory, slower)")
    compile: str = arg("auto", "torch.compile the chunked GDN training path: auto = on CUDA when fla's backward "
                               "is unavailable (2.2x faster GDN forward + backward on an H200), off on CPU",
                       choices=COMPILE_MODES)
    eval_windows: int = arg(16, "evaluation windows per curve point (the first N, non-overlapping; fewer than "
                                "the full 64 because the curve evaluates many times)")
    eval_every: int = arg(1_000_000, "evaluate every N training tokens (and at 0 tokens and at the end)")
    eval_early: int = arg(4, "extra early evaluations at eval-every/2, /4, ... (this many)")
    # the old spellings of --tasks, each mapped onto it (OLD_FLAGS)
    eval_passkey: str = arg("", "deprecated, use --tasks passkey@L1,L2: passkey retrieval at these context lengths at "
                                "every curve point")
    eval_passkey_samples: int = arg(10, "deprecated, use --tasks passkey:N@L1,L2: passkey prompts per length")
    eval_passkey_haystack: str = arg("sotu:eval", "deprecated, use --haystack: text the passkey needles hide in")
    eval_humaneval: int = arg(0, "deprecated, use --tasks humaneval:N: HumanEval pass@1 of the first N problems at "
                                 "every curve point (0 = off)")
    save_every: int = arg(5_000_000, "checkpoint (for --resume) every N training tokens")
    precision: str = arg("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16", choices=PRECISIONS)
    teacher_dtype: str = arg("float32", "teacher weights dtype: float32 or bfloat16")
    seed: int = arg(0, "seed of the data order (a window permutation per epoch) and of torch's RNG")
    resume: bool = arg(False, "continue an interrupted run from OUT.partial/ (the same settings)")
    max_minutes: float = arg(0.0, "checkpoint and stop after this many minutes (rerun with --resume); 0 = no limit")
    stop_after_tokens: int = arg(0, "checkpoint and stop once this many tokens are done (rerun with --resume); "
                                    "0 = never")
    progress: bool = arg(True, "progress bars")
    teacher_placement: str = arg("auto", "under torchrun: the frozen teacher on every rank (replicate) or split "
                                         "over the ranks with FSDP2 (shard); auto = replicate unless its weights "
                                         "exceed 40 % of one GPU's memory (always replicate on the CPU)",
                                 choices=TEACHER_PLACEMENTS)
    dist_timeout: float = arg(30.0, "under torchrun: minutes a collective may wait for the other ranks before the "
                                    "run stops (a hung or dead rank)")


@dataclass
class DistillConfig(TrainOptions, TeacherArgs, OutArgs):
    """``tcal distill``'s settings (``tcal recover`` makes one per init)."""

    hybrid: str = arg("runs/convert", "the hybrid to distill: a directory written by `tcal convert`")
    data: str = arg("", "training tokens: a token pool directory (tcal pool), a .npy file or a corpus spec")
    tokens: int = arg(1_000_000, "training-token budget (rounded up to whole steps)")
    out: str = arg("runs/distill", "output directory (written atomically; progress in OUT.partial/)")


# What a resumed run may change. How the work is spread over processes (the world size, the
# teacher's placement) changes neither the data order nor the optimizer's state.
RESUME_FREE = {"resume", "max_minutes", "stop_after_tokens", "progress", "out", "device", "compile",
               "teacher_placement", "dist_timeout"}


def changed_settings(saved: dict, now: dict, free=RESUME_FREE) -> list[str]:
    """The settings, other than ``free`` ones, whose values differ between a saved run and now. A run saved
    before a setting existed ran with that setting's default."""
    from tcal.utils.partial import differing

    return differing(saved, now, free, settings(TrainOptions()))


def train_readers(cfg: TrainOptions) -> list[Reader]:
    """The training flags that only matter beside another (:mod:`tcal.utils.flags`)."""
    return [Reader("--mix-data", ("mix_frac",), bool(cfg.mix_data.strip())),
            Reader("--recall-frac above 0", ("recall_span",), cfg.recall_frac > 0),
            Reader("--schedule cosine", ("min_lr_ratio",), cfg.schedule == "cosine"),
            Reader("a run under torchrun", ("dist_timeout", "teacher_placement"), "WORLD_SIZE" in os.environ)]


# the old spellings of --tasks: what each stands for (tcal.evaluate.plan.fold); the passkey before HumanEval, as
# their columns always came
OLD_FLAGS = (OldFlag("eval_passkey", ADDS, "passkey", "lengths", count_from="eval_passkey_samples"),
             OldFlag("eval_humaneval", ADDS, "humaneval", "count"), OldFlag("eval_passkey_haystack", RENAMES, "haystack"))
CURVE = Command("tcal distill", teacher=True, old=OLD_FLAGS)


def curve_tasks(cfg: TrainOptions, where: str) -> list:
    """The tasks every curve point of ``where`` (tcal distill, tcal recover) scores (:func:`tcal.evaluate.plan.plan`):
    ``--tasks`` and its old spellings, and ``answer_kl`` wherever ``--data`` is an instruct set with development tasks
    (the best checkpoint's rule). Built, behind the one code-execution gate, and checked, before any model loads."""
    from tcal.evaluate.plan import plan

    return plan(cfg, dataclasses.replace(CURVE, name=where), readers=train_readers(cfg), data=str(cfg.data))


def check_train_options(cfg: TrainOptions, tokens: int) -> None:
    if tokens < 1:
        raise TcalError(f"--tokens must be positive, got {tokens}")
    if cfg.seq_len < 2:
        raise TcalError(f"--seq-len must be at least 2, got {cfg.seq_len}")
    if cfg.batch_size < 1:
        raise TcalError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    if cfg.micro_batch < 0 or (cfg.micro_batch and cfg.batch_size % cfg.micro_batch):
        raise TcalError(f"--micro-batch {cfg.micro_batch} must divide --batch-size {cfg.batch_size} (or be 0)")
    if not 0.0 <= cfg.ce_weight <= 1.0:
        raise TcalError(f"--ce-weight must be in [0, 1], got {cfg.ce_weight}")
    if not 0.0 <= cfg.mix_frac < 1.0 or not math.isfinite(cfg.mix_frac):
        raise TcalError(f"--mix-frac must be in [0, 1) (the rest of each batch is --data), got {cfg.mix_frac}")
    if cfg.mix_data.strip() and cfg.batch_size < 2:
        raise TcalError("--mix-data shares each batch with --data: use --batch-size of at least 2")
    if not 0.0 <= cfg.recall_frac <= 1.0:
        raise TcalError(f"--recall-frac must be in [0, 1], got {cfg.recall_frac}")
    if cfg.recall_frac > 0 and not 1 <= cfg.recall_span <= cfg.seq_len // 2:
        raise TcalError(f"--recall-span must be between 1 and half of --seq-len ({cfg.seq_len // 2}), "
                        f"got {cfg.recall_span}")
    if cfg.kl_chunk < 1:
        raise TcalError(f"--kl-chunk must be positive, got {cfg.kl_chunk}")
    for flag, value in (("--lr", cfg.lr), ("--warmup", cfg.warmup), ("--weight-decay", cfg.weight_decay),
                        ("--grad-clip", cfg.grad_clip), ("--min-lr-ratio", cfg.min_lr_ratio)):
        if not math.isfinite(value):
            raise TcalError(f"{flag} must be a finite number, got {value}")
    if cfg.lr <= 0:
        raise TcalError(f"--lr must be positive, got {cfg.lr}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise TcalError(f"--min-lr-ratio is the final learning rate as a fraction of --lr: in [0, 1], got "
                        f"{cfg.min_lr_ratio}")
    for flag, value in (("--weight-decay", cfg.weight_decay), ("--grad-clip", cfg.grad_clip)):
        if value < 0:
            raise TcalError(f"{flag} must be >= 0, got {value}")
    if not (math.isfinite(cfg.max_minutes) and cfg.max_minutes >= 0):
        raise TcalError(f"--max-minutes must be a number of minutes >= 0 (0 = no limit), got {cfg.max_minutes}")
    if cfg.stop_after_tokens < 0:
        raise TcalError(f"--stop-after-tokens must be a number of tokens >= 0 (0 = never), got "
                        f"{cfg.stop_after_tokens}")
    check_seed(cfg.seed)
    if cfg.warmup < 0:
        raise TcalError(f"--warmup must be >= 0, got {cfg.warmup}")
    if cfg.eval_every < 1 or cfg.save_every < 1:
        raise TcalError("--eval-every and --save-every must be positive numbers of tokens")
    if cfg.eval_early < 0:
        raise TcalError(f"--eval-early must be >= 0, got {cfg.eval_early}")
    if cfg.eval_windows < 1 or cfg.eval_window < 2:
        raise TcalError("--eval-windows must be >= 1 and --eval-window >= 2")
    if cfg.schedule not in SCHEDULES:
        raise TcalError(f"unknown --schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if cfg.train not in TRAIN_SETS:
        raise TcalError(f"unknown --train {cfg.train!r}; choose one of {', '.join(TRAIN_SETS)}")
    if cfg.teacher_placement not in TEACHER_PLACEMENTS:
        raise TcalError(f"unknown --teacher-placement {cfg.teacher_placement!r}; choose one of "
                        f"{', '.join(TEACHER_PLACEMENTS)}")
    if not (math.isfinite(cfg.dist_timeout) and cfg.dist_timeout > 0):
        raise TcalError(f"--dist-timeout must be a positive number of minutes, got {cfg.dist_timeout}")
    if cfg.precision not in PRECISIONS:
        raise TcalError(f"unknown --precision {cfg.precision!r}; choose one of {', '.join(PRECISIONS)}")


