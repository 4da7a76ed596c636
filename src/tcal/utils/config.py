"""Typed stage configs <-> argparse flags, one dataclass per stage.

Each dataclass field becomes ``--field-name``; the field's ``metadata["help"]`` is its help text.
The resolved config is written into every output directory (``tcal_config.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from tcal.utils.errors import TcalError


def arg(default, help: str, **extra):
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def _scalar_type(kind):
    """``int | None`` -> int."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if args else kind


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help strings
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        base = _scalar_type(kind)
        parser.add_argument(flag, dest=f.name, type=base if base in (int, float, str) else str, default=default,
                            choices=f.metadata.get("choices"),
                            help=f"{help_text} (default: {str(default).replace('%', '%%')})")


def from_args(cls, ns: argparse.Namespace, **overrides):
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


# ---------------------------------------------------------------------------------------------
# Field groups shared by the commands (each defined once; a command that needs another default
# redefines the field and says why in its help)
# ---------------------------------------------------------------------------------------------

TEACHER_HELP = "teacher: built-in name (smollm2-135m), local HF directory, .gguf file or hub id"


@dataclasses.dataclass
class TeacherArgs:
    teacher: str = arg("smollm2-135m", TEACHER_HELP)


@dataclasses.dataclass
class DeviceArgs:
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")


@dataclasses.dataclass
class OutArgs:
    overwrite: bool = arg(False, "replace a finished output of the same command in --out (only tcal's own files "
                                 "are replaced; any other file there is kept)")


# The calibration text of every calibrated init unless --calib says otherwise: Wikipedia and Shakespeare in equal
# shares. It generalises better than wiki:calib alone to text neither calibrates on, for a little on wiki:eval
# (README, *Calibration text*); neither part is in the default training pool, and both are disjoint from every
# :eval split.
DEFAULT_CALIB = "wiki:calib+shakespeare:calib"

# Named calibration budgets: how many tokens Taylor-Calibrate reads and how Phase 2 steps over
# them. "reference" is the paper's (4 x 256 tokens, 300 full-batch steps); "large" spends the
# tokens a GPU makes cheap (minibatches, a cosine schedule, held-out checks every 5 steps).
CALIB_BUDGETS = {
    "reference": dict(windows=4, window=256, align=dict(steps=300), kl=dict(steps=40, batch_size=3)),
    "large": dict(windows=512, window=512,
                  align=dict(steps=300, batch_size=16, eval_every=5, schedule="cosine", warmup_steps=10),
                  # 300 KL steps: 2 % lower held-out PPL than 100 on each of three domains at 50 % converted,
                  # for 72 s more on an H200 (README, "Taylor-Calibrate that wins")
                  kl=dict(steps=300, batch_size=8)),
    # 1M tokens with the KL stage's steps scaled to the data: the best measured taylor, for a longer conversion
    # than "large" (README, *Budget*); wiki:calib alone is too small for it, the default mixture is not
    "xl": dict(windows=2048, window=512,
               align=dict(steps=300, batch_size=16, eval_every=5, schedule="cosine", warmup_steps=10),
               kl=dict(steps=1200, batch_size=8)),
    # for long-context retrieval: 64 windows of 4K tokens (the passkey's lengths), 90 KL steps with the recall mix
    # (half of the stage's windows end with a copy of an earlier span of themselves). With 300 KL steps PPL was
    # lower and the 4K passkey was not (README, *The recall mix in the KL stage*)
    "long": dict(windows=64, window=4096,
                 align=dict(steps=300, batch_size=2, eval_every=5, schedule="cosine", warmup_steps=10),
                 kl=dict(steps=90, batch_size=1, recall_frac=0.5)),
}


