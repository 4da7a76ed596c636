"""What ``tcal eval`` keeps of its tasks' finished pieces in ``OUT.partial/`` (:mod:`tcal.utils.partial`), and how a
task resumes from it: the :class:`~tcal.evaluate.task.Progress` a task's :meth:`~tcal.evaluate.task.Task.run` is
handed. A task's state file (its :attr:`~tcal.evaluate.task.Task.state`) holds the settings it was made with and its
finished entries; it is reused with the same settings only, checked before any model loads where the settings are
known then (:func:`check_known`), and written after every finished piece. The command says what is told to the user
(``say``: it owns the prints)."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from tcal.evaluate.task import Progress, Task
from tcal.utils.errors import TcalError
from tcal.utils.partial import MARK, differing, read_mark


class Told(Progress):
    """A task's progress where nothing is kept (a run that writes no directory): every message is told."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say

    def save(self, message: str) -> None:
        self.tell(message)

    def tell(self, message: str) -> None:
        self.say(message)


class Kept(Told):
    """A task's kept work in OUT.partial/: the state an interrupted run left (:func:`kept_state`), reused where the
    settings match (other settings are refused), and written after each finished piece."""

    def __init__(self, work, task: Task, kept: dict | None, load_s: float, say: Callable[[str], None]):
        super().__init__(say)
        self.work, self.task, self.kept, self.load_s = work, task, kept or {}, load_s
        self.current = None

    def resume(self, settings: dict) -> dict:
        _, key, _ = self.task.state
        if self.kept:
            same_settings(self.work, self.task, self.kept.get("settings"), settings)
        self.current = self.kept if self.kept else {"settings": settings, key: {}}
        return self.current

    def save(self, message: str) -> None:
        self.work.write_json(self.task.state[0], self.current)
        super().save(message)


def same_settings(work, task: Task, saved: dict, now: dict) -> None:
    """Kept work is reused with the settings it was made with only; other settings are a one-line error, and the
    kept work stays."""
    if saved != now:
        raise TcalError(f"cannot resume {work.path / task.state[0]}: {task.name}'s settings changed "
                        f"({', '.join(differing(saved, now))}); rerun with the same settings, or delete {work.path} "
                        "to start this evaluation over")


def kept_state(work, name: str, key: str, kind) -> dict:
    """The state an interrupted run kept in OUT.partial/NAME (``{}`` where there is none), read before any work
    (:func:`tcal.utils.partial.open_work` checked the folder is tcal's). A state file that is not the shape tcal
    writes (entries under ``key`` of type ``kind``) is refused."""
    state_file = work.path / name
    if not work.exists or name not in work.files or not state_file.exists():
        return {}
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        state = None
    entries = state.get(key) if isinstance(state, dict) else None
    if not (isinstance(state, dict) and isinstance(state.get("settings"), dict) and isinstance(entries, dict)
            and all(isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool)
                    for k, v in entries.items())):
        raise TcalError(f"{state_file} is damaged (not the state tcal writes); delete {work.path} to start this "
                        "evaluation over")
    return state


def kept_states(work, built: Sequence[Task]) -> dict[str, dict]:
    """Every task's kept state, by task name (the tasks that keep none have none)."""
    return {t.name: kept_state(work, *t.state) for t in built if t.state}


def check_known(work, task: Task, kept: dict | None) -> None:
    """Kept work of other settings than those known before the model loads (after :meth:`Task.check`) is refused
    before anything loads."""
    if kept:
        saved = kept["settings"]
        known = {k: v for k, v in task.known_settings().items() if k in saved}
        same_settings(work, task, {k: saved[k] for k in known}, known)


def legacy_eval(partial):
    """(the state files, no settings) of an unfinished evaluation whose mark lists no files (a tcal before the marks
    listed them): its top-level JSON files, the tasks' states; None for a folder without the mark."""
    mark = read_mark(partial)
    if not (mark and mark.get("stage") == "eval"):
        return None
    return [p.name for p in partial.iterdir() if p.is_file() and p.suffix == ".json" and p.name != MARK], None
