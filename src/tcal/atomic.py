"""Atomic output directories: a failed run never leaves a half-written directory behind."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = True):
    """Yield a temporary sibling directory; on success it replaces ``out`` in one rename.

    On any exception the temporary directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        from tcal.errors import TcalError

        raise TcalError(f"output path {out} exists and is not a directory; choose another --out")
    if out.exists() and not overwrite:
        from tcal.errors import TcalError

        raise TcalError(f"output directory {out} already exists; remove it or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out)


def publish_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Move a finished directory ``tmp`` to ``out``, replacing what was there, by renames only."""
    tmp, out = Path(tmp), Path(out)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON via a temp file + rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)
