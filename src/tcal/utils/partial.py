"""A command's unfinished work beside its output: ``OUT.partial/``, for resuming and for watching a run.

The folder carries :data:`MARK`: the command that owns it, the settings that shape its result (a resumed run must
give the same ones) and every file tcal wrote there, at any depth. tcal reads, replaces and removes only those files:
a folder named ``OUT.partial`` without the mark is refused in one line and never used or removed, and a file of the
user's inside a marked one stays where it is (the folder then stays too, once tcal's files are gone).

Every write into the folder goes through :class:`Work`, which records it: :meth:`Work.write_text`,
:meth:`Work.write_json`, :meth:`Work.dir` (a folder written whole and swapped in, e.g. a checkpoint),
:meth:`Work.record` (a file another library appended to or wrote). :func:`open_work` checks the folder before any
work: it resumes, starts over where nothing could be resumed, or refuses.

A folder without the mark is refused whatever it holds (a checkpoint included): tcal cannot tell which of its files
it wrote. A mark is read as data (:func:`read_mark`): one that is not what tcal writes, or that lists a path out of
the folder, is a one-line refusal and nothing it lists is removed; a recorded file is reached only without passing
through a link. A mark of an older tcal that listed no files is recognised where the folder is clearly tcal's (each
command says how: its ``legacy`` function) and those files are recorded, nothing else. What a killed run left in the
folder (temporary folders, an old checkpoint moved aside) is tidied by the next run that opens it (:meth:`Work.tidy`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from tcal.utils.atomic import (
    MANIFEST,
    _ancestors,
    _safe,
    _usual_modes,
    absolute,
    disk_full_names,
    inside,
    make_temp_dir,
    owned_files,
    prune,
    publish,
    read_own_text,
    remove_files,
    temp_prefix,
    tree_files,
    write_json,
)
from tcal.utils.errors import TcalError

MARK = ".tcal_partial"  # {"format": PARTIAL_FORMAT, "stage": command, "settings": {...}, "files": [...], "temps": []}
PARTIAL_FORMAT = "tcal-partial-v2"


def partial_dir(out) -> Path:
    """Where the unfinished work of the output ``out`` is kept: ``OUT.partial`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def read_mark(path: Path) -> dict | None:
    """The mark of a partial folder, read as data (None: there is none, so the folder is not tcal's). A mark that is
    not what tcal writes (not JSON, another shape, a recorded path that leaves the folder) is a one-line refusal:
    nothing it lists is ever removed."""
    f = Path(path) / MARK
    bad, advice = f"{f} is not a mark tcal wrote", f"move {Path(path)} away or choose another --out"
    text = read_own_text(f, bad, advice)
    if text is None:
        return None
    try:
        mark = json.loads(text)
    except ValueError:
        raise TcalError(f"{bad} (not JSON text); {advice}") from None
    if not (isinstance(mark, dict) and isinstance(mark.get("stage"), str)):
        raise TcalError(f"{bad} (not an object naming its command); move {Path(path)} away or choose another --out")
    for key in ("files", "temps"):
        value = mark.get(key, [])
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise TcalError(f"{bad} (its {key} are not a list of paths); move {Path(path)} away or choose another "
                            "--out")
        outside = next((v for v in value if not _inside(v)), None)
        if outside is not None:
            raise TcalError(f"{bad} (it lists {outside!r}, not a path inside the folder); move {Path(path)} away or "
                            "choose another --out")
    if mark.get("settings") is not None and not isinstance(mark["settings"], dict):
        raise TcalError(f"{bad} (its settings are not an object); move {Path(path)} away or choose another --out")
    return mark


class Work:
    """The partial folder ``path`` of a ``stage`` (a command); created, with its mark, at the first write."""

    def __init__(self, path, stage: str, settings: dict | None = None):
        self.path, self.stage, self.settings = Path(path), stage, settings

    # -- the mark -------------------------------------------------------------------------------------------------

    def _mark(self) -> dict:
        mark = read_mark(self.path)
        if mark is None or "files" not in mark:
            mark = {"stage": self.stage, "settings": self.settings, "files": [], "temps": [],
                    **({} if mark is None else mark)}
        mark.setdefault("temps", [])
        mark["format"] = PARTIAL_FORMAT
        return mark

    def _save(self, mark: dict) -> None:
        mark["files"] = sorted(set(mark["files"]))
        write_json(self.path / MARK, mark)

    def ensure(self) -> Path:
        """The folder, made (with its mark) where it is not there yet."""
        if not (self.path / MARK).is_file():
            self.path.mkdir(parents=True, exist_ok=True)
            self._save(self._mark())
        return self.path

    @property
    def exists(self) -> bool:
        return (self.path / MARK).is_file()

    @property
    def files(self) -> list[str]:
        """The files tcal wrote here (recorded), whether or not they are still there."""
        return list(self._mark()["files"]) if self.exists else []

    def saved_settings(self) -> dict | None:
        mark = read_mark(self.path)
        return mark.get("settings") if mark else None

    def record(self, *rels: str) -> None:
        """Add files tcal wrote under the folder (relative paths) to its mark."""
        self.ensure()
        mark = self._mark()
        mark["files"] += list(rels)
        self._save(mark)

    def adopt(self, rel: str) -> None:
        """Record the files of the finished output tcal published at ``rel`` (those its manifest lists)."""
        inner = self.path / rel
        files = owned_files(inner) + ([MANIFEST] if (inner / MANIFEST).is_file() else [])
        self.record(*(f"{rel}/{f}" for f in files))

    # -- writing --------------------------------------------------------------------------------------------------

    def write_text(self, rel: str, text: str) -> Path:
        """Write a file (through a temporary file and a rename) and record it."""
        self.ensure()
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with disk_full_names(path):
            tmp.write_text(text)
        os.replace(tmp, path)
        self.record(rel)
        return path

    def write_json(self, rel: str, obj) -> Path:
        return self.write_text(rel, json.dumps(obj, indent=2, default=str) + "\n")

    @contextlib.contextmanager
    def dir(self, rel: str):
        """Yield a temporary folder to write ``rel`` into; on success it replaces ``rel`` whole (files that belong
        together, such as a checkpoint's model and its resume state), and a file of the user's in the old ``rel``
        moves into the new one. A run killed between the renames leaves the old folder as ``.NAME.old-PID``,
        recorded."""
        self.ensure()
        dst = self.path / rel
        if not inside(self.path, rel) or dst.is_symlink():
            raise TcalError(f"{dst} is a symbolic link tcal did not make; move it away and run again")
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(dst.parent, temp_prefix(dst))
        tmp_rel = tmp.relative_to(self.path).as_posix()
        self._temps(add=[tmp_rel])
        try:
            with disk_full_names(dst):
                yield tmp
                _usual_modes(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            self._temps(remove=[tmp_rel])
            raise
        new = [f"{rel}/{f}" for f in tree_files(tmp, skip=())]
        mark = self._mark()
        old = [f for f in mark["files"] if f.startswith(rel + "/")]
        aside = None
        if dst.exists() or dst.is_symlink():
            aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            aside_rel = aside.relative_to(self.path).as_posix()
            mark["files"] += [aside_rel + f[len(rel):] for f in old]  # recorded before the rename
            self._save(mark)
            os.replace(dst, aside)
        os.replace(tmp, dst)
        mark = self._mark()
        mark["files"] = [f for f in mark["files"] if f not in old] + new
        mark["temps"] = [t for t in mark["temps"] if t != tmp_rel]
        self._save(mark)
        if aside is not None:
            self._empty_aside(aside, dst, old, rel)

    def _empty_aside(self, aside: Path, dst: Path, old: list[str], rel: str) -> None:
        """The old folder of :meth:`dir`: its tcal files removed, the user's moved into the new folder."""
        aside_rel = aside.relative_to(self.path).as_posix()
        mine = {aside_rel + f[len(rel):] for f in old}
        for f in tree_files(aside, skip=()):
            if f"{aside_rel}/{f}" in mine or (dst / f).exists():
                continue
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            os.replace(aside / f, dst / f)
        remove_files(self.path, sorted(mine))
        prune(self.path, [aside])
        mark = self._mark()
        mark["files"] = [f for f in mark["files"] if f not in mine]
        self._save(mark)

    def tidy(self) -> list[str]:
        """Finish what a killed run left here: its temporary folders removed, and an old folder of :meth:`dir` that
        was moved aside (``.NAME.old-PID``) put back where the new one never came, else emptied into it. Returns
        what was done, one line each."""
        if not self.exists:
            return []
        done = []
        mark = self._mark()
        for t in mark["temps"]:
            if inside(self.path, t) and (self.path / t).is_dir() and not (self.path / t).is_symlink():
                shutil.rmtree(self.path / t, ignore_errors=True)
                done.append(f"removed {t}, left by a killed run")
        if mark["temps"]:
            self._temps(remove=mark["temps"])
        asides = sorted({m.group(0) for f in self._mark()["files"] if (m := _ASIDE.match(f))})
        for aside_rel in asides:
            head, _, name = aside_rel.rpartition("/")
            rel = (head + "/" if head else "") + _ASIDE_NAME.match(name).group(1)
            aside, dst = self.path / aside_rel, self.path / rel
            if not inside(self.path, aside_rel) or aside.is_symlink() or not aside.is_dir():
                continue
            recorded = [f for f in self._mark()["files"] if f.startswith(aside_rel + "/")]
            if dst.exists() or dst.is_symlink():
                self._empty_aside(aside, dst, [rel + f[len(aside_rel):] for f in recorded], rel)
                done.append(f"removed {aside_rel}, left by a killed run")
            else:
                os.replace(aside, dst)
                mark = self._mark()
                mark["files"] = [rel + f[len(aside_rel):] if f in recorded else f for f in mark["files"]]
                self._save(mark)
                done.append(f"put {rel} back from {aside_rel}, where a killed run had moved it")
        return done

    def _temps(self, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        mark = self._mark()
        mark["temps"] = [t for t in mark["temps"] if t not in set(remove)] + list(add)
        self._save(mark)

    # -- moving and removing --------------------------------------------------------------------------------------

    def remove(self, rel: str) -> None:
        """Remove the recorded file ``rel``, or the recorded files under the folder ``rel``."""
        if not self.exists:
            return
        mark = self._mark()
        gone = [f for f in mark["files"] if f == rel or f.startswith(rel + "/")]
        remove_files(self.path, gone)
        mark["files"] = [f for f in mark["files"] if f not in gone]
        self._save(mark)

    def move(self, src: str, dst: str) -> None:
        """Move the recorded files under the folder ``src`` to the folder ``dst`` (kept from an earlier run: its
        recorded files removed first)."""
        self.remove(dst)
        mark = self._mark()
        moved = [f for f in mark["files"] if f.startswith(src + "/") and inside(self.path, f)
                 and inside(self.path, dst + f[len(src):])]
        for f in moved:
            to = self.path / (dst + f[len(src):])
            to.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path / f, to)
        prune(self.path, {self.path / q for f in moved for q in _ancestors(f)})
        mark["files"] = [f for f in mark["files"] if f not in moved] + [dst + f[len(src):] for f in moved]
        self._save(mark)

    def take(self, rel: str, into: Path) -> None:
        """Move the recorded files under the folder ``rel`` into the folder ``into`` (a finished output being
        written), forgetting them here."""
        mark = self._mark()
        moved = [f for f in mark["files"] if f.startswith(rel + "/") and inside(self.path, f)
                 and ((self.path / f).exists() or (self.path / f).is_symlink())]
        for f in moved:
            to = Path(into) / f[len(rel) + 1:]
            to.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path / f, to)
        prune(self.path, {self.path / q for f in moved for q in _ancestors(f)})
        mark["files"] = [f for f in mark["files"] if f not in moved]
        self._save(mark)

    def discard(self) -> None:
        """Remove every file tcal wrote here, its temporary folders and the mark; the folder goes too unless it
        holds a file of the user's."""
        if not self.exists:
            return
        mark = self._mark()
        for t in mark["temps"]:
            if _inside(t):
                shutil.rmtree(self.path / t, ignore_errors=True)  # a temporary folder tcal made and nobody knows of
        remove_files(self.path, mark["files"])
        (self.path / MARK).unlink()
        prune(self.path.parent, [self.path])

    def publish(self, out, stage: str | None = None) -> Path:
        """The recorded files become the finished output ``out`` (:func:`tcal.utils.atomic.publish`); the folder is
        then discarded. One rename where it holds nothing else and ``out`` does not exist yet."""
        out = absolute(out)
        mark = self._mark()
        files = [f for f in mark["files"] if inside(self.path, f)
                 and ((self.path / f).exists() or (self.path / f).is_symlink())]
        others = set(tree_files(self.path, skip=(MARK,))) - set(files)
        if not others and not mark["temps"] and not out.exists():
            (self.path / MARK).unlink()
            return publish(self.path, out, stage=stage or self.stage)
        tmp = make_temp_dir(out.parent, temp_prefix(out))  # beside the folder: the same file system
        try:
            for f in files:
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.path / f, tmp / f)
            publish(tmp, out, stage=stage or self.stage)
        except BaseException:
            for f in files:  # refused (a file of the user's in the way): the finished work stays to resume
                if (tmp / f).exists():
                    os.replace(tmp / f, self.path / f)
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self.discard()
        return out


def _inside(rel: str) -> bool:
    """A recorded path that stays inside the folder (by its spelling; :func:`tcal.utils.atomic.inside` for links)."""
    return _safe(rel)


# an old folder that Work.dir moved aside: (its path up to) .NAME.old-PID
_ASIDE = re.compile(r"^(?:[^/]+/)*\.[^/]+\.old-\d+(?=/)")
_ASIDE_NAME = re.compile(r"^\.(.+)\.old-\d+$")


def has_files(work: Work) -> bool:
    """Whether the work holds any file tcal wrote (the default test of progress worth resuming)."""
    return any((work.path / f).exists() for f in work.files)


READ = "read"  # in a run's settings: {setting: identity of the files it named} (read_settings)
READ_KEYS = ("teacher", "hybrid", "model", "data", "mix_data", "eval")  # the settings that name files a run reads


def identity(spec) -> list | None:
    """What the path ``spec`` names, as it is now: its real path and the size and modification time of the file, or
    of every file under the folder; None where ``spec`` names no file (a corpus spec, a built-in teacher)."""
    if not isinstance(spec, str) or not spec.strip():
        return None
    path = Path(os.path.expanduser(spec))
    try:
        if not path.exists():
            return None
        real = os.path.realpath(path)
        if path.is_file():
            st = path.stat()
            return [real, st.st_size, st.st_mtime_ns]
        files = []
        for dirpath, dirs, names in os.walk(real):
            dirs.sort()
            for n in sorted(names):
                st = os.stat(os.path.join(dirpath, n))
                files.append([os.path.relpath(os.path.join(dirpath, n), real), st.st_size, st.st_mtime_ns])
            if len(files) > 10_000:
                break
        return [real, files]
    except OSError:
        return None


def read_settings(settings: dict, keys: Iterable[str] = READ_KEYS) -> dict:
    """``settings`` with what its path settings name now (:func:`identity`) under :data:`READ`: a resume then
    compares the files read, not how they were spelled (the same teacher by another path resumes; another teacher
    by the same relative name from another folder, or a model re-converted in place, is refused)."""
    read = {k: ident for k in keys if (ident := identity(settings.get(k))) is not None}
    return {**settings, READ: read} if read else dict(settings)


def differing(saved: dict, now: dict, free: Iterable[str] = (), defaults: dict | None = None) -> list[str]:
    """The settings, other than ``free`` ones, whose values differ between a saved run and now (``defaults``: what a
    setting missing from one of them was). A setting whose files both name (:func:`read_settings`) differs where
    those files differ, however it was spelled."""
    defaults = defaults or {}
    read_saved = saved.get(READ) if isinstance(saved.get(READ), dict) else {}
    read_now = now.get(READ) if isinstance(now.get(READ), dict) else {}
    keys = (set(saved) | set(now)) - set(free) - {READ}
    diff = []
    for k in sorted(keys):
        if k in read_saved or k in read_now:
            if read_saved.get(k) != read_now.get(k):
                diff.append(k)
        elif saved.get(k, defaults.get(k)) != now.get(k, defaults.get(k)):
            diff.append(k)
    return diff


def open_work(out, stage: str, *, settings: dict | None = None, resume: bool = False,
              progress: Callable[[Work], bool] = has_files,
              changed: Callable[[dict, dict], list[str]] = differing,
              legacy: Callable[[Path], tuple[list[str], dict | None] | None] | None = None,
              resumes: bool = True) -> Work:
    """Check ``OUT.partial`` before any work and return the run's :class:`Work`.

    - none there: a fresh one (made at its first write);
    - one without tcal's mark (and not ``legacy``'s): a one-line error, the folder left as it is;
    - one of another command: a one-line error;
    - one holding nothing to resume (``progress``): its files are removed and the run starts over;
    - one with progress: without ``resume`` a one-line error, with it the saved ``settings`` must equal these
      (``changed`` lists those that do not) and the run goes on from it. ``resumes=False``: the command resumes
      whenever it finds work (tcal eval), so no flag is needed.
    """
    path = partial_dir(absolute(out))
    work = Work(path, stage, settings)
    if not (path.exists() or path.is_symlink()):
        return work
    mark = read_mark(path) if path.is_dir() and not path.is_symlink() else None
    if mark is not None and "files" not in mark and legacy is not None:  # marked by a tcal that listed no files
        adopted = legacy(path)
        if adopted is not None:
            files, saved = adopted
            work.settings = saved
            work.record(*files)
            work.settings = settings
            mark = read_mark(path)
    if mark is None:
        raise TcalError(f"{path} exists and tcal did not write it (it has no {MARK}); tcal keeps the unfinished work of "
                        f"--out {out} there, so move that folder away or choose another --out")
    if mark.get("stage") != stage:
        raise TcalError(f"{path} holds an unfinished `tcal {mark.get('stage')}`, not `tcal {stage}`; choose another "
                        "--out, or finish that run first")
    for line in work.tidy():
        logging.getLogger(__name__).info(line)
    if not progress(work):
        work.discard()
        return Work(path, stage, settings)
    if resumes and not resume:
        raise TcalError(f"{path} holds an interrupted `tcal {stage}`; pass --resume to continue it, or delete it to "
                        "start over")
    saved = mark.get("settings")
    if isinstance(saved, dict) and settings is not None:
        diff = changed(saved, settings)
        if diff:
            raise TcalError(f"cannot resume {path}: settings changed ({', '.join(diff)}); resume with the same "
                            "settings, or delete it to start over")
    if settings is not None and saved != settings:  # what the run now resumes with (free settings may change)
        mark = work._mark()
        mark["settings"] = settings
        work._save(mark)
    return work
