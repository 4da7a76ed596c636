"""Output directories that never lose a user's file and never stay half-written.

A new directory is written beside its final place and published in one rename. Every published directory carries
a manifest (:data:`MANIFEST`: the command that wrote it and every file tcal wrote there, at any depth).

Replacing an existing directory (``--out .``, an empty folder, or a finished tcal output being overwritten) is one
atomic swap too, so that a run killed at any moment leaves the old output or the new one, never a mix: the new output
is finished in its temporary folder beside ``OUT``; every file of the user's in ``OUT`` (one the manifest does not
list, at any depth, a link included) is hard-linked into it at the same place, the same file, not a copy; then the
two folders are exchanged in one ``renameat2(RENAME_EXCHANGE)`` and the old one, now holding only tcal's old files
and second names of the user's, is deleted. (A shell whose current folder is ``OUT`` itself, as with ``--out .``,
still stands in the old folder afterwards and sees the new output once it enters ``OUT`` again: ``cd "$PWD"``.) A file of the user's where the new output has one is refused, never
replaced, before anything moves. Where the file system cannot exchange, ``OUT`` is renamed aside
(``.OUT.old-PID``) and the new folder renamed in: a run killed between those two renames leaves no ``OUT``, and the
next run on it puts the old one back. Leftovers of killed runs (``.OUT.tmp-*``, ``.OUT.old-*``) are removed by the
next run on that output, under its lock.

Nothing tcal deletes, replaces or writes is reached through a symbolic link it did not make: a link of the user's
inside an output is kept as a link (never followed), and a manifest entry that leaves its folder, or passes through
a link, is refused. A manifest is read as data: one that is not tcal's format is a one-line refusal.

One run per output: :func:`check_out` takes a lock beside the output (``.OUT.tcal-lock``, an ``flock`` that the
kernel drops when the process ends) before any work; a second run on the same ``--out`` is refused in one line
naming the first (its pid and command). The lock is released when the command ends; a lock file left by a killed
run is taken over with a warning.

An output written before manifests listed every file (a plain list of top-level names, or none beside a
``tcal_config.json``) is still tcal's: its listed top-level files are replaced or removed as above, and inside its
folders only the files the new output writes again are replaced; nothing else there is removed, since tcal cannot
tell which of those files it wrote.

Unfinished work beside an output (``OUT.partial``) has its own manifest: :mod:`tcal.utils.partial`.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import warnings
from pathlib import Path

from tcal.utils.errors import TcalError, TcalWarning

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


NAME_MAX = 255  # bytes in one file name (Linux, macOS)
PARTIAL_SUFFIX = ".partial"  # OUT.partial: see tcal.utils.partial


def display(path) -> str:
    """``path`` as it can be printed: a name that is not UTF-8 with its odd bytes escaped."""
    return os.fsencode(os.fspath(path)).decode("utf-8", "backslashreplace")


def short_name(name: str) -> str:
    """``name`` as tcal's own names beside it use it (``.NAME.tmp-*``, ``.NAME.tcal-lock``): cut, with a hash of
    the whole, where those would be longer than a file name may be."""
    if len(os.fsencode(name)) <= 200:
        return name
    digest = hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    return os.fsdecode(os.fsencode(name)[:100]) + "-" + digest


def check_out(out, stage: str, overwrite: bool = False, flag: str = "--out") -> Path:
    """Refuse an output directory that would cost the user files, before any work is done; then take its lock
    (:func:`lock_out`: one run per output) and remove what killed runs left beside it (:func:`tidy_leftovers`).

    Accepted: a path that does not exist yet, an empty directory, or (with ``overwrite``) a
    finished output of the same command; in each case a directory must be creatable where the
    output is written (see :func:`_check_writable`).
    """
    if not str(out).strip():
        raise TcalError(f"{flag} is empty; give an output directory")
    path = absolute(out)
    try:
        os.fsencode(str(path)).decode("utf-8")
    except UnicodeDecodeError:
        raise TcalError(f"{flag} {display(out)} is not a UTF-8 name; choose another {flag}") from None
    if len(os.fsencode(path.name)) + len(PARTIAL_SUFFIX) > NAME_MAX:
        raise TcalError(f"{flag} {out}: its name is {len(os.fsencode(path.name))} bytes, and the unfinished work "
                        f"kept beside it ({path.name[:12]}...{PARTIAL_SUFFIX}) would exceed the {NAME_MAX} a file "
                        f"name may have; choose a name of at most {NAME_MAX - len(PARTIAL_SUFFIX)} bytes")
    if path.is_symlink():
        target = os.readlink(path)
        if not path.exists():
            raise TcalError(f"{flag} {out} is a symbolic link to {target}, which does not exist; give a directory, "
                            f"not a link")
        raise TcalError(f"{flag} {out} is a symbolic link (to {target}); tcal writes only folders it can prove it "
                        f"owns, so give the folder itself: {flag} {os.path.realpath(path)}")
    if path.exists() and not path.is_dir():
        raise TcalError(f"{flag} {out} is a file, not a directory; choose another {flag}")
    # the output is written beside its final place (atomic_dir, OUT.partial) and, into an existing
    # directory, swapped with it
    _check_writable(path.parent, out, flag)
    if path.is_dir():
        _check_writable(path, out, flag)
    lock_out(path, flag)
    tidy_leftovers(path)
    if path.is_dir() and any(path.iterdir()):
        done = finished_stage(path)
        if done != stage:
            what = f"a `tcal {done}` output" if done else "files tcal did not write"
            raise TcalError(f"{flag} {out} already holds {what}; choose a new or empty directory")
        if not overwrite:
            raise TcalError(f"{flag} {out} holds a finished `tcal {stage}` output; pass --overwrite to replace "
                            "it (only tcal's own files are replaced) or choose another directory")
        ownership(path)  # a manifest that is not tcal's is refused now, not once the work is done
    return path


# -- one run per output ------------------------------------------------------------------------------------------------

_LOCKS: dict[str, int] = {}  # output path -> the open lock file this process holds


def lock_path(out) -> Path:
    out = absolute(out)
    return out.with_name(f".{short_name(out.name)}.tcal-lock")


def _holder(fd: int) -> str:
    """Who wrote the lock file: ``pid N: COMMAND``."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 65536).decode("utf-8", "replace"))
        return f"pid {int(data['pid'])}: {str(data['command'])[:200]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that left no name"


