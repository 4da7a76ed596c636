"""Output directories that never lose a user's file and never stay half-written.

A new directory is written beside its final place and published in one rename. Every published directory carries
a manifest (:data:`MANIFEST`: the command that wrote it and every file tcal wrote there, at any depth). Into an
existing directory (``--out .``, an empty folder, or a finished tcal output being overwritten) the finished files are
moved one by one: a file tcal wrote there before is replaced, or removed when the new output does not write it
again; every other file, at any depth, is left where it is, and a file of the user's where the new output has one is
refused, never replaced. Folders that tcal emptied are removed; a folder that still holds a file of the user's
stays.

An output written before manifests listed every file (a plain list of top-level names, or none beside a
``tcal_config.json``) is still tcal's: its listed top-level files are replaced or removed as above, and inside its
folders only the files the new output writes again are replaced; nothing else there is removed, since tcal cannot
tell which of those files it wrote.

Unfinished work beside an output (``OUT.partial``) has its own manifest: :mod:`tcal.utils.partial`.
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

MANIFEST = ".tcal_files"  # {"format": FILES_FORMAT, "stage": command, "files": [relative paths]}
FILES_FORMAT = "tcal-files-v2"
CONFIG_FILE = "tcal_config.json"  # every command's output has one: {"stage": command, ...}


def absolute(path: str | os.PathLike) -> Path:
    """``path`` made absolute and normalised, so that ``.`` and ``runs/../x`` have a name and a parent."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def finished_stage(path: Path) -> str | None:
    """The command whose finished output ``path`` holds (its tcal_config.json's stage; a token pool
    is known by its manifest), else None."""
    for name, key, known in ((CONFIG_FILE, "stage", None), ("manifest.json", "format", {"tcal-pool-v1": "pool"}),
                             (MANIFEST, "stage", None)):
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
def atomic_dir(out: str | os.PathLike, *, replace: bool = False, theirs: str = "refuse"):
    """Yield a temporary directory to write into; on success publish it as ``out``.

    On any exception the temporary directory is removed and ``out`` is left as it was.
    ``replace``: swap the whole directory (for internal directories whose files belong together and that hold no
    file of the user's: caches). ``theirs``: see :func:`merge_into`.
    """
    out = absolute(out)
    if out.exists() and not out.is_dir():
        raise TcalError(f"output path {out} exists and is not a directory; choose another --out")
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        yield tmp
        _usual_modes(tmp)
        publish(tmp, out, replace=replace, theirs=theirs)
    finally:
        if tmp.exists():  # failed, or published file by file: only tcal's own temporary folder is left
            shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: str | os.PathLike, out: str | os.PathLike, *, replace: bool = False, stage: str | None = None,
            theirs: str = "refuse") -> Path:
    """A finished directory ``tmp`` becomes ``out``: one rename where ``out`` does not exist yet (or
    ``replace``), else moved into it file by file (see the module docstring); ``out`` gets its manifest."""
    tmp, out = Path(tmp), absolute(out)
    if replace:
        return publish_dir(tmp, out)
    files = tree_files(tmp)
    stage = stage or _stage_of(tmp)
    if out.exists():
        merge_into(tmp, out, files=files, stage=stage, theirs=theirs)
        return out
    publish_dir(tmp, out)
    write_manifest(out, files, stage)
    return out


