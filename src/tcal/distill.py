"""End-to-end distillation of a hybrid against its frozen teacher (``tcal distill``).

Objective. Forward KL(teacher || student) over the full vocabulary at every position of every
training sequence, optionally mixed with next-token cross-entropy::

    loss = (1 - w) * mean_tokens KL(p_teacher || p_student) + w * mean_tokens CE(next token)

The logits are never materialised for the whole batch: both models run up to their final
norm (``model.model``), and the LM heads, log-softmaxes and the loss are computed over chunks
of ``kl_chunk`` token rows inside ``torch.utils.checkpoint``, so at any time only one chunk's
``rows x vocab`` fp32 tensors exist, in the forward and in the backward pass (the backward
recomputes the chunk's logits, teacher included, from the saved hidden states).

Data. A 1-D token stream (a :mod:`tcal.pool` directory, a ``.npy`` file or any corpus spec,
tokenised by :func:`tcal.data.corpus_tokens`) is cut into non-overlapping windows of
``seq_len`` tokens (``stride = seq_len``, the windows :func:`tcal.data.token_windows` gives).
Training sample ``i = step * batch_size + b`` is window ``perm_e[i mod n]`` of epoch
``e = i div n``, with ``perm_e = default_rng([seed, e]).permutation(n)``: the data order is a
function of (seed, step) alone, so a resumed run sees exactly the batches an uninterrupted
run sees. Packed data has no padding: every step trains on ``batch_size * seq_len`` tokens,
and that is what the token counter adds.

Outputs. ``OUT.partial/`` holds the run while it is in progress (``checkpoint/`` = the model
as safetensors + ``resume/`` with optimizer, RNG and loop state; ``curve.csv`` for watching).
At the end ``OUT/`` is written in one rename: final model (safetensors) + tokenizer,
``curve.csv``, ``curve.png``, ``report.json``, ``report.md``, ``tcal_config.json``; then the
partial directory is removed.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from tcal.atomic import atomic_dir, write_json
from tcal.config import arg
from tcal.errors import TcalError

log = logging.getLogger(__name__)

__all__ = [
    "CURVE_FIELDS",
    "DistillConfig",
    "TrainOptions",
    "WindowOrder",
    "chunked_distill_loss",
    "distill",
    "eval_windows_for",
    "load_token_stream",
    "lr_at",
    "plot_curve",
    "read_curve",
    "run_distill",
]

SCHEDULES = ("constant", "cosine")
TRAIN_SETS = ("gdn", "all")
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE_MODES = ("auto", "on", "off")
CURVE_FIELDS = ("tokens", "step", "eval_ppl", "train_loss", "lr", "elapsed_s")
ADAM_BETAS = (0.9, 0.95)
STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainOptions:
    """Distillation settings shared by ``tcal distill`` and ``tcal recover``."""

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
    kl_chunk: int = arg(1024, "token rows per chunk of the vocabulary-wide KL (bounds the logits' memory)")
    train: str = arg("gdn", "parameters that train: the GDN layers only, or all", choices=TRAIN_SETS)
    gradient_checkpointing: bool = arg(False, "recompute decoder layers in the backward pass (less memory, slower)")
    compile: str = arg("auto", "torch.compile the chunked GDN training path: auto = on CUDA when fla's backward "
                               "is unavailable (2.2x faster GDN forward + backward on an H200), off on CPU",
                       choices=COMPILE_MODES)
    eval: str = arg("wiki:eval", "held-out corpus for the perplexity curve (a corpus spec, pool or .npy)")
    eval_window: int = arg(512, "evaluation window length in tokens")
    eval_windows: int = arg(16, "number of evaluation windows (the first N, non-overlapping)")
    eval_every: int = arg(1_000_000, "evaluate every N training tokens (and at 0 tokens and at the end)")
    eval_early: int = arg(4, "extra early evaluations at eval-every/2, /4, ... (this many)")
    save_every: int = arg(5_000_000, "checkpoint (for --resume) every N training tokens")
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")
    precision: str = arg("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16", choices=PRECISIONS)
    teacher_dtype: str = arg("float32", "teacher weights dtype: float32 or bfloat16")
    seed: int = arg(0, "seed of the data order (a window permutation per epoch) and of torch's RNG")
    resume: bool = arg(False, "continue an interrupted run from OUT.partial/ (the same settings)")
    max_minutes: float = arg(0.0, "checkpoint and stop after this many minutes (rerun with --resume); 0 = no limit")
    stop_after_tokens: int = arg(0, "checkpoint and stop once this many tokens are done (rerun with --resume); "
                                    "0 = never")
    progress: bool = arg(True, "progress bars")


@dataclass
class DistillConfig(TrainOptions):
    hybrid: str = arg("runs/convert", "the hybrid to distill: a directory written by `tcal convert`")
    teacher: str = arg("smollm2-135m", "teacher: built-in name, local HF directory, .gguf file or hub id")
    data: str = arg("", "training tokens: a token pool directory (tcal.pool), a .npy file or a corpus spec")
    tokens: int = arg(1_000_000, "training-token budget (rounded up to whole steps)")
    out: str = arg("runs/distill", "output directory (written atomically; progress in OUT.partial/)")


# Fields that may differ between a run and its resumption.
_RESUME_FREE = {"resume", "max_minutes", "stop_after_tokens", "progress", "out", "device", "compile"}


def changed_settings(saved: dict, now: dict, free=_RESUME_FREE) -> list[str]:
    """The settings, other than ``free`` ones, whose values differ between a saved run and now."""
    keys = (set(saved) | set(now)) - set(free)
    return sorted(k for k in keys if saved.get(k) != now.get(k))


def _check_config(cfg: TrainOptions, tokens: int) -> None:
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
    if cfg.kl_chunk < 1:
        raise TcalError(f"--kl-chunk must be positive, got {cfg.kl_chunk}")
    if cfg.lr <= 0:
        raise TcalError(f"--lr must be positive, got {cfg.lr}")
    if cfg.warmup < 0:
        raise TcalError(f"--warmup must be >= 0, got {cfg.warmup}")
    if cfg.eval_every < 1 or cfg.save_every < 1:
        raise TcalError("--eval-every and --save-every must be positive numbers of tokens")
    if cfg.eval_windows < 1 or cfg.eval_window < 2:
        raise TcalError("--eval-windows must be >= 1 and --eval-window >= 2")
    if cfg.schedule not in SCHEDULES:
        raise TcalError(f"unknown --schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if cfg.train not in TRAIN_SETS:
        raise TcalError(f"unknown --train {cfg.train!r}; choose one of {', '.join(TRAIN_SETS)}")
    if cfg.precision not in PRECISIONS:
        raise TcalError(f"unknown --precision {cfg.precision!r}; choose one of {', '.join(PRECISIONS)}")


# ---------------------------------------------------------------------------------------------
# The chunked KL / CE loss
# ---------------------------------------------------------------------------------------------


def _weight_bias(head) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(head, nn.Linear):
        return head.weight, head.bias
    if isinstance(head, tuple):
        return head[0], (head[1] if len(head) > 1 else None)
    if isinstance(head, torch.Tensor):
        return head, None
    raise TcalError(f"an LM head must be an nn.Linear or a weight tensor, got {type(head).__name__}")


def _chunk_terms(hs, ws, bs, ht, wt, bt, labels, kl_scale: float, ce_scale: float):
    """One chunk of rows: (scaled loss, KL sum, CE sum). Logits and softmaxes in fp32."""
    logp_s = torch.log_softmax(F.linear(hs, ws, bs).float(), dim=-1)
    with torch.no_grad():
        logp_t = torch.log_softmax(F.linear(ht, wt, bt).float(), dim=-1)
        p_t = logp_t.exp()
        neg_entropy = (p_t * logp_t).sum(-1)
    kl = (neg_entropy - (p_t * logp_s).sum(-1)).sum()
    if labels is not None:
        valid = labels >= 0
        nll = -logp_s.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
        ce = torch.where(valid, nll, torch.zeros_like(nll)).sum()
    else:
        ce = kl.new_zeros(())
    loss = kl * kl_scale + ce * ce_scale
    return loss, kl.detach(), ce.detach()


def chunked_distill_loss(
    student_hidden: torch.Tensor,  # (N, D) after the student's final norm
    student_head,  # nn.Linear (V <- D) or its weight
    teacher_hidden: torch.Tensor,  # (N, D') after the teacher's final norm, no grad
    teacher_head,
    labels: torch.Tensor | None = None,  # (N,) next-token ids, -100 where there is none
    *,
    ce_weight: float = 0.0,
    chunk_rows: int = 1024,
    use_checkpoint: bool = True,
) -> tuple[torch.Tensor, float, float]:
    """``(loss, mean KL, mean CE)`` with ``loss = (1 - w) mean KL(t || s) + w mean CE``.

    KL is averaged over all N rows, CE over the rows with a label. Rows are processed
    ``chunk_rows`` at a time; with ``use_checkpoint`` (and grad enabled) each chunk is a
    ``torch.utils.checkpoint`` region, so only its inputs are kept for the backward pass and
    peak memory is O(chunk_rows x vocab), not O(N x vocab).
    """
    if student_hidden.dim() != 2 or teacher_hidden.dim() != 2 or student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise TcalError(
            f"hidden states must be (N, D) with the same N, got {tuple(student_hidden.shape)} and "
            f"{tuple(teacher_hidden.shape)}"
        )
    if chunk_rows < 1:
        raise TcalError(f"chunk_rows must be positive, got {chunk_rows}")
    n = student_hidden.shape[0]
    ws, bs = _weight_bias(student_head)
    wt, bt = _weight_bias(teacher_head)
    if ws.shape[0] != wt.shape[0]:
        raise TcalError(f"student and teacher vocabularies differ ({ws.shape[0]} vs {wt.shape[0]}); "
                        "distil from the teacher the hybrid was converted from")
    use_labels = labels if ce_weight > 0 else None
    if ce_weight > 0 and labels is None:
        raise TcalError("ce_weight > 0 needs labels (next-token ids)")
    n_ce = int((use_labels >= 0).sum()) if use_labels is not None else 0
    kl_scale = (1.0 - ce_weight) / n
    ce_scale = ce_weight / n_ce if n_ce else 0.0
    ckpt = use_checkpoint and torch.is_grad_enabled()
    loss = None
    kl_sum = torch.zeros((), dtype=torch.float64, device=student_hidden.device)
    ce_sum = torch.zeros((), dtype=torch.float64, device=student_hidden.device)
    for i in range(0, n, chunk_rows):
        rows = slice(i, i + chunk_rows)
        args = (student_hidden[rows], ws, bs, teacher_hidden[rows], wt, bt,
                None if use_labels is None else use_labels[rows], kl_scale, ce_scale)
        if ckpt:
            part, kl_c, ce_c = _checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, kl_c, ce_c = _chunk_terms(*args)
        loss = part if loss is None else loss + part
        kl_sum += kl_c.double()
        ce_sum += ce_c.double()
    return loss, kl_sum.item() / n, (ce_sum.item() / n_ce if n_ce else float("nan"))


def lm_parts(model) -> tuple[nn.Module, nn.Module]:
    """(decoder up to the final norm, LM head) of an HF causal LM (``model.model``, ``lm_head``)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model") or "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or not isinstance(head, nn.Linear):
        raise TcalError(
            f"{type(model).__name__} does not expose its decoder and LM head (model.model, lm_head); "
            "distillation supports HF decoder-only causal LMs"
        )
    if getattr(model.config, "final_logit_softcapping", None):
        raise TcalError(f"{type(model).__name__} soft-caps its logits, which the chunked KL does not apply")
    return base, head


