"""Atomic output directories: a failed run never leaves a half-written directory behind."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tcal.utils.errors import TcalError


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = True):
    """Yield a temporary sibling directory; on success it replaces ``out`` in one rename.

    On any exception the temporary directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise TcalError(f"output path {out} exists and is not a directory; choose another --out")
    if out.exists() and not overwrite:
        raise TcalError(f"output directory {out} already exists; remove it or pass --overwrite")
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out)


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A temp dir beside its final place (same filesystem, so os.replace is atomic), with the
    usual permissions (mkdtemp makes it 0700, which would stay after the rename)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def publish_dir(tmp: str | os.PathLike, out: str | os.PathLike, *, replace: bool = True) -> Path:
    """Move a finished directory ``tmp`` to ``out`` by renames only; returns ``out``.

    ``replace``: what is at ``out`` is moved aside first and deleted after. Either way, when
    another process publishes ``out`` at the same moment, its directory is kept and ``tmp`` dropped.
    """
    tmp, out = Path(tmp), Path(out)
    old = None
    if replace and out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if not out.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON via a temp file + rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def atomic_save_npy(path: str | os.PathLike, arr) -> None:
    """``np.save`` to a temp file beside ``path``, then ``os.replace`` (readers never see half a file)."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