def _stage_of(root: Path) -> str | None:
    try:
        value = json.loads((root / CONFIG_FILE).read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def tree_files(root: str | os.PathLike, skip: tuple[str, ...] = (MANIFEST,)) -> list[str]:
    """Every file (and link) under ``root``, as sorted relative POSIX paths; ``skip``: top-level names left out."""
    root = Path(root)
    found = []
    for dirpath, dirs, files in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            path = (rel / name).as_posix()
            if path not in skip:
                found.append(path)
    return sorted(found)


def write_manifest(out: str | os.PathLike, files, stage: str | None = None) -> None:
    write_json(Path(out) / MANIFEST, {"format": FILES_FORMAT, "stage": stage, "files": sorted(set(files))})


class Ownership:
    """Which files of a directory tcal wrote (:data:`MANIFEST`). ``owned``: files it may replace or remove;
    ``rewritable(path)``: whether a file at ``path`` may be replaced by one the new output writes there."""

    def __init__(self, owned=(), legacy_dirs=(), everything: bool = False):
        self.owned = set(owned)
        self.legacy_dirs = set(legacy_dirs)  # top-level folders of an older manifest: files rewritten, none removed
        self.everything = everything  # an older output with no manifest, or the caller replaces any file

    def rewritable(self, path: str) -> bool:
        return self.everything or path in self.owned or path.split("/", 1)[0] in self.legacy_dirs


def ownership(out: str | os.PathLike) -> Ownership:
    """What tcal wrote into the directory ``out``: its manifest's files; for an older manifest (top-level names)
    the listed files, and its listed folders' files where rewritten; for a finished output without a manifest
    (its tcal_config.json names the command) any file the new output writes again."""
    out = Path(out)
    try:
        text = (out / MANIFEST).read_text()
    except OSError:
        return Ownership(everything=finished_stage(out) is not None)
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("format") == FILES_FORMAT:
        return Ownership([f for f in data.get("files", []) if isinstance(f, str) and _safe(f)])
    names = [n for n in text.split() if _safe(n) and "/" not in n]
    return Ownership([n for n in names if not (out / n).is_dir() or (out / n).is_symlink()],
                     [n for n in names if (out / n).is_dir() and not (out / n).is_symlink()])


def _safe(rel: str) -> bool:
    """A manifest entry that stays inside its directory."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts


def owned_files(out: str | os.PathLike) -> list[str]:
    """The files tcal wrote into ``out`` that are there now (its manifest's)."""
    out = Path(out)
    return sorted(f for f in ownership(out).owned if (out / f).exists() or (out / f).is_symlink())


def remove_files(root: str | os.PathLike, files) -> None:
    """Unlink ``files`` (relative to ``root``) and remove the folders that leaves empty, up to ``root`` (kept)."""
    root = Path(root)
    parents = set()
    for rel in files:
        p = root / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            continue  # a folder where tcal wrote a file: the user's now; left alone
        parents.update(root / q for q in _ancestors(rel))
    prune(root, parents)


def _ancestors(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def prune(root: Path, dirs) -> None:
    """Remove those of ``dirs`` (under ``root``) that are empty, deepest first."""
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            if d != root and d.is_dir() and not d.is_symlink():
                d.rmdir()


def merge_into(tmp: str | os.PathLike, out: str | os.PathLike, *, files=None, stage: str | None = None,
               theirs: str = "refuse") -> Path:
    """Move the files of ``tmp`` into the existing directory ``out`` (see the module docstring). ``theirs``: what
    happens where a file of the user's (one the manifest does not list) has the name of a new file: ``refuse`` (a
    one-line error before anything moves) or ``replace`` (as transformers' save_pretrained does into a folder)."""
    tmp, out = Path(tmp), Path(out)
    files = tree_files(tmp) if files is None else files
    own = ownership(out) if theirs == "refuse" else Ownership(ownership(out).owned, everything=True)
    new = set(files)
    stale = sorted(f for f in own.owned - new if (out / f).exists() or (out / f).is_symlink())
    for rel in files:
        blocked = _blocking(out, rel, own, stale)
        if blocked is not None:
            raise TcalError(f"{out / blocked} is not a file tcal wrote there, and the new output writes "
                            f"{rel}; move it away and run again")
    remove_files(out, stale)
    for rel in files:
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_dir() and not dst.is_symlink():  # an empty folder where the new output has a file
            dst.rmdir()
        os.replace(tmp / rel, dst)
    shutil.rmtree(tmp, ignore_errors=True)
    write_manifest(out, files, stage or _stage_of(out))
    return out


def _blocking(out: Path, rel: str, own: Ownership, stale) -> str | None:
    """What stops ``rel`` from being written into ``out``: a file of the user's at that path or at one of its
    folders' paths, or a folder there that holds files of the user's (None: nothing)."""
    stale = set(stale)
    p = out / rel
    if p.is_symlink() or p.is_file():
        return None if own.rewritable(rel) else rel
    if p.is_dir():
        inside = [f"{rel}/{f}" for f in tree_files(p, skip=())]
        theirs = [f for f in inside if f not in stale]
        return theirs[0] if theirs else None
    for q in _ancestors(rel):
        a = out / q
        if a.is_symlink() or a.is_file():
            return None if q in stale else q
    return None


def written_files(out: str | os.PathLike) -> list[str]:
    """What the last tcal publish into ``out`` wrote there, by top-level name (its manifest), for the closing line
    of a command."""
    top = sorted({f.split("/", 1)[0] for f in ownership(out).owned})
    return top or sorted(p.name for p in Path(out).iterdir() if not p.name.startswith("."))


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
    """Move a finished directory ``tmp`` to ``out`` by renames only; returns ``out``. For directories no user
    writes into (caches, tcal's own temporary folders).

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
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: a shared cache must stay readable
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
