"""Caps a program cannot outgrow: one cgroup per program, where this machine lets tcal make them.

Each run gets its own cgroup in the memory, pids and cpu controllers: memory (anonymous memory, memfds, shared
memory and the files of its tmpfs, all its processes together), processes and threads, and a CPU quota (so that
busy processes of one program leave its neighbours their share). Found once per process by :func:`available`:

- cgroup v2, where this process's cgroup is writable and delegates ``memory pids cpu`` to its children
  (``cgroup.subtree_control``, as systemd's user delegation and most containers give);
- cgroup v1, where the three hierarchies are mounted and this process may make directories in them (root, as on
  CI and GPU machines);
- otherwise none: the caps are then rlimits of each process (:mod:`tcal.sandbox.core` says which), and
  ``--sandbox strict`` refuses to run.

The launcher's first child writes itself into the run's cgroups before it makes the namespaces; every process the
program starts follows. :meth:`Group.close` kills what is left and removes them.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time

CONTROLLERS = ("memory", "pids", "cpu")
_FOUND: dict = {}
_LOCK = threading.Lock()


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    got = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, names, path = line.rstrip("\n").split(":", 2)
            if number == "0" and names == "":
                got[""] = path
            for name in names.split(","):
                if name:
                    got[name] = path
    return got


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root of the mount, file system type, super options) of each cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                point = fields[4].encode().decode("unicode_escape")
                found.append((point, fields[3], tail[0], set(tail[2].split(","))))
    return found


def _join(point: str, root: str, path: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def _try_make(bases: dict[str, str]) -> str | None:
    """None where a child cgroup can be made (and removed) under each base; else why not."""
    name = f"tcal-probe-{os.getpid()}-{secrets.token_hex(4)}"
    made = []
    try:
        for base in dict.fromkeys(bases.values()):
            os.mkdir(os.path.join(base, name))
            made.append(os.path.join(base, name))
    except OSError as e:
        return f"cannot make a cgroup ({e.strerror}: {e.filename})"
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
    return None


def _find() -> dict:
    if not os.path.exists("/proc/self/cgroup"):
        return {"version": None, "refused": "no cgroups on this system"}
    own, mounts = _own_cgroups(), _mounts()
    v1 = {}
    for controller in CONTROLLERS:
        for point, root, kind, options in mounts:
            if kind == "cgroup" and controller in options and controller in own:
                v1[controller] = _join(point, root, own[controller])
                break
    if len(v1) == len(CONTROLLERS):
        why = _try_make(v1)
        if why is None:
            return {"version": 1, "bases": v1, "refused": None}
        refused = f"cgroup v1: {why}"
    else:
        refused = "cgroup v1: " + (f"no {', '.join(c for c in CONTROLLERS if c not in v1)} hierarchy" if v1 else
                                   "not mounted")
    for point, root, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            base = _join(point, root, own[""])
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    delegated = set(f.read().split())
            except OSError:
                continue
            missing = [c for c in CONTROLLERS if c not in delegated]
            if missing:
                refused += f"; cgroup v2 at {base}: {' '.join(missing)} not delegated to its children"
                continue
            why = _try_make({"": base})
            if why is None:
                return {"version": 2, "bases": {c: base for c in CONTROLLERS}, "refused": None}
            refused += f"; cgroup v2: {why}"
    return {"version": None, "refused": refused}


def available() -> dict:
    """``{"version": 1, 2 or None, "bases": {controller: directory}, "refused": why not (None where they work)}``,
    found once per process."""
    with _LOCK:
        if not _FOUND:
            try:
                _FOUND.update(_find())
            except (OSError, ValueError) as e:
                _FOUND.update({"version": None, "refused": f"cgroups unreadable ({e})"})
        return dict(_FOUND)


class Group:
    """The cgroups of one run: ``procs`` (the files its first process writes itself into), :meth:`oom_kills`,
    :meth:`close`."""

    def __init__(self, found: dict, memory_mb: int, processes: int, cpus: float):
        self.version = found["version"]
        name = f"tcal-run-{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs = {c: os.path.join(base, name) for c, base in found["bases"].items()}
        made = []
        try:
            for path in dict.fromkeys(self.dirs.values()):
                os.mkdir(path)
                made.append(path)
            period = 100_000
            memory = memory_mb << 20
            if self.version == 1:
                self._write("memory", "memory.limit_in_bytes", memory)
                with contextlib.suppress(OSError):  # where swap is accounted: none of it
                    self._write("memory", "memory.memsw.limit_in_bytes", memory)
                self._write("pids", "pids.max", processes)
                self._write("cpu", "cpu.cfs_period_us", period)
                self._write("cpu", "cpu.cfs_quota_us", max(1000, int(period * cpus)))
            else:
                self._write("memory", "memory.max", memory)
                with contextlib.suppress(OSError):
                    self._write("memory", "memory.swap.max", 0)
                self._write("pids", "pids.max", processes)
                self._write("cpu", "cpu.max", f"{max(1000, int(period * cpus))} {period}")
        except BaseException:
            for path in made:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        self.procs = [os.path.join(path, "cgroup.procs") for path in dict.fromkeys(self.dirs.values())]

    def _write(self, controller: str, name: str, value) -> None:
        with open(os.path.join(self.dirs[controller], name), "w") as f:
            f.write(str(value))

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for the memory cap."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.dirs["memory"], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def _members(self) -> set[int]:
        found = set()
        for procs in self.procs:
            with contextlib.suppress(OSError, ValueError), open(procs) as f:
                found.update(int(x) for x in f.read().split())
        return found

    def close(self) -> bool:
        """Kill what is left in the run's cgroups and remove them; True when they are gone."""
        end = time.monotonic() + 10
        gone = False
        while time.monotonic() < end:
            members = self._members()
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            try:
                for path in dict.fromkeys(self.dirs.values()):
                    if os.path.isdir(path):
                        os.rmdir(path)
                gone = True
                break
            except OSError:
                time.sleep(0.005)
        return gone