def lock_out(out, flag: str = "--out") -> None:
    """Hold the lock of the output ``out`` until this command ends (:func:`release_locks`): a one-line refusal
    where another run holds it. Taken again by the process that holds it, it is a no-op; under torchrun only rank 0
    takes it (the others work on rank 0's output)."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return
    out = absolute(out)
    if str(out) in _LOCKS:
        return
    lock = lock_path(out)
    made = [d for d in [lock.parent, *lock.parent.parents] if not d.exists()]
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise TcalError(f"cannot take the lock {lock} of {flag} {out} ({e.strerror}); "
                            f"move that file away or choose another {flag}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise TcalError(f"{flag} {out} is being written by another tcal run ({holder}); wait for it to end or "
                            f"choose another {flag}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino
        except OSError:
            same = False
        if same:  # not a file its last holder removed while this process opened it
            break
        os.close(fd)
    if os.fstat(fd).st_size:
        warnings.warn(f"{flag} {out} was locked by a run that has ended without releasing it ({_holder(fd)}); "
                      "taking its lock over", TcalWarning, stacklevel=2)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": " ".join(["tcal", *sys.argv[1:]])}).encode())
    if not _LOCKS:
        atexit.register(release_locks)
    _LOCKS[str(out)] = fd
    _MADE[str(out)] = made


_MADE: dict[str, list[Path]] = {}  # output path -> the folders made for its lock (removed with it when left empty)


def release_locks() -> None:
    """Release every output lock this process holds (the end of a command)."""
    for key, fd in list(_LOCKS.items()):
        with contextlib.suppress(OSError):
            os.unlink(lock_path(key))
        with contextlib.suppress(OSError):
            os.close(fd)
        del _LOCKS[key]
        for d in _MADE.pop(key, []):
            with contextlib.suppress(OSError):
                d.rmdir()


def tidy_leftovers(out) -> list[str]:
    """Remove what killed runs on the output ``out`` left beside it (call with its lock held): temporary folders
    (``.OUT.tmp-*``) and an old output moved aside (``.OUT.old-*``), which is put back where ``OUT`` itself is
    missing (killed between the two renames of :func:`swap_in`). Returns what was done, one line each."""
    out = absolute(out)
    done = []
    if not out.parent.is_dir():
        return done
    prefix = f".{short_name(out.name)}."
    for p in sorted(out.parent.iterdir()):
        if not p.name.startswith(prefix) or not p.name[len(prefix):].startswith(("tmp-", "old-")):
            continue
        if p.name[len(prefix):].startswith("old-") and p.is_dir() and not p.is_symlink() \
                and not (out.exists() or out.is_symlink()):
            os.rename(p, out)
            done.append(f"{out} was put back from {p.name}, where a killed run had moved it")
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        done.append(f"removed {p.name}, left by a killed run")
    for line in done:
        if "put back" in line:
            warnings.warn(line, TcalWarning, stacklevel=2)
        else:
            logging.getLogger(__name__).info(line)
    return done


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
    tmp = make_temp_dir(out.parent, temp_prefix(out))
    try:
        with disk_full_names(out):
            yield tmp
            _usual_modes(tmp)
            publish(tmp, out, replace=replace, theirs=theirs)
    finally:
        if tmp.exists():  # failed, or published file by file: only tcal's own temporary folder is left
            shutil.rmtree(tmp, ignore_errors=True)


def temp_prefix(out) -> str:
    """The name prefix of tcal's temporary folders beside the output ``out`` (removed by :func:`tidy_leftovers`)."""
    return f".{short_name(Path(out).name)}.tmp-"


