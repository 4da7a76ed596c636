"""Run one untrusted Python program (a model's code and its tests) in its own process, within limits.

A generated program is run, never imported: a fresh ``python -I -B`` process in its own session (process group),
started through a small launcher that first lowers its resource limits and switches off the standard library's
ways of starting processes and deleting files, then runs the program. It runs in an empty temporary directory
that is deleted afterwards, with an environment that holds none of the user's variables, and the whole process
group is killed when it ends or its time is up.

Limits (:class:`Limits`): wall time, CPU time, address space (memory), size of any file written, number of
processes of the user (not enforced by the kernel for root, which is why process creation is also switched off
inside the program), no core dumps.

What this does NOT stop (say so wherever code execution is offered): network access; reading any file the user
can read (the program runs as the user); code that reaches the operating system past the Python-level guard
(``ctypes``, a C extension) and can then start processes, write files outside the directory or raise its own
limits where it runs as root. It is a guard against mistakes in generated code (loops, runaway memory, stray
``os.system``), not a security boundary: run untrusted models' code in a container or VM.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Runs in the child before the program: limits first (so nothing after can exceed them), then the guard. The
# program's path is argv[1]; its source is compiled with that file name so tracebacks point at its lines.
_LAUNCHER = r"""
import resource, sys
mem, cpu, fsize, nproc = (int(x) for x in sys.argv[2:6])
def lower(kind, value):
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
lower(resource.RLIMIT_AS, mem)
lower(resource.RLIMIT_DATA, mem)
lower(resource.RLIMIT_CPU, cpu)
lower(resource.RLIMIT_FSIZE, fsize)
lower(resource.RLIMIT_NPROC, nproc)
lower(resource.RLIMIT_CORE, 0)
import builtins, os, shutil, subprocess
for mod, names in ((os, "system popen fork forkpty execv execve execl execle execlp execlpe execvp execvpe spawnl "
                        "spawnle spawnlp spawnlpe spawnv spawnve spawnvp spawnvpe posix_spawn posix_spawnp kill "
                        "killpg setsid setuid setgid putenv unsetenv remove unlink rmdir removedirs rename renames "
                        "replace truncate chmod fchmod lchmod chown fchown lchown chroot fchdir chdir"),
                   (shutil, "rmtree move chown copytree"),
                   (subprocess, "Popen run call check_call check_output getoutput getstatusoutput"),
                   (resource, "setrlimit prlimit")):
    for name in names.split():
        if hasattr(mod, name):
            def refuse(*args, _name=f"{mod.__name__}.{name}", **kwargs):
                raise PermissionError(f"{_name} is switched off where tcal runs generated code")
            setattr(mod, name, refuse)
builtins.help = None
path = sys.argv[1]
with open(path, encoding="utf-8") as f:
    source = f.read()
del sys.argv[1:]
namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
exec(compile(source, path, "exec"), namespace)
"""

# the exit status a program that runs past its CPU limit gets (SIGXCPU), or writes past its file limit (SIGXFSZ)
_SIGNAL_REASONS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit", signal.SIGKILL: "killed",
                   signal.SIGSEGV: "crashed (segmentation fault)"}


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall time, then the process group is killed
    memory_mb: int = 1024  # address space of the process
    file_mb: int = 16  # largest file it may write (its output goes to files too)
    processes: int = 16  # processes of the user (RLIMIT_NPROC; not enforced for root)

    def check(self) -> None:
        from tcal.utils.errors import TcalError

        if not self.timeout_s > 0:
            raise TcalError(f"the time limit of a program must be positive, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise TcalError(f"the memory limit of a program must be at least 64 MB (Python's own needs), "
                            f"got {self.memory_mb}")
        if self.file_mb < 1 or self.processes < 1:
            raise TcalError(f"file and process limits must be at least 1, got {self.file_mb} MB and "
                            f"{self.processes}")


@dataclass
class Outcome:
    passed: bool
    reason: str  # "passed", or why not: the exception's last line, "timed out after 10 s", ...
    seconds: float


def _clean_env(workdir: str) -> dict[str, str]:
    """No variable of the user's (tokens, paths, proxies): only what a plain interpreter needs."""
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def _last_line(path: str, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run ``source`` as a Python program under ``limits``: passed when it exits with status 0.

    Never raises for anything the program does (a syntax error, an exception, a loop, a crash, a fork): each
    is a failed :class:`Outcome` with its reason.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tcal-run-") as workdir:
        prog = os.path.join(workdir, "program.py")
        with open(prog, "w", encoding="utf-8") as f:
            f.write(source)
        out, err = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        args = [sys.executable, "-I", "-B", "-c", _LAUNCHER, prog, str(limits.memory_mb << 20),
                str(int(limits.timeout_s) + 1), str(limits.file_mb << 20), str(limits.processes)]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(args, cwd=workdir, env=_clean_env(workdir), stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe, start_new_session=True, close_fds=True)
            try:
                code = proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                code, timed_out = None, True
            finally:
                _kill_group(proc)  # whatever it started goes with it
                if proc.poll() is None:
                    proc.wait()
        seconds = time.perf_counter() - t0
        if timed_out:
            return Outcome(False, f"timed out after {limits.timeout_s:g} s", seconds)
        if code == 0:
            return Outcome(True, "passed", seconds)
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            return Outcome(False, _SIGNAL_REASONS.get(sig, f"killed by {sig.name}"), seconds)
        last = _last_line(err)
        if last.startswith("MemoryError"):
            last = f"memory limit ({limits.memory_mb} MB): {last}"
        return Outcome(False, last or f"exit status {code}", seconds)
