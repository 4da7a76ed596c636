"""tcal's sandbox: one untrusted Python program (a model's answer and a problem's tests) run in a box it cannot see
out of, under caps it cannot outgrow, with a verdict it cannot reach.

- :mod:`tcal.sandbox.core`: tcal's side (limits, running a program, its reason, what guarded it);
- :mod:`tcal.sandbox.launcher`: the process tcal starts per program, which starts the worker and the checker;
- :mod:`tcal.sandbox.worker`: the answer's process; :mod:`tcal.sandbox.plain`: the plain data between the two;
- :mod:`tcal.sandbox.guard`: the system call filter; :mod:`tcal.sandbox.cgroups`: the caps;
- :mod:`tcal.sandbox.cleanup`: removing a temporary directory without acting outside it.

docs/evaluation.md says what each mode holds and what it does not.
"""
from tcal.sandbox.core import (
                               EXCERPT,
                               MODES,
                               NAMESPACES,
                               Limits,
                               Outcome,
                               caps,
                               describe,
                               dumpable,
                               excerpt,
                               guards,
                               isolation,
                               reason_kind,
                               require,
                               require_allowed,
                               run_program,
                               shielded,
)

__all__ = ["EXCERPT", "MODES", "NAMESPACES", "Limits", "Outcome", "caps", "describe", "dumpable", "excerpt", "guards",
           "isolation", "reason_kind", "require", "require_allowed", "run_program", "shielded"]
