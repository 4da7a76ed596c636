"""The distillation trainer: setup / step / evaluate / state_dict over the loss, sampler and schedule.

:class:`Trainer` owns the student, the frozen teacher, the optimizer and the loop state;
:meth:`Trainer.fit` runs it to the token budget, evaluating held-out PPL at the scheduled points
and checkpointing into the run's partial directory (given by the caller), and can pause (a time or
token limit) so that a later call resumes where it stopped with the same data order.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from tcal import ops
from tcal.evaluate import window_ppl
from tcal.modules.distill_loss import chunked_distill_loss, final_hidden, lm_parts
from tcal.train import distributed as D
from tcal.train.checkpoint import checkpoint_dir, load_model, save_model
from tcal.train.curve import curve_csv, timing_csv
from tcal.train.options import TrainOptions, changed_settings, check_train_options
from tcal.train.sampler import Stream, WindowOrder, batch_for_step, mix_rows, mixed_batch_for_step
from tcal.utils.atomic import write_json
from tcal.utils.errors import TcalError
from tcal.utils.fit import FitRules, FitState, nonfinite
from tcal.utils.partial import Work
from tcal.utils.runtime import autocast, peak_memory, resolve_device, rng_state, seed_everything, set_rng_state
from tcal.utils.schedule import Schedule, crossed, warmup_steps

log = logging.getLogger(__name__)

ADAM_BETAS = (0.9, 0.95)
# 2: the optimizer state is keyed by parameter name (FQN), full, so any world size reads it;
# 1: ``optimizer.state_dict()`` (keyed by index), still read by single-process runs
STATE_VERSION = 2


def trainable_parameters(model, which: str) -> list[tuple[str, nn.Parameter]]:
    """Mark and return the parameters that train: the GDN layers only ("gdn") or everything ("all")."""
    if which == "all":
        chosen = {n for n, _ in model.named_parameters()}
    else:
        if not hasattr(model, "gdn_modules"):
            raise TcalError(f"--train gdn needs a tcal hybrid, got {type(model).__name__}; use --train all")
        chosen = set()
        for gdn in model.gdn_modules().values():
            prefix = next(n for n, m in model.named_modules() if m is gdn)
            chosen |= {f"{prefix}.{n}" for n, _ in gdn.named_parameters()}
    params = []
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
        if n in chosen:
            params.append((n, p))
    if not params:
        raise TcalError("nothing to train: the model has no GDN layers; use --train all")
    return params


def make_optimizer(params: list[tuple[str, nn.Parameter]], cfg: TrainOptions) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (biases, norms, A_log, dt_bias get none)."""
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=ADAM_BETAS)


def resolve_compile(mode: str, device: torch.device) -> bool:
    if mode != "auto":
        return mode == "on"
    return ops.compile_by_default(device)


def amp_dtype(precision: str, device: torch.device):
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


