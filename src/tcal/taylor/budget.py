"""Named calibration budgets and the command-line flags that pick and override them.

A budget says how many tokens Taylor-Calibrate reads (``windows`` x ``window``) and how Phase 2 and the KL
stage step over them. Plain data, no torch: every command's parser is built from :class:`CalibArgs`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tcal.taylor.stage_config import AlignConfig, KLConfig
from tcal.utils.command_config import arg
from tcal.utils.errors import TcalError


@dataclass(frozen=True)
class CalibBudget:
    name: str
    windows: int  # calibration sequences (Phase 2 and the KL stage hold out the last of them)
    window: int  # tokens per sequence
    align: AlignConfig
    kl: KLConfig  # used by the inits that have a KL stage
    # the KL stage's chat windows where it fits chat-format tasks (--kl-data chat:CODE): how many (a quarter held
    # out) of how many tokens
    chat_windows: int = 20
    chat_window: int = 512


# "reference" is the paper's (4 x 256 tokens, 300 full-batch steps); "large" spends the tokens a GPU makes cheap
# (minibatches, a cosine schedule, held-out checks every 5 steps).
_LARGE_ALIGN = AlignConfig(steps=300, batch_size=16, eval_every=5, schedule="cosine", warmup_steps=10)
CALIB_BUDGETS: dict[str, CalibBudget] = {b.name: b for b in (
    CalibBudget("reference", windows=4, window=256, align=AlignConfig(steps=300), kl=KLConfig(steps=40, batch_size=3)),
    # 16x the reference's tokens for a CPU: 32 x 512 tokens, Phase 2 in minibatches of 2 x 512 (held-out check every
    # 10 steps), a KL stage of 40 steps of 2 x 512 at lr 3e-5: at the stage's usual 3e-4 the half-converted coder's
    # held-out KL rose and the stage kept its first state (docs/results.md, *A CPU budget for half converted*)
    CalibBudget("medium", windows=32, window=512,
                align=AlignConfig(steps=300, batch_size=2, eval_every=10, schedule="cosine", warmup_steps=10),
                kl=KLConfig(steps=40, lr=3e-5, batch_size=2, eval_every=10)),
    # 300 KL steps: 2 % lower held-out PPL than 100 on each of three domains at 50 % converted, for 72 s more on an
    # H200 (docs/results.md, *Calibration budget*)
    CalibBudget("large", windows=512, window=512, align=_LARGE_ALIGN, kl=KLConfig(steps=300, batch_size=8),
                chat_windows=160, chat_window=1024),
    # 1M tokens with the KL stage's steps scaled to the data: the best measured taylor, for a longer conversion than
    # "large" (docs/results.md, *Calibration budget*); wiki:calib alone is too small for it, the default mixture is not
    CalibBudget("xl", windows=2048, window=512, align=_LARGE_ALIGN, kl=KLConfig(steps=1200, batch_size=8),
                chat_windows=160, chat_window=1024),
    # for long-context retrieval: 64 windows of 4K tokens (the passkey's lengths), 90 KL steps with the recall mix
    # (half of the stage's windows end with a copy of an earlier span of themselves). With 300 KL steps PPL was
    # lower and the 4K passkey was not (docs/results.md, *Long-context retrieval*)
    CalibBudget("long", windows=64, window=4096,
                align=AlignConfig(steps=300, batch_size=2, eval_every=5, schedule="cosine", warmup_steps=10),
                kl=KLConfig(steps=90, batch_size=1, recall_frac=0.5)),
)}


@dataclass
class CalibArgs:
    calib: str = arg("auto", "calibration corpus (Taylor-Calibrate inits only), or a mixture a+b (equal shares, "
                             "interleaved); disjoint from --eval. auto: the teacher's own default, "
                             "wiki:calib+shakespeare:calib, and code:calib+wiki:calib for the code teachers "
                             "(qwen2.5-coder-*, a copy of one, or a hybrid made from one)")
    calib_budget: str = arg("auto", "calibration budget: reference (4 x 256 tokens, 300 full-batch Phase 2 steps), "
                                    "medium (32 x 512, minibatches of 2, 40 KL steps at lr 3e-5: under an hour for a "
                                    "0.5B teacher on two CPU cores), large (512 x 512, minibatches of 16, cosine "
                                    "schedule), xl (2048 x 512, 1,200 KL "
                                    "steps; needs a 1M-token corpus, e.g. the default mixture), long (64 x 4096, 90 KL "
                                    "steps with the recall mix: for long-context retrieval, on a GPU), or auto "
                                    "(reference on CPU, large on a GPU); --calib-window/--calib-windows/--align-steps override it",
                            choices=("auto", *CALIB_BUDGETS))
    calib_window: int | None = arg(None, "calibration sequence length in tokens (default: the budget's)")
    calib_windows: int | None = arg(None, "calibration sequences, the first N windows (default: the budget's); "
                                          "Phase 2 holds out the last quarter to pick its best state")
    align_steps: int | None = arg(None, "Phase 2 AdamW steps per layer (default: the budget's, 300)")
    kl_steps: int | None = arg(None, "KL-stage steps of the inits that have one, e.g. taylor (default: the "
                                     "budget's, 40 reference / 40 medium / 300 large / 1,200 xl / 90 long)")
    kl_recall_frac: float | None = arg(None, "the KL stage's recall mix: this share of its calibration windows ends "
                                             "with a copy of an earlier span of itself (for long-context retrieval; "
                                             "0 = off; default: the budget's, 0.5 long, 0 the others)")
    kl_recall_span: int = arg(256, "tokens in each copied span of --kl-recall-frac (at most half the window)")
    kl_data: str = arg("auto", "what the KL stage fits on: calib (the calibration windows), chat:CODE (chat-format "
                               "code tasks of the corpus CODE, e.g. chat:code:calib, in the teacher's chat template, "
                               "with their own functions as the answers), answers:FILE (the teacher's own answers: "
                               "a samples.jsonl of `tcal instruct`) or answers (those that ship with tcal for a "
                               "built-in code teacher); the KL is on the answers. auto: the teacher's default, calib "
                               "for every built-in teacher")
    kl_windows: int | None = arg(None, "chat windows of the KL stage with --kl-data chat:CODE, a quarter held out "
                                       "(default: the budget's, 20 x 512 tokens reference, 160 x 1024 large and xl)")
    fit_matmul: str = arg("auto", "matrix products of Phase 2 and the KL stage: fast (TF32 on a CUDA GPU, bf16 "
                                   "products with fp32 sums on a CPU with AMX or AVX-512 BF16, fp32 on other CPUs), "
                                   "fp32, or auto (fast on a GPU; on a CPU, fp32 unless the teacher's CPU recipe "
                                   "says fast)",
                          choices=("auto", "fast", "fp32"))

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
        kl_data = self.kl_data.strip()
        if kl_data not in ("auto", "calib", "answers") and not any(
                kl_data.startswith(p) and len(kl_data) > len(p) for p in ("chat:", "answers:")):
            raise TcalError(f"--kl-data must be auto, calib, chat:CODE (e.g. chat:code:calib), answers or "
                            f"answers:FILE, got {self.kl_data!r}")
        if self.kl_windows is not None and self.kl_windows < 2:
            raise TcalError(f"--kl-windows must be at least 2 (a quarter is held out), got {self.kl_windows}")
        if self.chat_kl() and self.kl_recall_frac:
            raise TcalError(f"--kl-recall-frac copies spans into the calibration windows, and --kl-data {kl_data} "
                            "fits chat windows whose answers a copy would break: use one or the other")
        if self.fit_matmul not in ("auto", "fast", "fp32"):
            raise TcalError(f"--fit-matmul must be auto, fast or fp32, got {self.fit_matmul!r}")
        if self.calib_budget not in ("auto", *CALIB_BUDGETS):
            raise TcalError(f"--calib-budget must be auto, {' or '.join(CALIB_BUDGETS)}; got {self.calib_budget!r}")

    def budget_name(self, device: str) -> str:
        """The budget's name on ``device``: ``auto`` is ``reference`` on a CPU, ``large`` on a GPU."""
        if self.calib_budget == "auto":
            return "reference" if str(device).startswith("cpu") else "large"
        return self.calib_budget

    def recall_on(self, device: str) -> bool:
        """Whether the KL stage mixes recall copies into its windows on ``device`` (the flag, else the budget's)."""
        if self.kl_recall_frac is not None:
            return self.kl_recall_frac > 0
        budget = CALIB_BUDGETS.get(self.budget_name(device))  # an unknown name is check_calib's error
        return budget is not None and budget.kl.recall_frac > 0

    def budget(self, device: str) -> CalibBudget:
        """The budget on ``device`` (cpu, cuda, cuda:N), with the flags' overrides (new configs: the named
        budget itself is left as it is)."""
        name = self.budget_name(device)
        b = CALIB_BUDGETS[name]
        align, kl = b.align, b.kl
        if self.align_steps is not None:
            align = dataclasses.replace(align, steps=self.align_steps)
        if self.kl_steps is not None:
            kl = dataclasses.replace(kl, steps=self.kl_steps)
        if self.fit_matmul != "auto":
            fast = self.fit_matmul == "fast"
            align, kl = dataclasses.replace(align, tf32=fast), dataclasses.replace(kl, tf32=fast)
        window = self.calib_window or b.window
        recall = kl.recall_frac if self.kl_recall_frac is None else self.kl_recall_frac  # the flag's, 0 included
        if recall > 0:
            # checked here, where the budget's window is known, rather than deep in the KL stage after Phase 2
            if window < 2 * self.kl_recall_span:
                raise TcalError(f"--kl-recall-span {self.kl_recall_span} needs calibration windows of at least "
                                f"{2 * self.kl_recall_span} tokens; the {name} budget's are {window}: set --calib-window")
            kl = dataclasses.replace(kl, recall_frac=recall, recall_span=self.kl_recall_span)
        else:
            kl = dataclasses.replace(kl, recall_frac=0.0)
        return CalibBudget(name, self.calib_windows or b.windows, window, dataclasses.replace(align), kl,
                           self.kl_windows or b.chat_windows, b.chat_window)

    def chat_kl(self) -> bool:
        """Whether the KL stage fits chat windows of its own (``chat:CODE``, ``answers``, ``answers:FILE``) rather
        than the calibration windows."""
        return self.kl_data.strip().startswith(("chat:", "answers"))

    def kl_options(self, budget: CalibBudget) -> dict:
        """convert_with_record's KL-stage text arguments for ``budget``: the calibration windows, or chat windows
        (``--kl-data chat:CODE``) unless the budget mixes recall copies into the stage (long)."""
        if not self.chat_kl() or budget.kl.recall_frac > 0:
            return {}
        return {"kl_data": self.kl_data, "kl_windows": (budget.chat_windows, budget.chat_window)}
