"""Run a function right after a module has been imported (or now, if it already is).

``import tcal`` must stay cheap: the command line imports it, and torch alone takes longer than
``tcal --help`` may. The registration of tcal's model classes with transformers' Auto classes
therefore waits until transformers' Auto modules are imported, which any code that could load a
tcal checkpoint must do first.

tcal's own modules import transformers too, and transformers imports its Auto modules from inside
its own half-imported modules, so such a callback can come due while a module it needs is
half-imported. Callbacks are therefore held back until no module of the packages named by
``wait_for`` is being imported.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


class _Wrapped(importlib.abc.Loader):
    """A module's real loader, with something to do before and after its body executes."""

    def __init__(self, loader, before: Callable[[], None], after: Callable[[], None]):
        self._loader, self._before, self._after = loader, before, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._before()
        try:
            self._loader.exec_module(module)
        finally:
            self._after()

    def __getattr__(self, name):  # get_source, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: dict[str, list[Callable[[], None]]] = {}  # module -> callbacks, not yet imported
        self.due: list[Callable[[], None]] = []  # imported, waiting for the watched package's imports
        self.watched: set[str] = set()
        self.depth = 0  # watched modules being imported right now

    def _real_spec(self, name, path, target):
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None

    def find_spec(self, name, path, target=None):
        watched = any(name == w or name.startswith(w + ".") for w in self.watched)
        if name not in self.pending and not watched:
            return None
        spec = self._real_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callbacks = self.pending.pop(name, [])
        enter = self._enter if watched else (lambda: None)
        leave = self._leave if watched else (lambda: None)

        def after():
            leave()
            self.due.extend(callbacks)
            self.flush()

        spec.loader = _Wrapped(spec.loader, enter, after)
        return spec

    def _enter(self):
        self.depth += 1

    def _leave(self):
        self.depth -= 1

    def flush(self):
        while self.due and self.depth == 0:
            fn = self.due.pop(0)
            try:
                fn()
            except Exception as e:  # a failed registration must not break the user's own import
                log.warning("tcal: %s after import failed (%s: %s)", getattr(fn, "__name__", fn), type(e).__name__, e)


_FINDER = _AfterImportFinder()


def after_import(module: str, fn: Callable[[], None], *, wait_for: tuple[str, ...] = ()) -> None:
    """Call ``fn()`` once ``module`` is imported: at once if it already is, else right after its
    body runs. With ``wait_for`` (package names), not while a module of those packages is being
    imported: then as soon as the last such import finishes."""
    _FINDER.watched.update(wait_for)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    if module in sys.modules:
        _FINDER.due.append(fn)
        _FINDER.flush()
    else:
        _FINDER.pending.setdefault(module, []).append(fn)
