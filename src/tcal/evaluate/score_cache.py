"""Scores of a model that does not change, kept in tcal's cache: a conversion scores its teacher's held-out
perplexity once per machine, not once per run.

A score is kept under a key that says everything it depends on: which model (:func:`model_identity`: a built-in
teacher's name and GGUF sha256, or a local file's real path, size and modification time), how it ran (dtype, device
kind, torch version) and the exact token ids scored. The file holds the key beside the value, and a value is read
back only where the whole key matches, so a changed model, text, tokenizer or protocol is scored anew.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from tcal.utils.cache import cache_root


def model_identity(spec) -> list | None:
    """What a model spec names, for a key: a built-in teacher (or a copy of its converted cache) by its name and its
    GGUF's sha256, a local file or folder by its real path, size and modification time (:func:`~tcal.utils.partial.
    identity`); None for anything else (a hub id may change under the same name: never kept)."""
    from tcal.data.teacher_table import TEACHERS
    from tcal.utils.partial import identity

    spec = str(spec)
    if spec in TEACHERS:
        return ["builtin", spec, TEACHERS[spec].sha256]
    return identity(spec)


def run_identity(model) -> list:
    """How a model runs, for a key: its parameters' dtype, the device kind (and the GPU's name), torch's version."""
    import torch

    p = next(model.parameters())
    device = p.device.type + (f":{torch.cuda.get_device_name(p.device)}" if p.device.type == "cuda" else "")
    return [str(p.dtype), device, torch.__version__]


def ids_digest(ids) -> str:
    """The sha256 of a token tensor's shape and values."""
    import numpy as np

    arr = np.ascontiguousarray(ids.detach().cpu().numpy().astype(np.int64))
    return hashlib.sha256(json.dumps(list(arr.shape)).encode() + arr.tobytes()).hexdigest()


def cached(kind: str, key: dict, compute: Callable[[], dict], cache_dir=None) -> tuple[dict, bool]:
    """``compute()``'s value for ``key``, from tcal's cache where it was kept, else computed and kept. Returns
    (value, whether it was read from the cache). A cache that cannot be read or written is scored anew."""
    from tcal.utils.atomic import write_json

    digest = hashlib.sha256(json.dumps([kind, key], sort_keys=True, default=str).encode()).hexdigest()[:32]
    try:
        folder = cache_root(cache_dir) / "scores"
    except OSError:
        return compute(), False
    path = folder / f"{kind}-{digest}.json"
    try:
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and saved.get("key") == json.loads(json.dumps(key, default=str)):
            return saved["value"], True
    except (OSError, ValueError, KeyError):
        pass
    value = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(path, {"key": key, "value": value})
    except OSError:
        pass
    return value, False