class Trainer:
    """Distil ``student`` towards ``teacher`` on ``train_tokens`` for ``tokens`` tokens."""

    def __init__(self, student, teacher, cfg: TrainOptions, *, tokens: int, train_tokens: np.ndarray,
                 eval_ids: torch.Tensor, settings: dict | None = None, world: D.World | None = None,
                 probes: Mapping[str, Callable[[nn.Module], float]] | None = None, prefix: tuple[int, ...] = (),
                 train_mask: np.ndarray | None = None, mix_tokens: np.ndarray | None = None,
                 best_by: str | None = None):
        check_train_options(cfg, tokens)
        self.cfg = cfg
        self.prefix = tuple(int(t) for t in prefix)  # starts every training window (tcal.train.sampler)
        if len(self.prefix) >= cfg.seq_len:
            raise TcalError(f"--seq-len {cfg.seq_len} leaves no room after the {len(self.prefix)} token(s) every "
                            "window starts with; use a longer --seq-len")
        self.settings = settings if settings is not None else dataclasses.asdict(cfg)  # what a resume must match
        self.world = world if world is not None else D.World(device=resolve_device(cfg.device))
        self.device = torch.device(self.world.device)
        self.local_batch = D.check_batch_split(cfg.batch_size, cfg.micro_batch, self.world.world_size)
        self.rows = D.local_rows(cfg.batch_size, self.world.world_size, self.world.rank)
        self.amp = amp_dtype(cfg.precision, self.device)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.total_steps = int(math.ceil(tokens / self.tokens_per_step))
        self.warmup_steps = warmup_steps(cfg, self.total_steps, self.tokens_per_step)
        # no patience and no best state: the curve's points are reports and a run ends on its last state
        self.rules = FitRules(Schedule(cfg.schedule, self.total_steps, self.warmup_steps, cfg.min_lr_ratio,
                                       floor_at_last=False),
                              eval_every=cfg.eval_every, tokens_per_step=self.tokens_per_step,
                              eval_early=cfg.eval_early, on_nonfinite="raise")
        self.train_tokens, self.eval_ids = train_tokens, eval_ids
        # an instruct set's windows are whole packed samples: no prefix is put before them, no copy into them
        body = cfg.seq_len - (0 if train_mask is not None else len(self.prefix))
        self.n_windows = int(train_tokens.shape[0]) // body
        self.order = WindowOrder(self.n_windows, cfg.seed)
        # the streams a batch is drawn from where the data has an answer mask or a second stream is mixed in
        # (tcal.train.sampler.mixed_batch_for_step); None: one plain stream (batch_for_step)
        self.streams = None
        if train_mask is not None or mix_tokens is not None:
            if train_mask is not None and train_mask.shape != train_tokens.shape:
                raise TcalError(f"the training mask has {train_mask.shape[0]} positions for {train_tokens.shape[0]} "
                                "tokens; rebuild the instruct set")
            n_mix = mix_rows(cfg.batch_size, cfg.mix_frac) if mix_tokens is not None else 0
            main = Stream(train_tokens, self.order, train_mask,
                          *((self.prefix, cfg.recall_frac, cfg.recall_span) if train_mask is None else ()))
            self.streams = [(main, cfg.batch_size - n_mix)]
            if n_mix:
                n_mix_windows = int(mix_tokens.shape[0]) // (cfg.seq_len - len(self.prefix))
                # the mixed stream's order has a seed of its own, so that a mix of one stream with itself is not
                # the same windows twice
                self.streams.append((Stream(mix_tokens, WindowOrder(n_mix_windows, cfg.seed + 1), None, self.prefix,
                                            cfg.recall_frac, cfg.recall_span), n_mix))
        self.main = self.world.is_main()
        # scores beside the PPL at every curve point, one per column (single@4096, humaneval, answer_kl: the --tasks
        # of tcal.train.options.curve_tasks)
        self.probes = dict(probes or {})
        # the probe whose lowest score picks the run's best checkpoint (a task's picks_best: held-out development
        # answers, never an evaluation's own problems); None: no best checkpoint
        self.best_by = best_by if best_by in self.probes else None
        if self.probes and self.world.distributed:
            raise TcalError("curve tasks (--tasks) run in one process; under torchrun score the finished model with "
                            "`tcal eval MODEL --tasks ...`")
        self.placement = D.teacher_placement(cfg.teacher_placement, D.weight_bytes(teacher),
                                             D.device_memory(self.world.device)) if self.world.distributed else None
        if self.world.distributed:  # every rank must hold the same settings, data and models before sharding
            D.check_agreement(self.world, {**{f"setting {k}": v for k, v in self.settings.items()},
                                           **D.data_fingerprint(train_tokens, eval_ids),
                                           "student weights": D.model_fingerprint(student),
                                           "teacher weights": D.model_fingerprint(teacher)})
        self.student_cls, self.student_config = type(student), getattr(student, "config", None)
        self.student = student if self.world.distributed else student.to(self.device)
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self._check_vocab()
        self.params = trainable_parameters(self.student, cfg.train)
        self.gdn_compile = resolve_compile(cfg.compile, self.device)
        if cfg.gradient_checkpointing:
            self.student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base_s, _, base_t, _ = self.parts
        self.hidden_s = lambda ids: final_hidden(base_s, ids)
        self.hidden_t = lambda ids: final_hidden(base_t, ids)
        if self.world.distributed:
            # non-persistent buffers (rotary frequencies) are in no state dict: kept for plain_model
            self._buffers = {n: b.detach().cpu().clone() for n, b in self.student.named_buffers()}
            self.hidden_s = D.shard(self.student, self.world)  # moves the shards to the device
            self.student.to(self.device)  # what FSDP2 does not own (buffers)
            if self.placement == "shard":
                self.hidden_t = D.shard(self.teacher, self.world)
            self.teacher.to(self.device)
            # FSDP2 replaced the parameters with sharded ones (same names, same order)
            chosen = {n for n, _ in self.params}
            self.params = [(n, p) for n, p in self.student.named_parameters() if n in chosen]
        else:
            self.teacher.to(self.device)
        self.optimizer = make_optimizer(self.params, cfg)
        # loop state (what state_dict saves)
        self.step_count, self.curve = 0, []
        self.loss_sum, self.loss_count = 0.0, 0
        self.elapsed_before, self.train_s, self.segments = 0.0, 0.0, 1
        # where the time goes: one row per curve point (seconds per probe, the best-model and checkpoint writes, the
        # training since the point before), and each segment's first step (compiling) apart from the steady steps
        self.timing: list[dict] = []
        self.first_step_s: list[float] = []
        self.steady_s, self.steady_steps = 0.0, 0
        self._segment_steps = 0
        self._train_mark = (0.0, 0)  # (train_s, step_count) at the last curve point
        self.teacher_seconds: dict[str, float] = {}
        self.teacher_ppl: float | None = None
        self.teacher_probes: dict[str, float] | None = None
        self.best: dict | None = None  # the curve point of lowest best_by so far, its weights in PARTIAL/best
        self._t_start = time.time()

    def _check_vocab(self) -> None:
        base_s, head_s = lm_parts(self.student)
        base_t, head_t = lm_parts(self.teacher)
        self.parts = (base_s, head_s, base_t, head_t)
        vocab = head_s.weight.shape[0]
        if vocab != head_t.weight.shape[0]:
            raise TcalError(f"student vocabulary {vocab} != teacher vocabulary {head_t.weight.shape[0]}; "
                            "distil from the teacher the hybrid was converted from")
        tokens = self.train_tokens
        if tokens.size and int(np.max(tokens[: min(tokens.size, 1 << 24)])) >= vocab:
            raise TcalError(f"training data has token ids >= the vocabulary size {vocab}; wrong tokenizer?")
        if int(self.eval_ids.max()) >= vocab:
            raise TcalError(f"evaluation data has token ids >= the vocabulary size {vocab}; wrong tokenizer?")

    # -- one piece each ------------------------------------------------------------------------

    def lr(self, step: int) -> float:
        return self.rules.schedule.lr(step, peak=self.cfg.lr)

    def evaluate(self, model=None) -> float:
        return window_ppl(model or self.student, self.eval_ids, batch_size=4, device=self.device, progress=False)

    def step(self) -> float:
        """One optimizer step on the batch the data order assigns to it; returns its mean loss."""
        cfg, (_, head_s, _, head_t) = self.cfg, self.parts
        t0 = time.perf_counter()
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr(self.step_count)
        # this rank's rows of the global batch (all of it in one process)
        mask = None
        if self.streams is None:
            ids = batch_for_step(self.train_tokens, self.order, cfg.seq_len, self.step_count, cfg.batch_size,
                                 rows=self.rows, recall_frac=cfg.recall_frac, recall_span=cfg.recall_span,
                                 prefix=self.prefix)
        else:
            ids, mask = mixed_batch_for_step(self.streams, cfg.seq_len, self.step_count, rows=self.rows)
            mask = None if mask is None else mask.to(self.device)
        ids = ids.to(self.device)
        micro = cfg.micro_batch or self.local_batch
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for i in range(0, self.local_batch, micro):
            mb = ids[i:i + micro]
            # every packed instruct window holds an answer (tcal.data.instruct.pack), so no micro-batch is empty
            rows = None if mask is None else mask[i:i + micro].reshape(-1)
            labels = torch.full_like(mb, -100)
            labels[:, :-1] = mb[:, 1:]
            with autocast(self.device, self.amp):
                with torch.no_grad():
                    ht = self.hidden_t(mb)
                hs = self.hidden_s(mb)
                loss, _, _ = chunked_distill_loss(
                    hs.reshape(-1, hs.shape[-1]), head_s, ht.reshape(-1, ht.shape[-1]), head_t,
                    labels.reshape(-1), ce_weight=cfg.ce_weight, chunk_rows=cfg.kl_chunk, row_mask=rows,
                )
            # the mean over this rank's rows (with a mask: over its loss positions); FSDP2 averages the gradients
            # over the ranks' shares
            frac = mb.shape[0] / self.local_batch if rows is None else int(rows.sum()) / int(mask.sum())
            (loss * frac).backward()
            step_loss += float(loss.detach()) * frac
            del hs, ht, loss
        step_loss = D.all_mean(step_loss, self.world)  # every rank sees (and stops on) the same loss
        if not math.isfinite(step_loss):  # the rules raise: nothing of the update was applied yet
            nonfinite(self.rules, FitState(), self.step_count,
                      f"the loss is not finite at step {self.step_count} ({step_loss}); lower --lr")
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.params], cfg.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.train_s += dt
        if self._segment_steps == 0:  # the first step of this process: compiling, autotuning, allocating
            self.first_step_s.append(dt)
        else:
            self.steady_s += dt
            self.steady_steps += 1
        self._segment_steps += 1
        self.loss_sum += step_loss
        self.loss_count += 1
        return step_loss

    def elapsed(self) -> float:
        return self.elapsed_before + (time.time() - self._t_start)

    def add_eval_point(self) -> dict:
        s = self.step_count
        t_point = time.perf_counter()
        ppl = self.evaluate()
        seconds = {"ppl": time.perf_counter() - t_point}
        row = {"tokens": s * self.tokens_per_step, "step": s, "eval_ppl": ppl,
               "train_loss": self.loss_sum / self.loss_count if self.loss_count else float("nan"),
               "lr": self.lr(max(s - 1, 0)), "elapsed_s": round(self.elapsed(), 3)}
        scores, probe_s = timed_probes(self.probes, self.student)
        row.update(scores)
        seconds.update(probe_s)
        self.curve.append(row)
        self.loss_sum, self.loss_count = 0.0, 0
        train_s, steps = self.train_s - self._train_mark[0], s - self._train_mark[1]
        self._train_mark = (self.train_s, s)
        self.timing.append({"tokens": row["tokens"], "step": s, **{k: round(v, 3) for k, v in seconds.items()},
                            "point": round(time.perf_counter() - t_point, 3), "train": round(train_s, 3),
                            "train_tokens_per_s": round(steps * self.tokens_per_step / train_s, 1) if train_s > 0
                            else None})
        return row

    def _note_time(self, key: str, seconds: float) -> None:
        """Add a write's seconds (the best model, a checkpoint) to the last curve point's timing row."""
        if self.timing:
            last = self.timing[-1]
            last[key] = round(last.get(key, 0.0) + seconds, 3)
            last["point"] = round(last.get("point", 0.0) + seconds, 3)

    def write_curve(self, partial: Work) -> None:
        if self.main:
            partial.write_text("curve.csv", curve_csv(self.curve))
            partial.write_text("timing.csv", timing_csv(self.timing))

    def train_speed(self) -> dict:
        """Training speed: each segment's first step (compiling) apart from the steady steps after it."""
        tps = self.tokens_per_step
        return {"first_step_s": [round(x, 3) for x in self.first_step_s],
                "steady_steps": self.steady_steps, "steady_s": round(self.steady_s, 3),
                "steady_tokens_per_s": round(self.steady_steps * tps / self.steady_s, 1) if self.steady_s > 0
                else None}

    def keep_best(self, row: dict, partial: Work) -> None:
        """Save the student as ``partial/best`` when ``row`` (a curve point) has the lowest ``best_by`` so far."""
        key = self.best_by
        value = row.get(key) if key else None
        if value is None or not math.isfinite(value) or (self.best is not None and value >= self.best[key]):
            return
        self.best = {"tokens": row["tokens"], "step": row["step"], key: value}
        t0 = time.perf_counter()
        if self.main:
            with partial.dir("best") as tmp:
                save_model(self.student, tmp)
                write_json(tmp / "best.json", self.best)
        self._note_time("best_write", time.perf_counter() - t0)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION, "step": self.step_count, "tokens": self.step_count * self.tokens_per_step,
            "curve": self.curve, "loss_sum": self.loss_sum, "loss_count": self.loss_count,
            "elapsed_s": self.elapsed(), "train_s": self.train_s, "teacher_ppl": self.teacher_ppl,
            "teacher_probes": self.teacher_probes, "segments": self.segments, "config": self.settings,
            "best": self.best, "timing": self.timing, "first_step_s": self.first_step_s, "steady_s": self.steady_s,
            "steady_steps": self.steady_steps, "teacher_seconds": self.teacher_seconds,
            "scheduler": {"kind": self.cfg.schedule, "warmup_steps": self.warmup_steps,
                          "total_steps": self.total_steps, "next_step": self.step_count},
        }

    def load_state_dict(self, st: dict) -> None:
        self.step_count, self.curve = st["step"], st["curve"]
        self.loss_sum, self.loss_count = st["loss_sum"], st["loss_count"]
        self.elapsed_before, self.train_s = st["elapsed_s"], st["train_s"]
        self.teacher_ppl = st.get("teacher_ppl", self.teacher_ppl)
        self.teacher_probes = st.get("teacher_probes", self.teacher_probes)
        self.best = st.get("best")
        self.timing = st.get("timing", [])
        self.first_step_s = list(st.get("first_step_s", []))
        self.steady_s, self.steady_steps = st.get("steady_s", 0.0), st.get("steady_steps", 0)
        self.teacher_seconds = st.get("teacher_seconds") or self.teacher_seconds
        self._train_mark = (self.train_s, self.step_count)
        self.segments = st.get("segments", 0) + 1
        self._t_start = time.time()

    def save_checkpoint(self, partial: Work) -> None:
        """Write the model (safetensors) and the resume state; under torchrun every rank takes part in
        gathering the full state dicts and rank 0 alone writes them (the files do not depend on the
        world size)."""
        t0 = time.perf_counter()
        self._save_checkpoint(partial)
        self._note_time("checkpoint_write", time.perf_counter() - t0)
        self.write_curve(partial)

    def _save_checkpoint(self, partial: Work) -> None:
        dist = self.world.distributed
        model_state = D.full_model_state(self.student) if dist else None
        optim_state = D.full_optimizer_state(self.student, self.optimizer)
        if self.main:
            model = self.plain_student(model_state) if dist else self.student
            with partial.dir("checkpoint") as tmp:  # model and resume state belong together
                save_model(model, tmp)
                (tmp / "resume").mkdir()
                # rank 0's RNG only: the data order is a function of (seed, step) and nothing else draws
                # from the RNG in a step (no dropout), so every rank restores rank 0's on resume
                torch.save({"optimizer": optim_state, "rng": rng_state(None if not dist else self.device)},
                           tmp / "resume" / "optimizer.pt")
                write_json(tmp / "resume" / "state.json", self.state_dict())
        D.barrier(self.world)  # nobody goes on (or stops) before the checkpoint is complete

    def resume_from(self, ckpt: Path) -> None:
        """Optimizer, RNG and loop state of a checkpoint (its model weights are already loaded)."""
        st = json.loads((ckpt / "resume" / "state.json").read_text())
        # On the CPU: RNG states must stay CPU tensors; the optimizer moves its own state to the params.
        extra = torch.load(ckpt / "resume" / "optimizer.pt", map_location="cpu", weights_only=False)
        if st.get("version", 1) >= 2:
            D.load_full_optimizer_state(self.student, self.optimizer, extra["optimizer"])
        elif self.world.distributed:
            raise TcalError(f"{ckpt} is a version-1 checkpoint (optimizer state by index), which resumes in one "
                            "process only; resume it without torchrun (its next checkpoint is version 2)")
        else:
            self.optimizer.load_state_dict(extra["optimizer"])
        set_rng_state(extra["rng"], self.device if self.world.distributed else None)
        self.load_state_dict(st)

    def plain_student(self, model_state: dict | None = None):
        """The trained student as one unsharded CPU model (rank 0; None elsewhere). In one process: the
        student itself."""
        if not self.world.distributed:
            return self.student
        model_state = D.full_model_state(self.student) if model_state is None else model_state
        if not self.main:
            return None
        return D.plain_model(self.student_cls, self.student_config, model_state, self._buffers)

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, partial: Work, *, callback: Callable[[int, int], None] | None = None) -> str:
        """Train to the budget (``"done"``) or to a pause limit (``"paused"``, checkpoint written).

        Under torchrun a rank whose peers are gone (a collective fails) stops with a one-line error
        that points at the last checkpoint."""
        try:
            return self._fit(partial, callback)
        except Exception as err:
            if not (self.world.distributed and D.peer_lost(err)):
                raise
            ckpt = checkpoint_dir(partial.path) if partial.path.is_dir() else None
            where = (f"the last checkpoint is in {partial.path}; rerun the same command with --resume" if ckpt
                     is not None else f"no checkpoint was written yet ({partial.path}); rerun the same command")
            raise TcalError(f"rank {self.world.rank}: lost its peers at step {self.step_count} (another rank "
                            f"stopped); {where}") from err

    def _fit(self, partial: Work, callback) -> str:
        cfg, tps, main = self.cfg, self.tokens_per_step, self.main
        if self.teacher_ppl is None:
            t0 = time.perf_counter()
            self.teacher_ppl = self.evaluate(self.teacher)
            self.teacher_seconds["ppl"] = round(time.perf_counter() - t0, 3)
        kept = partial.path / "teacher_scores.json"
        if self.probes and self.teacher_probes is None and kept.is_file():  # a run killed before its first checkpoint
            saved = json.loads(kept.read_text())
            if set(saved.get("probes", {})) == set(self.probes):
                self.teacher_probes = saved["probes"]
                self.teacher_seconds = {**saved.get("seconds", {}), "read_back": True}
        if self.probes and self.teacher_probes is None:
            self.teacher_probes, probe_s = timed_probes(self.probes, self.teacher)
            self.teacher_seconds.update({k: round(v, 3) for k, v in probe_s.items()})
            if main:
                partial.write_json(kept.name, {"probes": self.teacher_probes, "seconds": self.teacher_seconds})
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if not self.curve:
            self.keep_best(self.add_eval_point(), partial)
            self.write_curve(partial)
        bar = tqdm(total=self.total_steps * tps, initial=self.step_count * tps, unit="tok", unit_scale=True,
                   desc="distill", disable=not (cfg.progress and main), dynamic_ncols=True, smoothing=0.1)
        status = "done"
        t_start = time.time()
        self.student.train()
        try:
            with ops.compile_training(self.gdn_compile):
                while self.step_count < self.total_steps:
                    pause = bool(cfg.stop_after_tokens and self.step_count * tps >= cfg.stop_after_tokens) or bool(
                        cfg.max_minutes and time.time() - t_start >= cfg.max_minutes * 60)
                    if cfg.max_minutes:  # clocks differ: the ranks pause together when any of them is due
                        pause = D.any_rank(pause, self.world)
                    if pause:
                        self.save_checkpoint(partial)
                        status = "paused"
                        break
                    self.step()
                    s = self.step_count
                    bar.update(tps)
                    if self.rules.check_due(s):
                        row = self.add_eval_point()
                        self.keep_best(row, partial)
                        self.write_curve(partial)
                        self.student.train()
                        bar.set_postfix(loss=f"{row['train_loss']:.4f}", ppl=f"{row['eval_ppl']:.2f}")
                    if s < self.total_steps and crossed((s - 1) * tps, s * tps, cfg.save_every):
                        self.save_checkpoint(partial)
                    if callback is not None:
                        callback(s, s * tps)
        finally:
            bar.close()
        self.student.eval()
        return status

    def report(self, status: str) -> dict:
        cfg, tps = self.cfg, self.tokens_per_step
        return {
            "status": status, "tokens": self.step_count * tps, "steps": self.step_count,
            "total_steps": self.total_steps, "tokens_per_step": tps,
            "epochs": self.step_count * cfg.batch_size / self.n_windows, "train_windows": self.n_windows,
            "eval": {"data": cfg.eval, "window": int(self.eval_ids.shape[1]), "windows": int(self.eval_ids.shape[0])},
            "teacher_ppl": self.teacher_ppl, "teacher_probes": self.teacher_probes,
            "zero_shot_ppl": self.curve[0]["eval_ppl"] if self.curve else None,
            "final_ppl": self.curve[-1]["eval_ppl"] if self.curve else None,
            "train_tokens_per_s": (self.step_count * tps) / self.train_s if self.train_s > 0 else None,
            "train_s": self.train_s, "elapsed_s": self.elapsed(), "segments": self.segments, "best": self.best,
            "train_speed": self.train_speed(), "timing": self.timing, "teacher_seconds": self.teacher_seconds,
            "peak_memory": peak_memory(self.device), "device": str(self.device),
            "world_size": self.world.world_size, "teacher_placement": self.placement,
            "precision": "bf16 autocast" if self.amp is not None else "fp32", "gdn_compile": self.gdn_compile,
            "trainable_params": sum(p.numel() for _, p in self.params), "warmup_steps": self.warmup_steps,
            "curve": self.curve, "config": self.settings,
        }


