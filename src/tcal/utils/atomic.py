"""Output directories that never lose a user's files and never stay half-written.

A new directory is written beside its final place and published in one rename. Into an existing
directory (``--out .``, an empty folder, or a finished tcal output being overwritten) the finished
files are moved one by one: files of the same name are replaced, files an earlier tcal run
published there (listed in :data:`MANIFEST`) and not written again are removed, and every other
file is left alone. Internal directories whose parts must stay consistent with each other
(training checkpoints) use ``replace=True``: the whole directory is swapped.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from tcal.utils.errors import TcalError

MANIFEST = ".tcal_files"  # names tcal published into a directory, one per line
CONFIG_FILE = "tcal_config.json"  # every command's output has one: {"stage": command, ...}


def absolute(path: str | os.PathLike) -> Path:
    """``path`` made absolute and normalised, so that ``.`` and ``runs/../x`` have a name and a parent."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def finished_stage(path: Path) -> str | None:
    """The command whose finished output ``path`` holds (its tcal_config.json's stage; a token pool
    is known by its manifest), else None."""
    for name, key, known in ((CONFIG_FILE, "stage", None), ("manifest.json", "format", {"tcal-pool-v1": "pool"})):
        try:
            value = json.loads((path / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        return known.get(value) if known is not None else value
    return None


def check_out(out, stage: str, overwrite: bool = False, flag: str = "--out") -> Path:
    """Refuse an output directory that would cost the user files, before any work is done.

    Accepted: a path that does not exist yet, an empty directory, or (with ``overwrite``) a
    finished output of the same command; in each case a directory must be creatable where the
    output is written (see :func:`_check_writable`).
    """
    if not str(out).strip():
        raise TcalError(f"{flag} is empty; give an output directory")
    path = absolute(out)
    if path.exists() and not path.is_dir():
        raise TcalError(f"{flag} {out} is a file, not a directory; choose another {flag}")
    if path.is_dir() and any(path.iterdir()):
        done = finished_stage(path)
        if done != stage:
            what = f"a `tcal {done}` output" if done else "files tcal did not write"
            raise TcalError(f"{flag} {out} already holds {what}; choose a new or empty directory")
        if not overwrite:
            raise TcalError(f"{flag} {out} holds a finished `tcal {stage}` output; pass --overwrite to replace "
                            "it (only tcal's own files are replaced) or choose another directory")
    # the output is written beside its final place (atomic_dir, OUT.partial) and, into an existing
    # directory, moved into it
    _check_writable(path.parent, out, flag)
    if path.is_dir():
        _check_writable(path, out, flag)
    return path


def _check_writable(where: Path, out, flag: str) -> None:
    """Create and remove a directory in ``where`` (or its nearest existing parent): permission bits
    do not tell, os.access lets root write anywhere, /proc included."""
    parent = where
    while not os.path.exists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise TcalError(f"cannot write {flag} {out}: {parent} is a file, not a directory; choose another {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".tcal-check-"))
    except OSError as e:
        raise TcalError(f"cannot write {flag} {out}: a directory cannot be created in {parent} ({e.strerror}); "
                        f"choose a writable {flag}") from None


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, *, replace: bool = False):
    """Yield a temporary directory to write into; on success publish it as ``out``.

    On any exception the temporary directory is removed and ``out`` is left as it was.
    ``replace``: swap the whole directory (for internal directories whose files belong together).
    """
    out = absolute(out)
    if out.exists() and not out.is_dir():
        raise TcalError(f"output path {out} exists and is not a directory; choose another --out")
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        yield tmp
        _usual_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out, replace=replace)


def publish(tmp: str | os.PathLike, out: str | os.PathLike, *, replace: bool = False) -> Path:
    """A finished directory ``tmp`` becomes ``out``: one rename where ``out`` does not exist yet (or
    ``replace``), else moved into it file by file (see the module docstring)."""
    tmp, out = Path(tmp), absolute(out)
    if replace:
        return publish_dir(tmp, out)
    if out.exists():
        return merge_into(tmp, out)
    publish_dir(tmp, out)
    _write_manifest(out, [p.name for p in sorted(out.iterdir()) if p.name != MANIFEST])
    return out


def _write_manifest(out: Path, names) -> None:
    (out / MANIFEST).write_text("".join(f"{n}\n" for n in names))


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A temp dir beside its final place (same filesystem, so os.replace is atomic), with the
    usual permissions (mkdtemp makes it 0700, which would stay after the rename)."""
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    except OSError as e:
        raise TcalError(f"cannot write to {parent} ({e.strerror}); choose a writable output directory") from None
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _usual_modes(root: Path) -> None:
    """Files that a library wrote private (mkstemp: 0600) get the usual umask modes, as any file would."""
    mode = 0o666 & ~_umask()
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and stat.S_IMODE(os.stat(p).st_mode) == 0o600 and mode != 0o600:
                os.chmod(p, mode)


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


def merge_into(tmp: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Move the entries of ``tmp`` into the existing directory ``out`` (see the module docstring)."""
    tmp, out = Path(tmp), Path(out)
    try:
        earlier = set((out / MANIFEST).read_text().split())
    except OSError:
        earlier = set()
    new = sorted(p.name for p in tmp.iterdir())
    for name in new:
        src, dst = tmp / name, out / name
        if dst.is_dir() and not dst.is_symlink():
            aside = out / f".{name}.old-{os.getpid()}"
            os.replace(dst, aside)
            os.replace(src, dst)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(src, dst)
    for name in earlier - set(new):
        stale = out / name
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        elif stale.exists() or stale.is_symlink():
            stale.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    _write_manifest(out, new)
    return out


def written_files(out: str | os.PathLike) -> list[str]:
    """What the last tcal publish into ``out`` wrote there (its manifest), for the closing line of a command."""
    try:
        return (Path(out) / MANIFEST).read_text().split()
    except OSError:
        return sorted(p.name for p in Path(out).iterdir() if not p.name.startswith("."))


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
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: a shared cache must stay readable
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