def no_space(err: BaseException) -> bool:
    """Whether ``err`` says the disk is full (an OSError, or the error of a library that wrote the file:
    safetensors, torch.save)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(err)
    return type(err).__name__ == "SafetensorError" and ("No space left" in text or "StorageFull" in text) or \
        isinstance(err, RuntimeError) and ("file write failed" in text or "No space left" in text)


@contextlib.contextmanager
def disk_full_names(where):
    """A full disk while writing ``where`` becomes one line naming the folder (what was there stays as it was)."""
    try:
        yield
    except Exception as err:
        if no_space(err):
            raise TcalError(f"the disk is full: {where} could not be written (its earlier content, if any, is as it "
                            "was); free some space and run again") from None
        raise


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


def read_own_text(path: Path, bad: str, advice: str) -> str | None:
    """The text of a file tcal keeps beside its work (a manifest, a mark), read as data: None where there is none; a
    link, a folder or bytes that are not UTF-8 text are a one-line refusal, "``bad`` (why); ``advice``"."""
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_file():
        raise TcalError(f"{bad} (not a plain file); {advice}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise TcalError(f"{bad} (not UTF-8 text); {advice}") from None
    except OSError as e:
        raise TcalError(f"{bad} ({e.strerror}); {advice}") from None


def read_manifest(out: str | os.PathLike):
    """The manifest of ``out`` as data: None where there is none; the list of files (a dict ``{"format", "stage",
    "files"}``), or the top-level names of an older manifest (a list of names). Anything else is a one-line
    refusal: a manifest tcal did not write is never used to replace or remove a file."""
    path = Path(out) / MANIFEST
    bad = f"{path} is not a manifest tcal wrote"
    text = read_own_text(path, bad, "move it away and run again")
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:  # an older manifest: top-level names, one a line
        names = text.split()
        bad_name = next((n for n in names if not _safe(n) or "/" in n), None)
        if bad_name is not None:
            raise TcalError(f"{bad} (it lists {bad_name!r}, not a name inside the folder); move it away and run "
                            "again") from None
        return names
    if not (isinstance(data, dict) and data.get("format") == FILES_FORMAT):
        raise TcalError(f"{bad} (not a {FILES_FORMAT} object); move it away and run again")
    files = data.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise TcalError(f"{bad} (its files are not a list of names); move it away and run again")
    bad_name = next((f for f in files if not _safe(f)), None)
    if bad_name is not None:
        raise TcalError(f"{bad} (it lists {bad_name!r}, not a path inside the folder); move it away and run again")
    if data.get("stage") is not None and not isinstance(data.get("stage"), str):
        raise TcalError(f"{bad} (its stage is not a name); move it away and run again")
    return data


def ownership(out: str | os.PathLike) -> Ownership:
    """What tcal wrote into the directory ``out``: its manifest's files; for an older manifest (top-level names)
    the listed files, and its listed folders' files where rewritten; for a finished output without a manifest
    (its tcal_config.json names the command) any file the new output writes again. A manifest that is not
    tcal's: a one-line refusal (:func:`read_manifest`)."""
    out = Path(out)
    data = read_manifest(out)
    if data is None:
        return Ownership(everything=finished_stage(out) is not None)
    if isinstance(data, dict):
        return Ownership(data["files"])
    return Ownership([n for n in data if not (out / n).is_dir() or (out / n).is_symlink()],
                     [n for n in data if (out / n).is_dir() and not (out / n).is_symlink()])