def timed_probes(probes: Mapping[str, Callable[[nn.Module], float]], model) -> tuple[dict, dict]:
    """(scores, seconds) of every probe on ``model``. A probe that splits its time (HumanEval: generating and running
    the programs) says so in its ``last_seconds`` attribute after the call: {part: seconds}, reported as NAME_PART."""
    scores, seconds = {}, {}
    for name, probe in probes.items():
        t0 = time.perf_counter()
        scores[name] = probe(model)
        seconds[name] = time.perf_counter() - t0
        parts = getattr(probe, "last_seconds", None)
        if isinstance(parts, dict):
            seconds.update({f"{name}_{k}": float(v) for k, v in parts.items()})
    return scores, seconds


def distill(student, teacher, cfg: TrainOptions, *, tokens: int, train_tokens: np.ndarray, eval_ids: torch.Tensor,
            partial: Work | Path, settings: dict | None = None, teacher_ppl: float | None = None,
            teacher_probes: dict | None = None, teacher_seconds: dict | None = None,
            callback: Callable[[int, int], None] | None = None, world: D.World | None = None,
            probes: Mapping[str, Callable[[nn.Module], float]] | None = None,
            prefix: tuple[int, ...] = (), train_mask: np.ndarray | None = None,
            mix_tokens: np.ndarray | None = None, best_by: str | None = None) -> tuple[dict, object]:
    """Run (or resume, from ``partial``'s checkpoint) a distillation; returns (report, trained student).

    ``student`` may be None when ``partial`` holds a checkpoint (it is loaded from it). A fresh run
    seeds every RNG with ``cfg.seed``; a resumed one restores them. ``settings`` (default: ``cfg``)
    are what a resumption must match. ``world`` (default: one process): under torchrun every rank
    calls this with the same arguments; rank 0 alone writes into ``partial`` and gets the trained
    student back (as one unsharded CPU model; the other ranks get None). ``prefix``: the tokens every training
    window starts with (the tokenizer's BOS, tcal.data.tokens.window_prefix); it joins the settings, so a resumed
    run must pass the same. ``partial``: the run's :class:`~tcal.utils.partial.Work` (a bare path: a fresh one
    there). ``best_by``: the probe whose lowest score picks the best checkpoint (``partial/best``).
    """
    if not isinstance(partial, Work):
        partial = Work(partial, "distill", settings)
    settings = dict(settings if settings is not None else dataclasses.asdict(cfg))
    if prefix:  # windows cut around a BOS are other windows: a resume must cut them the same way
        settings["window_prefix"] = list(prefix)
    world = world if world is not None else D.World(device=resolve_device(cfg.device))
    ckpt = checkpoint_dir(partial.path) if partial.path.is_dir() else None
    resume_state = None
    if ckpt is not None:
        resume_state = json.loads((ckpt / "resume" / "state.json").read_text())
        diff = changed_settings(resume_state["config"], settings)
        if diff:
            raise TcalError(f"cannot resume {partial.path}: settings changed ({', '.join(diff)}); "
                            "resume with the same settings or delete the partial directory")
        student = load_model(ckpt)
        if world.is_main():
            log.info("resuming from %s at step %d (%d tokens)", ckpt, resume_state["step"], resume_state["tokens"])
    if student is None:
        raise TcalError("no student model given and no checkpoint to resume from")
    if world.is_main():
        partial.ensure()
    trainer = Trainer(student, teacher, cfg, tokens=tokens, train_tokens=train_tokens, eval_ids=eval_ids,
                      settings=settings, world=world, probes=probes, prefix=prefix, train_mask=train_mask,
                      mix_tokens=mix_tokens, best_by=best_by)
    trainer.teacher_ppl = teacher_ppl
    trainer.teacher_probes = teacher_probes  # the same prompts score the teacher once for several runs (recover)
    if teacher_seconds:
        trainer.teacher_seconds = dict(teacher_seconds)
    if resume_state is not None:
        trainer.resume_from(ckpt)
    else:
        seed_everything(cfg.seed)
    status = trainer.fit(partial, callback=callback)
    return trainer.report(status), trainer.plain_student()
