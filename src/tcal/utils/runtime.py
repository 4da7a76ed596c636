"""Devices, dtypes, autocast, memory and RNG state: the run-time facts every stage needs."""
from __future__ import annotations

import contextlib
import functools
import random
import re
import sys

import numpy as np
import torch

from tcal.utils.errors import TcalError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is there, else 'cpu'; anything but cpu, cuda, cuda:N (and mps where there is one)
    is an error, and so is a CUDA device this machine does not have: said before a model loads, not after."""
    device = str(device).strip()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    match = re.fullmatch(r"(cpu|cuda|mps)(?::(\d+))?", device)
    if match is None or (match[2] is not None and match[1] != "cuda"):
        raise TcalError(f"unknown --device {device!r}; use cpu, cuda, cuda:N or auto")
    if match[1] == "cuda" and not torch.cuda.is_available():
        raise TcalError(f"--device {device} asked for but CUDA is not available; use --device cpu")
    if match[2] is not None and int(match[2]) >= torch.cuda.device_count():
        raise TcalError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered "
                        "from 0")
    if match[1] == "mps" and not torch.backends.mps.is_available():
        raise TcalError("--device mps asked for but MPS is not available; use --device cpu")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TcalError(f"unknown --dtype {name!r}; choose float32 or bfloat16")
    return DTYPES[name]


def model_device(model) -> torch.device:
    """The device of a model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def autocast(device: torch.device, dtype: torch.dtype | None):
    """bf16 (or ``dtype``) autocast on ``device``; ``dtype=None`` runs in the weights' dtype."""
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


@functools.lru_cache(maxsize=1)
def cpu_bf16_products() -> bool:
    """Whether fp32 matrix products on this CPU can run as bf16 products (oneDNN on AMX or AVX-512 BF16): as TF32 on
    a GPU, bf16 products and fp32 sums. Checked once by a product that bf16 operands must change, so a build or CPU
    where the setting is accepted but not honoured never reports bf16."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        a = torch.full((64, 256), 1.0 + 2.0**-12)  # fp32 holds it, bf16 rounds it to 1 (small products skip oneDNN)
        exact = float((a @ a.t())[0, 0])
        matmul = torch.backends.mkldnn.matmul
        previous = matmul.fp32_precision
        matmul.fp32_precision = "bf16"
        try:
            reduced = float((a @ a.t())[0, 0])
        finally:
            matmul.fp32_precision = previous
        return reduced != exact
    except (AttributeError, RuntimeError):  # a build without oneDNN or without the setting
        return False


def fit_matmul_kind(device, on: bool | None = True) -> str:
    """What :func:`tf32_matmul` runs fp32 matrix products as on ``device``: ``tf32``, ``bf16`` or ``fp32``. ``on``
    True or False as given (``--fit-matmul fast`` / ``fp32``); None is the device's default: on for CUDA (TF32), off
    for a CPU (bf16 products are a choice the teacher's CPU recipe or the user makes)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if on is None:
        on = device.type == "cuda"
    if not on:
        return "fp32"
    if device.type == "cuda":
        return "tf32"
    return "bf16" if device.type == "cpu" and cpu_bf16_products() else "fp32"


@contextlib.contextmanager
def tf32_matmul(device, on: bool | None = True):
    """Within the block, fp32 matrix products run as :func:`fit_matmul_kind` says (``on``: True, False, or None for
    the device's default): on TF32 tensor cores on a CUDA ``device`` (a 10-bit mantissa in the products), as
    oneDNN's bf16 products on a CPU that has AMX or AVX-512 BF16 (8 bits); sums stay fp32. Calibration's fits
    tolerate either and run several times faster. The previous setting comes back afterwards; elsewhere nothing
    changes."""
    kind = fit_matmul_kind(device, on)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        backend, attr, value = torch.backends.cuda.matmul, "allow_tf32", kind == "tf32"
    elif kind == "bf16":
        backend, attr, value = torch.backends.mkldnn.matmul, "fp32_precision", "bf16"
    else:
        yield
        return
    previous = getattr(backend, attr)
    setattr(backend, attr, value)
    try:
        yield
    finally:
        setattr(backend, attr, previous)


def peak_memory(device: torch.device) -> dict:
    """Peak memory of this process: CUDA's max allocated on a GPU, the peak RSS on the CPU."""
    if device.type == "cuda":
        return {"kind": "cuda max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"kind": "process peak RSS", "bytes": int(rss * (1 if sys.platform == "darwin" else 1024))}
    except Exception:  # pragma: no cover
        return {"kind": "unknown", "bytes": None}


def memory_budget(device) -> int:
    """Bytes a stage may hold on ``device`` for a cache it can do without: a quarter of the free memory on
    CUDA (the rest is for the model, its activations and gradients), 4 GiB on CPU.

    Free on CUDA counts the blocks PyTorch's caching allocator holds but no tensor uses: the driver reports
    them as taken, so after one stage freed its tensors the next would see a smaller budget than it has
    and cut its work into more, smaller pieces than fit."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + max(0, cached)) // 4)
    return 4 << 30


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2 ** 32))
    random.seed(seed)


def rng_state(device: torch.device | None = None) -> dict:
    """Every RNG's state; ``device`` (one process per GPU): that GPU's generator only, since asking
    for all of them would open a CUDA context on every other rank's GPU."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(torch.device(device))
    elif device is None and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore :func:`rng_state`; ``device`` (one process per GPU): restore that GPU's generator only."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if not torch.cuda.is_available():
        return
    if device is not None and torch.device(device).type == "cuda":
        saved = state.get("cuda_device", (state.get("cuda") or [None])[0])
        if saved is not None:
            torch.cuda.set_rng_state(saved, torch.device(device))
    elif device is None:
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
        elif "cuda_device" in state:
            torch.cuda.set_rng_state(state["cuda_device"])
