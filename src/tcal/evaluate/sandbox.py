"""Moved to :mod:`tcal.sandbox.core`: this old import path is that very module (patching one patches the other)."""
import sys

from tcal.sandbox import core

sys.modules[__name__] = core