@dataclasses.dataclass
class CalibArgs:
    calib: str = arg(DEFAULT_CALIB, "calibration corpus (Taylor-Calibrate inits only), or a mixture a+b (equal "
                                   "shares, interleaved); disjoint from --eval")
    calib_budget: str = arg("auto", "calibration budget: reference (4 x 256 tokens, 300 full-batch Phase 2 steps), "
                                    "large (512 x 512, minibatches of 16, cosine schedule), xl (2048 x 512, 1,200 KL "
                                    "steps; needs a 1M-token corpus, e.g. the default mixture), long (64 x 4096, 90 KL "
                                    "steps with the recall mix: for long-context retrieval, on a GPU), or auto "
                                    "(reference on CPU, large on a GPU); --calib-window/--calib-windows/--align-steps override it",
                            choices=("auto", *CALIB_BUDGETS))
    calib_window: int | None = arg(None, "calibration sequence length in tokens (default: the budget's)")
    calib_windows: int | None = arg(None, "calibration sequences, the first N windows (default: the budget's); "
                                          "Phase 2 holds out the last quarter to pick its best state")
    align_steps: int | None = arg(None, "Phase 2 AdamW steps per layer (default: the budget's, 300)")
    kl_steps: int | None = arg(None, "KL-stage steps of the inits that have one, e.g. taylor (default: the "
                                     "budget's, 40 reference / 300 large / 1,200 xl / 90 long)")
    kl_recall_frac: float | None = arg(None, "the KL stage's recall mix: this share of its calibration windows ends "
                                             "with a copy of an earlier span of itself (for long-context retrieval; "
                                             "0 = off; default: the budget's, 0.5 long, 0 the others)")
    kl_recall_span: int = arg(256, "tokens in each copied span of --kl-recall-frac (at most half the window)")

    def check_calib(self) -> None:
        if self.calib_window is not None and self.calib_window < 2:
            raise TcalError(f"--calib-window must be at least 2 tokens, got {self.calib_window}")
        if self.calib_windows is not None and self.calib_windows < 2:
            raise TcalError(f"--calib-windows must be at least 2 (Phase 2 holds out the last quarter), "
                            f"got {self.calib_windows}")
        if self.align_steps is not None and self.align_steps < 0:
            raise TcalError(f"--align-steps must be >= 0, got {self.align_steps}")
        if self.kl_steps is not None and self.kl_steps < 0:
            raise TcalError(f"--kl-steps must be >= 0, got {self.kl_steps}")
        if self.kl_recall_frac is not None and not 0.0 <= self.kl_recall_frac <= 1.0:
            raise TcalError(f"--kl-recall-frac must be in [0, 1], got {self.kl_recall_frac}")
        if self.kl_recall_span < 1:
            raise TcalError(f"--kl-recall-span must be at least 1, got {self.kl_recall_span}")
        if self.kl_recall_frac and self.calib_window is not None and self.calib_window < 2 * self.kl_recall_span:
            raise TcalError(f"--kl-recall-span {self.kl_recall_span} needs --calib-window of at least "
                            f"{2 * self.kl_recall_span} tokens, got {self.calib_window}")
        if self.calib_budget not in ("auto", *CALIB_BUDGETS):
            raise TcalError(f"--calib-budget must be auto, {' or '.join(CALIB_BUDGETS)}; got {self.calib_budget!r}")

    def budget(self, device: str) -> tuple[str, int, int, dict, dict]:
        """(budget name, windows, window, AlignConfig keywords, KLConfig keywords) on ``device``
        (cpu, cuda, cuda:N)."""
        name = self.calib_budget
        if name == "auto":
            name = "reference" if str(device).startswith("cpu") else "large"
        b = CALIB_BUDGETS[name]
        align, kl = dict(b["align"]), dict(b["kl"])
        if self.align_steps is not None:
            align["steps"] = self.align_steps
        if self.kl_steps is not None:
            kl["steps"] = self.kl_steps
        window = self.calib_window or b["window"]
        recall = kl.pop("recall_frac", 0.0)
        if self.kl_recall_frac is not None:  # the flag over the budget's, 0 included
            recall = self.kl_recall_frac
        if recall > 0:
            # checked here, where the budget's window is known, rather than deep in the KL stage after Phase 2
            if window < 2 * self.kl_recall_span:
                raise TcalError(f"--kl-recall-span {self.kl_recall_span} needs calibration windows of at least "
                                f"{2 * self.kl_recall_span} tokens; the {name} budget's are {window}: set --calib-window")
            kl.update(recall_frac=recall, recall_span=self.kl_recall_span)
        return (name, self.calib_windows or b["windows"], window, align, kl)


@dataclasses.dataclass
class EvalArgs:
    eval: str = arg("wiki:eval", "held-out evaluation corpus (never used for calibration or training)")
    eval_window: int = arg(512, "evaluation window length in tokens")
    eval_windows: int = arg(64, "evaluation windows: the first N, non-overlapping (64 x 512 is the full protocol)")

    def eval_list(self) -> list[str]:
        """``--eval a,b,c`` -> [a, b, c]: every table reports each of these held-out domains."""
        specs = [s.strip() for s in self.eval.split(",")] if "," in self.eval and "\n" not in self.eval else [self.eval]
        return specs

    def check_eval(self) -> None:
        specs = self.eval_list()
        if any(not s for s in specs) or len(set(specs)) != len(specs):
            raise TcalError(f"--eval {self.eval!r} has an empty or repeated domain; e.g. --eval wiki:eval,sotu:eval")
        if self.eval_window < 2:
            raise TcalError(f"--eval-window must be at least 2 tokens, got {self.eval_window}")
        if self.eval_windows < 1:
            raise TcalError(f"--eval-windows must be at least 1, got {self.eval_windows}")


@dataclasses.dataclass
class GDNArgs:
    use_short_conv: bool = arg(False, "causal depthwise short conv (width 4) before q/k/v activations")
    output_gate: bool = arg(True, "SiLU output gate (W_g) on the per-head RMSNorm")
