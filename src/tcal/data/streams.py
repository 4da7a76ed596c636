"""Token streams for training and evaluation: a pool directory, a .npy file or a tokenised corpus."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tcal.data import instruct, pool
from tcal.data.corpora import as_corpus, path_exists
from tcal.data.tokens import corpus_tokens, mixed_windows, tokenizer_id
from tcal.utils.errors import TcalError


def _is_pool(path: Path) -> bool:
    try:
        return path.is_dir() and (path / "manifest.json").is_file()
    except OSError:  # raw text given as data: too long or odd for a path
        return False


def load_token_stream(data, tokenizer=None, *, cache_dir=None) -> tuple[np.ndarray, dict]:
    """A 1-D token array and a description of where it came from.

    ``data``: an array / tensor of ids, a :mod:`tcal.data.pool` directory (memory-mapped), a ``.npy``
    file, or a corpus spec / path (tokenised by :func:`tcal.data.tokens.corpus_tokens`, which needs
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
    if instruct.is_instruct_set(path):
        raise TcalError(f"{data} is an instruct set (tcal instruct): its windows are read whole, with their answer "
                        "mask, as a run's --data; give raw text (a token pool, a .npy file or a corpus) here")
    if _is_pool(path):
        arr = pool.load_pool(path)
        manifest = pool.read_manifest(path)
        if tokenizer is not None:
            want = (manifest.get("tokenizer") or {}).get("id")
            if want and want != tokenizer_id(tokenizer):
                raise TcalError(
                    f"pool {path} was tokenised by tokenizer {want}, not the teacher's ({tokenizer_id(tokenizer)}); "
                    "build the pool with the teacher's tokenizer"
                )
        return arr, {"kind": "pool", "name": str(path), "tokens": int(arr.size),
                     "sources": [s.get("name") for s in manifest.get("sources", []) if s.get("tokens")]}
    if path.suffix == ".npy" and path_exists(data) and path.is_file():
        arr = np.load(path, mmap_mode="r").reshape(-1)
        return arr, {"kind": "npy", "name": str(path), "tokens": int(arr.size)}
    if tokenizer is None:
        raise TcalError(f"data {data!r} is text, which needs a tokenizer; save one with the model or pass token ids")
    corpus = as_corpus(data, cache_dir=cache_dir)
    arr, _ = corpus_tokens(corpus, tokenizer, cache_dir=cache_dir)
    return arr, {"kind": "corpus", "name": corpus.name, "tokens": int(arr.size),
                 "content_hash": corpus.content_hash[:16]}


def is_token_file(data) -> bool:
    """Whether ``data`` names token ids (a token pool directory or a ``.npy`` file) rather than text."""
    if not isinstance(data, (str, os.PathLike)):
        return False
    path = Path(data).expanduser()
    return _is_pool(path) or (path.suffix == ".npy" and path_exists(os.fspath(data)) and path.is_file())


def eval_windows_for(data, tokenizer, window: int, windows: int, *, cache_dir=None) -> tuple[torch.Tensor, str]:
    """The first ``windows`` non-overlapping windows of ``window`` tokens of ``data`` (the
    perplexity protocol of :mod:`tcal.evaluate`) as a LongTensor, and the data's name."""
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        return data.long(), "tensor"
    if isinstance(data, str) and not _is_pool(Path(data).expanduser()) and not data.endswith(".npy"):
        if tokenizer is None:
            raise TcalError(f"evaluating on {data!r} needs a tokenizer; save one with the model")
        # a mixture a+b (tcal recover --calib) interleaves its parts, as every other calibration does
        return mixed_windows(data, tokenizer, window=window, n_windows=windows, cache_dir=cache_dir), data
    arr, info = load_token_stream(data, tokenizer, cache_dir=cache_dir)
    if arr.size < window * windows:
        raise TcalError(f"eval data {info['name']} has {arr.size} tokens, {windows} x {window} asked; "
                        "use fewer or shorter windows")
    ids = np.asarray(arr[: window * windows]).astype(np.int64).reshape(windows, window)
    return torch.from_numpy(ids), info["name"]




def load_training_data(data, tokenizer=None, *, cache_dir=None) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """``(tokens, mask, info)`` of training data: an instruct set (:mod:`tcal.data.instruct`; its packed windows
    flattened, with the flat answer mask, and ``info["seq_len"]`` the window length the windows must be read at),
    or anything :func:`load_token_stream` reads (mask None)."""
    if isinstance(data, (str, os.PathLike)) and instruct.is_instruct_set(data):
        ids, mask, manifest = instruct.load_instruct_set(data)
        want = (manifest.get("tokenizer") or {}).get("id")
        if tokenizer is not None and want and want != tokenizer_id(tokenizer):
            raise TcalError(f"instruct set {data} was tokenised by tokenizer {want}, not the teacher's "
                            f"({tokenizer_id(tokenizer)}); build it with `tcal instruct --teacher` of this teacher")
        return ids.reshape(-1), mask.reshape(-1), {
            "kind": "instruct", "name": str(data), "tokens": int(ids.size), "seq_len": int(ids.shape[1]),
            "loss_tokens": int(manifest.get("loss_tokens", 0)), "answers": manifest.get("answers"),
            "sources": list((manifest.get("sources") or {}).keys())}
    tokens, info = load_token_stream(data, tokenizer, cache_dir=cache_dir)
    return tokens, None, info