def _safe(rel: str) -> bool:
    """A manifest entry that stays inside its directory (by its spelling: see :func:`inside` for links)."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "." not in parts and "" not in parts \
        and "\\" not in rel and "\0" not in rel


def inside(root: str | os.PathLike, rel: str) -> bool:
    """Whether ``root/rel`` lies inside ``root`` without following a link: ``rel`` stays inside by its spelling and
    none of the folders between ``root`` and it is a symbolic link (the last part may be one: it is then the link
    itself that is read, replaced or removed)."""
    if not _safe(rel):
        return False
    here = Path(root)
    for part in rel.split("/")[:-1]:
        here = here / part
        if here.is_symlink():
            return False
    return True


def owned_files(out: str | os.PathLike) -> list[str]:
    """The files tcal wrote into ``out`` that are there now (its manifest's)."""
    out = Path(out)
    return sorted(f for f in ownership(out).owned if (out / f).exists() or (out / f).is_symlink())


def remove_files(root: str | os.PathLike, files) -> None:
    """Unlink ``files`` (relative to ``root``) and remove the folders that leaves empty, up to ``root`` (kept)."""
    root = Path(root)
    parents = set()
    for rel in files:
        if not inside(root, rel):
            continue  # through a link, or out of the folder: not tcal's to remove
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
    """The finished folder ``tmp`` replaces the existing directory ``out`` in one swap, keeping the user's files
    (see the module docstring). ``theirs``: what happens where a file of the user's (one the manifest does not list)
    has the name of a new file: ``refuse`` (a one-line error before anything moves) or ``replace`` (as transformers'
    save_pretrained does into a folder)."""
    tmp, out = Path(tmp), Path(out)
    files = tree_files(tmp) if files is None else files
    stage = stage or _stage_of(out)
    keep, empty = _theirs(out, ownership(out), set(files), theirs)
    for rel in keep:  # a second name of the same file: nothing is copied, nothing can be half-written
        _make_parents(tmp, out, rel)
        try:
            os.link(out / rel, tmp / rel, follow_symlinks=False)
        except OSError as e:
            raise TcalError(f"cannot keep {out / rel} in the new output ({e.strerror}); move it away and run "
                            "again") from None
    for rel in empty:
        _make_parents(tmp, out, rel + "/.")
    write_manifest(tmp, files, stage)
    swap_in(tmp, out)
    return out


def _make_parents(tmp: Path, out: Path, rel: str) -> None:
    """The folders of ``rel`` in ``tmp``, those that the new output does not have with the modes of ``out``'s."""
    for q in reversed(_ancestors(rel)):
        if q == ".":
            continue
        d = tmp / q
        if not d.is_dir():
            d.mkdir()
            with contextlib.suppress(OSError):
                shutil.copymode(out / q, d)


def _theirs(out: Path, own: Ownership, new: set[str], theirs: str) -> tuple[list[str], list[str]]:
    """(the user's files and links in ``out``, the user's empty folders): what a new output of ``new`` files keeps.
    A file of the user's where the new output writes one, at one of its folders' places, or a folder of the user's
    where it writes a file: a one-line refusal (``theirs="replace"``: a same-named file is replaced)."""
    new_dirs = {q for f in new for q in _ancestors(f)}
    dev = os.lstat(out).st_dev
    keep, empty = [], []
    for dirpath, dirs, names in os.walk(out):
        rel_dir = Path(dirpath).relative_to(out).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        entries = list(names)
        for d in list(dirs):
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                entries.append(d)  # a link of the user's to a folder: kept as a link, never followed
            elif os.lstat(full).st_dev != dev:
                raise TcalError(f"{full} is a mount point inside {out}; tcal replaces only folders on one file "
                                "system: unmount it or choose another --out")
        if prefix and not dirs and not names:
            rel = prefix[:-1]
            if rel not in new and not any(q in new for q in _ancestors(rel)):
                empty.append(rel)
        for name in entries:
            rel = prefix + name
            if rel == MANIFEST or rel in own.owned or (rel in new and own.rewritable(rel)):
                continue  # tcal's: replaced or removed
            if rel in new and theirs == "replace":
                continue
            clash = rel if rel in new or rel in new_dirs else next((q for q in _ancestors(rel) if q in new), None)
            if clash is not None:
                written = rel if rel in new else next((f for f in sorted(new) if f.startswith(rel + "/")), clash)
                raise TcalError(f"{out / clash} is not a file tcal wrote there, and the new output writes "
                                f"{written}; move it away and run again")
            keep.append(rel)
    return keep, empty


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Exchange two paths in one step (Linux renameat2); False where the system or file system cannot."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def swap_in(new: str | os.PathLike, out: str | os.PathLike) -> None:
    """The finished folder ``new`` (beside ``out``) becomes ``out`` and the old ``out`` is deleted: one exchange
    where the file system has it, else two renames with the old folder kept as ``.OUT.old-PID`` between them (put
    back by the next run where a kill left no ``out``: :func:`tidy_leftovers`)."""
    new, out = Path(new), Path(out)
    try:
        here = Path(os.getcwd())
    except OSError:
        here = None
    if _exchange(new, out):
        old = new
    else:
        old = out.with_name(f".{short_name(out.name)}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(new, out)
    if here is not None and (here == out or out in here.parents):  # --out . : this process goes on in the new folder
        with contextlib.suppress(OSError):
            os.chdir(out / here.relative_to(out))
    shutil.rmtree(old, ignore_errors=True)  # tcal's old files, and second names of the user's: never a link followed


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
        old = out.with_name(f".{short_name(out.name)}.old-{os.getpid()}")
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
