"""Moved to :mod:`tcal.sandbox.launcher`: this old import path is that very module (patching one patches the other)."""
import sys

from tcal.sandbox import launcher

sys.modules[__name__] = launcher
