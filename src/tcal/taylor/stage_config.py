"""The settings of Phase 2 and of the KL stage (plain data, no torch: ``tcal --help`` builds its parsers from
the budgets that hold them, :mod:`tcal.taylor.budget`), and the fit rules each implies (:mod:`tcal.utils.fit`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tcal.utils.errors import TcalError
from tcal.utils.fit import FitRules
from tcal.utils.schedule import SCHEDULES, Schedule


@dataclass
class AlignConfig:
    """Phase 2 settings; the defaults are the reference's (300 full-batch steps, AdamW)."""

    steps: int = 300
    lr_qkv: float = 1e-4  # W_q, W_k, W_v (+ their biases, short convs, q/k norms)
    lr_gate: float = 1e-3  # W_a, W_b (+ bias), A_log, dt_bias, W_g
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int | None = None  # training sequences per step; None = full batch
    train_sequences: int | None = None  # use only the first n training sequences
    seq_len: int | None = None  # use only the first n tokens of every sequence
    heldout_frac: float = 0.25  # last fraction of the sequences picks the best state; 0 = best training loss
    eval_every: int = 1  # held-out evaluation every n steps (and at the last step)
    on_nonfinite: str = "stop"  # NaN/Inf loss, gradient or weight: "stop" the layer or "skip" the step
    max_nonfinite: int = 10  # with "skip": stop the layer after this many non-finite steps
    seed: int = 0  # minibatch order
    schedule: str = "constant"  # learning rate over the steps: "constant" (reference) or "cosine"
    warmup_steps: int = 0  # linear warm-up before the schedule
    patience: int | None = None  # stop a layer after this many held-out evaluations without a new best
    heldout_max_sequences: int = 64  # cap on the held-out slice: it is evaluated every eval_every steps
    # Which inputs each layer is fitted on (see tcal.taylor.pipeline):
    #   "teacher": the teacher's hidden states (layer-local, the reference);
    #   "student": the partly converted hybrid's own hidden states, layers fitted bottom-up.
    inputs: str = "teacher"
    # What the layer's output is fitted to: "attn" = the teacher's attention output (reference);
    # "residual" = teacher residual after the attention minus the student's residual before it,
    # i.e. the output that puts the hybrid's residual stream back onto the teacher's.
    target: str = "attn"
    # Fit the layers of one teacher pass side by side (tcal.modules.gdn_stack): one batched step for all
    # of them instead of one small step each. The same fits up to float rounding; None: on CUDA, where
    # the small per-layer steps leave the GPU waiting on launches (on CPU it saves nothing).
    concurrent: bool | None = None
    # Reduced-precision fp32 matrix products (runtime.tf32_matmul): TF32 on CUDA, bf16 products on a CPU with AMX /
    # AVX-512 BF16. True: on; False: full fp32; None: the device's default (on for CUDA, off for a CPU).
    tf32: bool | None = None

    def __post_init__(self):
        for name, low in (("lr_qkv", 0), ("lr_gate", 0), ("weight_decay", None), ("grad_clip", None)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 if low == 0 else value >= 0)
            if not ok:
                raise TcalError(f"align {name} must be a finite number {'> 0' if low == 0 else '>= 0'}, got {value!r}")
        if self.steps < 0:
            raise TcalError(f"align steps must be >= 0, got {self.steps}")
        if not 0 <= self.heldout_frac < 1:
            raise TcalError(f"heldout_frac must be in [0, 1), got {self.heldout_frac}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise TcalError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.eval_every < 1:
            raise TcalError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.schedule not in SCHEDULES:
            raise TcalError(f"align schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise TcalError(f"align warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.patience is not None and self.patience < 1:
            raise TcalError(f"align patience must be >= 1 evaluations (or None), got {self.patience}")
        if self.heldout_max_sequences < 1:
            raise TcalError(f"heldout_max_sequences must be >= 1, got {self.heldout_max_sequences}")
        if self.inputs not in ("teacher", "student"):
            raise TcalError(f"align inputs must be 'teacher' or 'student', got {self.inputs!r}")
        if self.target not in ("attn", "residual"):
            raise TcalError(f"align target must be 'attn' or 'residual', got {self.target!r}")
        if self.target == "residual" and self.inputs != "student":
            raise TcalError("the residual-stream target corrects the hybrid's own drift: it needs inputs='student'")

    def fit_rules(self, reset: str = "optimizer") -> FitRules:
        """The rules of one layer's fit; ``reset="moments"`` for layers fitted side by side."""
        return FitRules(Schedule(self.schedule, self.steps, self.warmup_steps), eval_every=self.eval_every,
                        patience=self.patience, on_nonfinite=self.on_nonfinite, max_nonfinite=self.max_nonfinite,
                        reset=reset)


@dataclass
class KLConfig:
    steps: int = 0  # 0 = no KL stage
    lr: float = 3e-4  # AdamW, every GDN parameter
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 4  # training sequences per step
    eval_every: int = 5  # held-out KL every n steps (and at the last step)
    # held-out tokens per forward pass of a held-out check (at least batch_size sequences): without gradients a
    # check fits far more than a training step, and where checks run on the eager chunked path each pass pays
    # its per-chunk kernel launches, so passes of batch_size made the checks a large share of a long stage
    # (docs/results.md, *Calibration time*)
    eval_tokens: int = 32768
    # stop after this many held-out evaluations without a new best, and never before a tenth of the run
    # (patience_frac): late in a long run the held-out KL still falls, slowly and with plateaus, and a fixed
    # few checks cut a long stage off mid-descent (docs/results.md, *Calibration budget*)
    patience: int | None = 4
    patience_frac: float = 0.1
    schedule: str = "cosine"
    warmup_steps: int = 0
    seed: int = 0
    # keep the frozen teacher's final hidden states of the held-out and training sequences instead of
    # a teacher forward per step and per evaluation, as far as they fit runtime.memory_budget
    cache_teacher: bool = True
    tf32: bool | None = None  # as AlignConfig.tf32: True TF32 on CUDA / bf16 products on a bf16 CPU, False fp32
    # The recall mix on the stage's sequences (tcal.data.recall; 0 = off): this share of the training and held-out
    # calibration sequences ends with a copy of an earlier recall_span-token span of itself, so the KL, and the
    # held-out KL that picks the state kept, also ask for copying from far back in the context.
    recall_frac: float = 0.0
    recall_span: int = 256

    def __post_init__(self):
        if self.steps < 0:
            raise TcalError(f"KL stage steps must be >= 0, got {self.steps}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise TcalError(f"KL stage lr must be a finite number > 0, got {self.lr!r}")
        for name in ("batch_size", "eval_every", "eval_tokens"):
            if getattr(self, name) < 1:
                raise TcalError(f"KL stage {name} must be >= 1, got {getattr(self, name)}")
        if self.patience is not None and self.patience < 1:
            raise TcalError(f"KL stage patience must be >= 1 evaluations (or None), got {self.patience}")
        if not (isinstance(self.patience_frac, (int, float)) and 0 <= self.patience_frac <= 1):
            raise TcalError(f"KL stage patience_frac must be a share of the run in [0, 1], got {self.patience_frac!r}")
        if self.schedule not in SCHEDULES:
            raise TcalError(f"KL stage schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise TcalError(f"KL stage warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (isinstance(self.recall_frac, (int, float)) and 0 <= self.recall_frac <= 1):
            raise TcalError(f"KL stage recall_frac must be a share in [0, 1], got {self.recall_frac!r}")
        if self.recall_span < 1:
            raise TcalError(f"KL stage recall_span must be >= 1 tokens, got {self.recall_span}")

    def fit_rules(self) -> FitRules:
        """The stage's rules: a non-finite KL stops it (the best state so far is kept)."""
        return FitRules(Schedule(self.schedule, self.steps, self.warmup_steps), eval_every=self.eval_every,
                        patience=self.patience, patience_frac=self.patience_frac, on_nonfinite="stop")

    def stale_limit(self) -> int | None:
        """Held-out evaluations without a new best that end the stage (None: it never stops early)."""
        return self.fit_rules().stale_limit()
