"""One entry point for the gated delta rule: picks an implementation per call.

    naive   fp32 token loop (reference, ops/naive.py)
    chunk   chunked pure PyTorch (CPU default, ops/chunk.py)
    scan    the chunked form with the state passed between chunks by a parallel scan (ops/chunk.py):
            kernels that grow with log2 of the chunks, not with the chunks; what "auto" trains long
            sequences with on a GPU where fla does not train (SCAN_MIN_CHUNKS)
    fla     flash-linear-attention Triton kernels on CUDA: chunk for prefill / training,
            fused_recurrent for decode (single-token steps)

``backend="auto"`` takes fla on CUDA when it imports (and, for gradients, when its backward works), else
chunk, or scan for gradients through SCAN_MIN_CHUNKS chunks or more on CUDA (naive for one token, where the
loop *is* the cheapest form).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os

import torch

from tcal.ops.chunk import chunk_gated_delta_rule_torch, chunk_scan_gated_delta_rule_torch
from tcal.ops.naive import naive_recurrent_gated_delta_rule
from tcal.utils.errors import TcalError

BACKENDS = ("auto", "naive", "chunk", "scan", "fla")
# Training on a GPU through the PyTorch paths (fla cannot train there, or calibration keeps off fla): from this
# many chunks on, "auto" passes the state by the scan. The loop's small per-chunk kernels leave the GPU waiting on
# the host: on the H200 the scan beat the loop, compiled or not, at 32 chunks, and the compiled loop beat the scan
# at 8 (docs/results.md, *The scan backend*).
SCAN_MIN_CHUNKS = 32
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # ImportError, or triton failing to initialise on a machine without a GPU
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_available() -> bool:
    return torch.cuda.is_available() and _fla_ops() is not None


@functools.lru_cache(maxsize=1)
def fla_backward_ok() -> bool:
    """False where fla refuses its gated backward: Hopper GPUs with Triton 3.4 <= v < 3.7.1 and no
    tilelang (fla issue #640, wrong gradients). Training then runs the chunked PyTorch path."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # older fla without the guard
        return True
    buggy = IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
    return not buggy or importlib.util.find_spec("tilelang") is not None


def resolve_backend(backend: str, device: torch.device, seq_len: int, needs_grad: bool = False,
                    chunk_size: int = 64) -> str:
    backend = os.environ.get("TCAL_GDN_BACKEND", backend) if backend == "auto" else backend
    if backend not in BACKENDS:
        raise TcalError(f"unknown GDN backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "fla":
        if device.type != "cuda":
            raise TcalError("GDN backend 'fla' needs CUDA tensors; use backend 'chunk' on CPU")
        if _fla_ops() is None:
            raise TcalError("GDN backend 'fla' needs flash-linear-attention: pip install 'tcal[fla]'")
        if needs_grad and not fla_backward_ok():
            raise TcalError("fla's gated backward is disabled on this GPU (Hopper + Triton < 3.7.1, fla #640); "
                            "use backend 'auto' or 'chunk' for training, or install tilelang")
        return "fla"
    if backend == "auto":
        if device.type == "cuda":
            fla = _fla_ops() is not None and not _COMPILE["torch_only"]
            if fla and (not needs_grad or fla_backward_ok()):
                return "fla"
            if fla:
                _warn_fla_backward()
            if needs_grad and seq_len >= SCAN_MIN_CHUNKS * chunk_size:
                return "scan"
        return "naive" if seq_len == 1 else "chunk"
    return backend


# The GDN layer is called from deep inside the teacher's HF decoder, so whether its training calls
# run compiled cannot be passed down as an argument: it is this module's state, set for the
# duration of a training run by compile_training().
# A fresh process's switches (tests start from a copy, so a switch added here reaches them too)
COMPILE_DEFAULTS = {"on": False, "failed": False, "torch_only": False}
_COMPILE = dict(COMPILE_DEFAULTS)


@contextlib.contextmanager
def torch_only(on: bool):
    """Within the block (``on``), backend "auto" runs every call on the PyTorch paths, with or without
    gradients. Calibration takes it where fla cannot train: its fits then score their held-out checks
    with the kernel they train through, and a process that only calibrates does not pay fla's one-time
    Triton compile and autotune for its few inference calls (docs/results.md, *Calibration time*)."""
    previous, _COMPILE["torch_only"] = _COMPILE["torch_only"], bool(on)
    try:
        yield
    finally:
        _COMPILE["torch_only"] = previous


def set_compile(on: bool) -> bool:
    """Train through a ``torch.compile``d chunked path. Only calls that need gradients use it:
    training shapes are fixed, so it compiles once, while inference shapes vary and would
    recompile. The environment variable TCAL_GDN_COMPILE=1/0 overrides this setting.
    Returns the previous setting, so a caller can restore it."""
    previous, _COMPILE["on"] = _COMPILE["on"], bool(on)
    return previous


def compile_by_default(device) -> bool:
    """Whether training calls on ``device`` should run compiled when nobody says: on a GPU where
    the chunked PyTorch path trains (fla's kernels, where they train, are faster still); never on
    CPU, where compiling costs more than it saves on the short fits tcal runs there."""
    device = torch.device(device)
    return device.type == "cuda" and not (fla_available() and fla_backward_ok())


@contextlib.contextmanager
def compile_training(on: bool):
    """Within the block, GDN calls that need gradients run compiled (``on``) or eagerly."""
    previous = set_compile(on)
    try:
        yield
    finally:
        set_compile(previous)


def _compile_enabled() -> bool:
    if _COMPILE["failed"]:  # compiling failed once in this process: never try again
        return False
    env = os.environ.get("TCAL_GDN_COMPILE")
    return env not in ("0", "", "false") if env is not None else _COMPILE["on"]


@functools.lru_cache(maxsize=1)
def _compiled_chunk():
    return torch.compile(chunk_gated_delta_rule_torch, dynamic=False)


@functools.lru_cache(maxsize=1)
def _warn_fla_backward():
    log.warning("fla's gated backward is unavailable here (Hopper + Triton < 3.7.1, fla #640): "
                "GDN training runs the chunked PyTorch path; inference still uses fla")


def gated_delta_rule(
    q: torch.Tensor,  # (B, T, H, K), l2-normalised
    k: torch.Tensor,  # (B, T, H, K), l2-normalised
    v: torch.Tensor,  # (B, T, H, V)
    g: torch.Tensor,  # (B, T, H) log decay
    beta: torch.Tensor,  # (B, T, H)
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # (B, H, K, V), fp32
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o (B, T, H, V) in v's dtype, final state (B, H, K, V) fp32 or None)."""
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    kind = resolve_backend(backend, q.device, q.shape[1], needs_grad, chunk_size)
    if kind == "naive":
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state)
    if kind == "scan":
        return chunk_scan_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 chunk_size=chunk_size)
    if kind == "chunk":
        args = (q, k, v, g, beta, scale, initial_state, output_final_state)
        if needs_grad and _compile_enabled():
            try:
                return _compiled_chunk()(*args, chunk_size=chunk_size)
            except Exception as e:  # no C++ toolchain, an inductor bug: train on, uncompiled
                log.warning("torch.compile of the chunked GDN path failed (%s: %s); running it uncompiled",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                _COMPILE["failed"] = True
        return chunk_gated_delta_rule_torch(*args, chunk_size=chunk_size)
    chunk_fn, recurrent_fn = _fla_ops()
    # fla wants q/k/v in one dtype and g/beta in fp32 or that dtype; the state stays fp32.
    fn = recurrent_fn if (q.shape[1] == 1 and not needs_grad) else chunk_fn
    init = None if initial_state is None else initial_state.float()
    o, state = fn(
        q=q, k=k, v=v.to(q.dtype), g=g.float(), beta=beta.to(q.dtype), scale=scale,
        initial_state=init, output_final_state=output_final_state,
    )
    return o.to(v.dtype), (state.float() if state is not None else None)
