"""Modules that moved keep their old import paths: ``import tcal.evaluate.humaneval`` (or ``from ... import``) gives
the very module now at its new path, without a second file of re-exports at the old one. The package root declares
the moves (:data:`tcal.MOVED`) and installs one finder for them."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Mapping


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old module name of ``moved`` ({old: new}) and loads it as the module at its new name."""

    def __init__(self, moved: Mapping[str, str]):
        self.moved = dict(moved)
        self._specs = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in self.moved else None

    def create_module(self, spec):
        module = importlib.import_module(self.moved[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import system stamped the old name's spec on the module: it keeps its own
        for old, spec in list(self._specs.items()):
            if spec.name == module.__name__:
                module.__spec__ = self._specs.pop(old)


def install(moved: Mapping[str, str]) -> MovedModules:
    """One finder for ``moved`` at the front of ``sys.meta_path`` (once per process)."""
    for finder in sys.meta_path:
        if isinstance(finder, MovedModules):
            finder.moved.update(moved)
            return finder
    finder = MovedModules(moved)
    sys.meta_path.insert(0, finder)
    return finder