def _hidden(base: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = base(input_ids=ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def _is_pool(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()


def load_token_stream(data, tokenizer=None, *, cache_dir=None) -> tuple[np.ndarray, dict]:
    """A 1-D token array and a description of where it came from.

    ``data``: an array / tensor of ids, a :mod:`tcal.pool` directory (memory-mapped), a ``.npy``
    file, or a corpus spec / path (tokenised by :func:`tcal.data.corpus_tokens`, which needs
    ``tokenizer``).
    """
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    if isinstance(data, np.ndarray):
        arr = data.reshape(-1)
        return arr, {"kind": "array", "name": f"array[{arr.size}]", "tokens": int(arr.size)}
    if isinstance(data, os.PathLike):
        data = os.fspath(data)
    if not isinstance(data, str) or not data.strip():
        raise TcalError("no training data given; pass --data POOL_DIR (tcal.pool), a .npy token file or a corpus spec")
    path = Path(data).expanduser()
    if _is_pool(path):
        from tcal import pool

        arr = pool.load_pool(path)
        manifest = pool.read_manifest(path)
        if tokenizer is not None:
            from tcal.data import tokenizer_id

            want = (manifest.get("tokenizer") or {}).get("id")
            if want and want != tokenizer_id(tokenizer):
                raise TcalError(
                    f"pool {path} was tokenised by tokenizer {want}, not the teacher's ({tokenizer_id(tokenizer)}); "
                    "build the pool with the teacher's tokenizer"
                )
        return arr, {"kind": "pool", "name": str(path), "tokens": int(arr.size),
                     "sources": [s.get("name") for s in manifest.get("sources", []) if s.get("tokens")]}
    if path.is_file() and path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r").reshape(-1)
        return arr, {"kind": "npy", "name": str(path), "tokens": int(arr.size)}
    if tokenizer is None:
        raise TcalError(f"data {data!r} is text, which needs a tokenizer; save one with the model or pass token ids")
    from tcal.data import as_corpus, corpus_tokens

    corpus = as_corpus(data, cache_dir=cache_dir)
    arr, _ = corpus_tokens(corpus, tokenizer, cache_dir=cache_dir)
    return arr, {"kind": "corpus", "name": corpus.name, "tokens": int(arr.size),
                 "content_hash": corpus.content_hash[:16]}


def eval_windows_for(data, tokenizer, window: int, windows: int, *, cache_dir=None) -> tuple[torch.Tensor, str]:
    """The first ``windows`` non-overlapping windows of ``window`` tokens of ``data`` (the
    :mod:`tcal.evaluate` protocol) as a LongTensor, and the data's name."""
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        return data.long(), "tensor"
    if isinstance(data, str) and not _is_pool(Path(data).expanduser()) and not data.endswith(".npy"):
        if tokenizer is None:
            raise TcalError(f"evaluating on {data!r} needs a tokenizer; save one with the model")
        from tcal.data import token_windows

        return token_windows(data, tokenizer, window=window, n_windows=windows, cache_dir=cache_dir), data
    arr, info = load_token_stream(data, tokenizer, cache_dir=cache_dir)
    if arr.size < window * windows:
        raise TcalError(f"eval data {info['name']} has {arr.size} tokens, {windows} x {window} asked; "
                        "use fewer or shorter windows")
    ids = np.asarray(arr[: window * windows]).astype(np.int64).reshape(windows, window)
    return torch.from_numpy(ids), info["name"]


class WindowOrder:
    """Sample ``i`` -> window index: ``perm_e[i mod n]`` with ``perm_e = default_rng([seed, e]).permutation(n)``."""

    def __init__(self, n_windows: int, seed: int):
        if n_windows < 1:
            raise TcalError("the training data has no full window; use a larger pool or a shorter --seq-len")
        self.n, self.seed = int(n_windows), int(seed)
        self._epoch, self._perm = None, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n)
            self._epoch = epoch
        return self._perm

    def window(self, sample: int) -> int:
        epoch, pos = divmod(int(sample), self.n)
        return int(self.permutation(epoch)[pos])


def batch_for_step(tokens: np.ndarray, order: WindowOrder, seq_len: int, step: int, batch_size: int) -> torch.Tensor:
    """The (batch_size, seq_len) LongTensor that step ``step`` trains on."""
    rows = []
    for b in range(batch_size):
        start = order.window(step * batch_size + b) * seq_len
        rows.append(np.asarray(tokens[start:start + seq_len], dtype=np.int64))
    return torch.from_numpy(np.stack(rows))


# ---------------------------------------------------------------------------------------------
# Schedule and evaluation points
# ---------------------------------------------------------------------------------------------


def warmup_steps(cfg: TrainOptions, total_steps: int, tokens_per_step: int) -> int:
    w = cfg.warmup * total_steps if cfg.warmup < 1 else cfg.warmup / tokens_per_step
    return min(total_steps, int(math.ceil(w)))


def lr_at(step: int, *, peak: float, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up to ``peak``, then constant or cosine."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    span = max(1, total_steps - warmup)
    p = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


def _crossed(before: int, after: int, every: int) -> bool:
    return after // every > before // every


def eval_due(step: int, total_steps: int, tokens_per_step: int, every: int, early: int) -> bool:
    after, before = step * tokens_per_step, (step - 1) * tokens_per_step
    if step >= total_steps or _crossed(before, after, every):
        return True
    for k in range(1, early + 1):
        mark = every // (2 ** k)
        if mark > 0 and before < mark <= after:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Curve files
# ---------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else repr(v)
    return str(v)


def curve_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CURVE_FIELDS)
    for r in rows:
        w.writerow([_fmt(r[k]) for k in CURVE_FIELDS])
    return buf.getvalue()


def read_curve(path) -> list[dict]:
    """Rows of a ``curve.csv`` (ints for tokens/step, floats for the rest)."""
    with open(path, newline="") as f:
        return [
            {k: (int(v) if k in ("tokens", "step") else float(v)) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def plot_curve(rows: list[dict], path, *, teacher_ppl: float | None = None, title: str = "") -> str | None:
    """Eval PPL (log scale) and train loss against training tokens; returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - matplotlib is a dependency
        log.warning("no plot (%s)", e)
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["tokens"] for r in rows]
    a.plot(x, [r["eval_ppl"] for r in rows], "o-", ms=3, label="student")
    if teacher_ppl:
        a.axhline(teacher_ppl, color="k", ls="--", lw=1, label=f"teacher {teacher_ppl:.2f}")
    a.set_yscale("log")
    a.set_xlabel("training tokens")
    a.set_ylabel("held-out PPL")
    a.grid(True, which="both", alpha=0.3)
    a.legend()
    lr = [(r["tokens"], r["train_loss"]) for r in rows if not math.isnan(r["train_loss"])]
    if lr:
        b.plot(*zip(*lr), "o-", ms=3)
    b.set_xlabel("training tokens")
    b.set_ylabel("train loss (mean since previous eval)")
    b.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------------------------
# Helpers: devices, memory, RNG, model I/O
# ---------------------------------------------------------------------------------------------


def _resolve_device(name: str) -> torch.device:
    from tcal.cli import resolve_device

    return torch.device(resolve_device(name))


def _resolve_compile(mode: str, device: torch.device) -> bool:
    if mode != "auto":
        return mode == "on"
    from tcal.ops import fla_available, fla_backward_ok
    # Where fla trains, its kernels are faster still; compile only the PyTorch fallback on GPUs.
    return device.type == "cuda" and not (fla_available() and fla_backward_ok())


def _amp_dtype(cfg: TrainOptions, device: torch.device):
    if cfg.precision == "fp32" or (cfg.precision == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"kind": "cuda max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"kind": "process peak RSS", "bytes": int(rss * (1 if sys.platform == "darwin" else 1024))}
    except Exception:  # pragma: no cover
        return {"kind": "unknown", "bytes": None}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_model(model, directory: Path) -> None:
    from tcal.hybrid import HybridForCausalLM

    if isinstance(model, HybridForCausalLM):
        model.save_pretrained(directory, atomic=False)
    else:
        model.save_pretrained(directory)


def _load_model(directory, dtype=torch.float32):
    from tcal.teachers import load_model_dir

    return load_model_dir(directory, dtype, require_tokenizer=False)[0]


def load_model_and_tokenizer(spec: str, *, dtype=torch.float32, device="cpu"):
    """A model directory (tokenizer optional) or any :func:`tcal.teachers.load_teacher` spec."""
    from tcal.teachers import load_model_dir, load_teacher

    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        model, tok = load_model_dir(path, dtype, require_tokenizer=False)
        return model.to(device).eval(), tok
    return load_teacher(spec, dtype=dtype, device=device)


def partial_dir(out) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


def _checkpoint_dir(partial: Path) -> Path | None:
    ck = partial / "checkpoint"
    if (ck / "resume" / "state.json").is_file():
        return ck
    # killed between the two renames of atomic_dir: the previous checkpoint is still there
    for old in sorted(partial.glob(".checkpoint.old-*")):
        if (old / "resume" / "state.json").is_file():
            return old
    return None


def has_checkpoint(out) -> bool:
    p = partial_dir(out)
    return p.is_dir() and _checkpoint_dir(p) is not None


def finished_report(out) -> dict | None:
    f = Path(out) / "report.json"
    if f.is_file():
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):
            return None
    return None


def _trainable(model, which: str) -> list[tuple[str, nn.Parameter]]:
    if which == "all":
        chosen = {n for n, _ in model.named_parameters()}
    else:
        if not hasattr(model, "gdn_modules"):
            raise TcalError(f"--train gdn needs a tcal hybrid, got {type(model).__name__}; use --train all")
        chosen = set()
        for i, gdn in model.gdn_modules().items():
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


def _optimizer(params: list[tuple[str, nn.Parameter]], cfg: TrainOptions) -> torch.optim.Optimizer:
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=ADAM_BETAS)


def _config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------


def distill(
    student,
    teacher,
    cfg: DistillConfig,
    *,
    train_tokens: np.ndarray,
    eval_ids: torch.Tensor,
    tokenizer=None,
    teacher_ppl: float | None = None,
    data_info: dict | None = None,
    extra_report: dict | None = None,
    callback: Callable[[int, int], None] | None = None,
) -> dict:
    """Distil ``student`` towards ``teacher`` for ``cfg.tokens`` tokens; write ``cfg.out``.

    ``student`` may be None when ``cfg.resume`` and a checkpoint exists (it is loaded from it).
    ``callback(step, tokens)`` runs after every step (tests use it to simulate a kill).
    Returns the report (``status`` "done", or "paused" after --max-minutes / --stop-after-tokens).
    """
    _check_config(cfg, cfg.tokens)
    out = Path(cfg.out)
    partial = partial_dir(out)
    device = _resolve_device(cfg.device)
    amp = _amp_dtype(cfg, device)
    tps = cfg.batch_size * cfg.seq_len
    total_steps = int(math.ceil(cfg.tokens / tps))
    wsteps = warmup_steps(cfg, total_steps, tps)
    micro = cfg.micro_batch or cfg.batch_size
    n_windows = int(train_tokens.shape[0]) // cfg.seq_len
    order = WindowOrder(n_windows, cfg.seed)

    # ---- fresh start or resume ------------------------------------------------------------
    ckpt = _checkpoint_dir(partial) if partial.is_dir() else None
    if partial.is_dir() and not cfg.resume:
        raise TcalError(f"{partial} holds an interrupted run; pass --resume to continue it, or delete it")
    resume_state = None
    if ckpt is not None:
        resume_state = json.loads((ckpt / "resume" / "state.json").read_text())
        diff = changed_settings(resume_state["config"], _config_dict(cfg))
        if diff:
            raise TcalError(f"cannot resume {partial}: settings changed ({', '.join(diff)}); "
                            "resume with the same settings or delete the partial directory")
        student = _load_model(ckpt)
        log.info("resuming from %s at step %d (%d tokens)", ckpt, resume_state["step"], resume_state["tokens"])
    elif partial.is_dir():  # killed before the first checkpoint: start again
        shutil.rmtree(partial)
    if student is None:
        raise TcalError("no student model given and no checkpoint to resume from")
    partial.mkdir(parents=True, exist_ok=True)

    student = student.to(device)
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    base_s, head_s = lm_parts(student)
    base_t, head_t = lm_parts(teacher)
    if head_s.weight.shape[0] != head_t.weight.shape[0]:
        raise TcalError(f"student vocabulary {head_s.weight.shape[0]} != teacher vocabulary {head_t.weight.shape[0]}; "
                        "distil from the teacher the hybrid was converted from")
    vocab = head_s.weight.shape[0]
    if train_tokens.size and int(np.max(train_tokens[: min(train_tokens.size, 1 << 24)])) >= vocab:
        raise TcalError(f"training data has token ids >= the vocabulary size {vocab}; wrong tokenizer?")
    if int(eval_ids.max()) >= vocab:
        raise TcalError(f"evaluation data has token ids >= the vocabulary size {vocab}; wrong tokenizer?")
    params = _trainable(student, cfg.train)
    n_trainable = sum(p.numel() for _, p in params)
    gdn_compile = _resolve_compile(cfg.compile, device)
    from tcal import ops
    compile_before = ops.set_compile(gdn_compile)
    if cfg.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = _optimizer(params, cfg)

    from tcal.evaluate import window_ppl

    def evaluate(model) -> float:
        return window_ppl(model, eval_ids, batch_size=4, device=device, progress=False)

    if resume_state is not None:
        # On the CPU: RNG states must stay CPU tensors; the optimizer moves its own state to the params.
        extra = torch.load(ckpt / "resume" / "optimizer.pt", map_location="cpu", weights_only=False)
        opt.load_state_dict(extra["optimizer"])
        _set_rng_state(extra["rng"])
        st = resume_state
        step, rows = st["step"], st["curve"]
        loss_sum, loss_count = st["loss_sum"], st["loss_count"]
        elapsed_before, train_s = st["elapsed_s"], st["train_s"]
        teacher_ppl = st.get("teacher_ppl", teacher_ppl)
        segments = st.get("segments", 0) + 1
    else:
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % (2 ** 32))
        random.seed(cfg.seed)
        step, rows, loss_sum, loss_count, elapsed_before, train_s, segments = 0, [], 0.0, 0, 0.0, 0.0, 1
        if teacher_ppl is None:
            teacher_ppl = evaluate(teacher)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_start = time.time()

    def elapsed() -> float:
        return elapsed_before + (time.time() - t_start)

    def lr_for(s: int) -> float:
        return lr_at(s, peak=cfg.lr, total_steps=total_steps, warmup=wsteps, schedule=cfg.schedule,
                     min_ratio=cfg.min_lr_ratio)

    def add_row(s: int) -> None:
        nonlocal loss_sum, loss_count
        ppl = evaluate(student)
        rows.append({"tokens": s * tps, "step": s, "eval_ppl": ppl,
                     "train_loss": loss_sum / loss_count if loss_count else float("nan"),
                     "lr": lr_for(max(s - 1, 0)), "elapsed_s": round(elapsed(), 3)})
        loss_sum, loss_count = 0.0, 0
        (partial / "curve.csv").write_text(curve_csv(rows))

    def save_checkpoint() -> None:
        with atomic_dir(partial / "checkpoint") as tmp:
            _save_model(student, tmp)
            (tmp / "resume").mkdir()
            torch.save({"optimizer": opt.state_dict(), "rng": _rng_state()}, tmp / "resume" / "optimizer.pt")
            write_json(tmp / "resume" / "state.json", {
                "version": STATE_VERSION, "step": step, "tokens": step * tps, "curve": rows,
                "loss_sum": loss_sum, "loss_count": loss_count, "elapsed_s": elapsed(), "train_s": train_s,
                "teacher_ppl": teacher_ppl, "segments": segments, "config": _config_dict(cfg),
                "scheduler": {"kind": cfg.schedule, "warmup_steps": wsteps, "total_steps": total_steps,
                              "next_step": step},
            })

    if not rows:
        add_row(0)

    from tqdm import tqdm

    bar = tqdm(total=total_steps * tps, initial=step * tps, unit="tok", unit_scale=True, desc="distill",
               disable=not cfg.progress, dynamic_ncols=True, smoothing=0.1)
    status = "done"
    student.train()
    try:
        while step < total_steps:
            if (cfg.stop_after_tokens and step * tps >= cfg.stop_after_tokens) or (
                    cfg.max_minutes and time.time() - t_start >= cfg.max_minutes * 60):
                save_checkpoint()
                status = "paused"
                break
            t0 = time.perf_counter()
            lr = lr_for(step)
            for g in opt.param_groups:
                g["lr"] = lr
            ids = batch_for_step(train_tokens, order, cfg.seq_len, step, cfg.batch_size).to(device)
            opt.zero_grad(set_to_none=True)
            step_loss = 0.0
            for i in range(0, cfg.batch_size, micro):
                mb = ids[i:i + micro]
                labels = torch.full_like(mb, -100)
                labels[:, :-1] = mb[:, 1:]
                with _autocast(device, amp):
                    with torch.no_grad():
                        ht = _hidden(base_t, mb)
                    hs = _hidden(base_s, mb)
                    loss, kl, ce = chunked_distill_loss(
                        hs.reshape(-1, hs.shape[-1]), head_s, ht.reshape(-1, ht.shape[-1]), head_t,
                        labels.reshape(-1), ce_weight=cfg.ce_weight, chunk_rows=cfg.kl_chunk,
                    )
                frac = mb.shape[0] / cfg.batch_size
                (loss * frac).backward()
                step_loss += float(loss.detach()) * frac
                del hs, ht, loss
            if not math.isfinite(step_loss):
                raise TcalError(f"the loss is not finite at step {step} ({step_loss}); lower --lr")
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.grad_clip)
            opt.step()
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_s += time.perf_counter() - t0
            loss_sum += step_loss
            loss_count += 1
            bar.update(tps)
            if eval_due(step, total_steps, tps, cfg.eval_every, cfg.eval_early):
                add_row(step)
                student.train()
                bar.set_postfix(loss=f"{rows[-1]['train_loss']:.4f}", ppl=f"{rows[-1]['eval_ppl']:.2f}")
            if step < total_steps and _crossed((step - 1) * tps, step * tps, cfg.save_every):
                save_checkpoint()
            if callback is not None:
                callback(step, step * tps)
    finally:
        bar.close()
        ops.set_compile(compile_before)  # a process-wide switch: leave it as found
    student.eval()

    mem = peak_memory(device)
    report = {
        "status": status,
        "tokens": step * tps,
        "steps": step,
        "total_steps": total_steps,
        "tokens_per_step": tps,
        "budget_tokens": cfg.tokens,
        "data": data_info or {},
        "epochs": step * cfg.batch_size / n_windows,
        "train_windows": n_windows,
        "eval": {"data": cfg.eval, "window": int(eval_ids.shape[1]), "windows": int(eval_ids.shape[0])},
        "teacher_ppl": teacher_ppl,
        "zero_shot_ppl": rows[0]["eval_ppl"] if rows else None,
        "final_ppl": rows[-1]["eval_ppl"] if rows else None,
        "train_tokens_per_s": (step * tps) / train_s if train_s > 0 else None,
        "train_s": train_s,
        "elapsed_s": elapsed(),
        "segments": segments,
        "peak_memory": mem,
        "device": str(device),
        "precision": "bf16 autocast" if amp is not None else "fp32",
        "gdn_compile": gdn_compile,
        "trainable_params": n_trainable,
        "warmup_steps": wsteps,
        "curve": rows,
        "config": _config_dict(cfg),
        **(extra_report or {}),
    }
    if status == "paused":
        print(f"tcal distill: paused at {step * tps:,} of {total_steps * tps:,} tokens; "
              f"rerun with --resume to continue ({partial})", file=sys.stderr)
        write_json(partial / "report.partial.json", report)
        return report

    resolved = {"stage": "distill", **_config_dict(cfg),
                "resolved": {"device": str(device), "precision": report["precision"], "total_steps": total_steps,
                             "tokens_per_step": tps, "warmup_steps": wsteps, "train_windows": n_windows}}
    with atomic_dir(out) as tmp:
        _save_model(student, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "curve.csv").write_text(curve_csv(rows))
        plot_curve(rows, tmp / "curve.png", teacher_ppl=teacher_ppl, title=f"distill {out.name}")
        write_json(tmp / "tcal_config.json", resolved)
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(report_markdown(report, cfg))
    shutil.rmtree(partial, ignore_errors=True)
    return report


def _human_bytes(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def report_markdown(report: dict, cfg: DistillConfig) -> str:
    data = report.get("data") or {}
    n_data = data.get("tokens")
    data_line = f"- training data: {data.get('name', cfg.data)}"
    if isinstance(n_data, int):
        data_line += (f" ({n_data:,} tokens = {report['train_windows']:,} windows of {cfg.seq_len}; "
                      f"{report['epochs']:.2f} epochs used)")
    teacher = report.get("teacher_ppl")
    tp = report.get("train_tokens_per_s")
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
        f"- device: {report['device']}, {report['precision']}",
        "",
        "| model | held-out PPL |",
        "|---|---|",
        f"| teacher | {teacher:.3f} |" if teacher else "| teacher | n/a |",
        f"| student before distillation | {report['zero_shot_ppl']:.3f} |",
        f"| student after {report['tokens']:,} tokens | {report['final_ppl']:.3f} |",
        "",
    ]
    if tp:
        lines.append(f"Throughput: {tp:,.0f} training tokens/s (training steps only; evaluation and checkpoints "
                     f"excluded). Wall time {report['elapsed_s']:.1f} s over {report['segments']} session(s).")
    lines += [
        f"Peak memory: {_human_bytes(report['peak_memory']['bytes'])} ({report['peak_memory']['kind']}).",
        "",
        "Curve: curve.csv, curve.png.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------


def run_distill(cfg: DistillConfig, *, callback=None) -> dict:
    """``tcal distill``: load the hybrid and the teacher, distil, write ``cfg.out``."""
    _check_config(cfg, cfg.tokens)
    if cfg.resume:
        done = finished_report(cfg.out)
        if done is not None and not partial_dir(cfg.out).exists():
            if not changed_settings(done.get("config", {}), _config_dict(cfg)):
                print(f"{cfg.out} is already finished; nothing to resume")
                return done
    from tcal.data import check_disjoint

    check_disjoint(cfg.data, cfg.eval)
    device = _resolve_device(cfg.device)
    from tcal.cli import resolve_dtype

    teacher, tok_t = load_model_and_tokenizer(cfg.teacher, dtype=resolve_dtype(cfg.teacher_dtype), device=device)
    student = None
    tok_s = None
    if not (cfg.resume and has_checkpoint(cfg.out)):
        if not Path(cfg.hybrid).is_dir():
            raise TcalError(f"hybrid {cfg.hybrid} is not a directory; write one with `tcal convert --out DIR`")
        student, tok_s = load_model_and_tokenizer(cfg.hybrid, dtype=torch.float32, device=device)
    tokenizer = tok_s or tok_t
    train_tokens, info = load_token_stream(cfg.data, tokenizer)
    eval_ids, _ = eval_windows_for(cfg.eval, tokenizer, cfg.eval_window, cfg.eval_windows)
    report = distill(student, teacher, cfg, train_tokens=train_tokens, eval_ids=eval_ids, tokenizer=tokenizer,
                     data_info=info, callback=callback)
    if report["status"] == "done":
        tp = report["train_tokens_per_s"]
        print(f"wrote {cfg.out}: PPL {report['zero_shot_ppl']:.2f} -> {report['final_ppl']:.2f} after "
              f"{report['tokens']:,} tokens (teacher {report['teacher_ppl']:.2f}); "
              f"{tp:,.0f} tokens/s, peak memory {_human_bytes(report['peak_memory']['bytes'])}")
    return report
