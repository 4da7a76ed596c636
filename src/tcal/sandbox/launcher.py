"""The launcher of tcal's sandbox (:mod:`tcal.sandbox`): the process tcal starts for one program, and the checker.

Never imported: tcal runs this file's compiled code, with :mod:`tcal.sandbox.plain` and :mod:`tcal.sandbox.guard`
in front of it (``python -I -S -B -c BOOT CODE``), with an empty environment, in its own session. It reads its
settings (a marshalled dict) on stdin, starts the worker (the answer's process) and the checker (the tests'
process), and writes one framed report on stdout: ``NONCE LENGTH\\n`` and LENGTH bytes of ``KEY VALUE`` lines,
nothing before or after; the nonce is tcal's, per run. It imports nothing it does not need, because every program
pays for it.

With namespaces (``cfg["namespaces"]``), the processes are::

    launcher (tcal's namespaces; a child subreaper)
     ├─ creator: joins the run's cgroups, makes new user, PID, mount, network and IPC namespaces
     │   └─ init (pid 1 of the new PID namespace): builds the program's root (a tmpfs holding, read-only, the
     │      interpreter, its standard library and the system's shared libraries, Python's package directories
     │      masked; a size-limited tmpfs as its working directory /tmp; a private /proc; /dev with five devices),
     │      pivots into it, waits for the program, tells the launcher how it ended, and exits; the kernel then
     │      kills whatever else is left in the namespace, and the tmpfs goes with its mount namespace
     │       └─ worker: ``python -I -S -B`` under its limits, as an unprivileged id, no capabilities (worker.py)
     └─ checker: a fork of the launcher (outside the worker's namespaces and cgroups, under its own limits and
        the same system call filter) that runs the problem's prompt and tests with ``check(candidate)``, where
        ``candidate`` sends its arguments to the worker and takes back its result, in plain data only
        (plain.py); it alone holds the token of a pass, and writes it when ``check`` returns

Without namespaces the launcher starts the worker itself (the run's cgroups still apply where there are any).
Either way, when the checker has ended or the time is up, the launcher kills every descendant (a walk of
``/proc`` by parent) and reaps them until it has no child left.
"""
import _signal
import builtins
import ctypes
import marshal
import os
import resource
import select
import sys
import time

if "plain_dumps" not in globals():  # run alone (tests, tools): the names plain.py and guard.py give when compiled with it
    from tcal.sandbox.guard import _tcal_deny_syscalls, _tcal_switch_off  # noqa: F401
    from tcal.sandbox.plain import NotPlain, plain_dumps, plain_loads, read_frame, write_frame  # noqa: F401

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x08000000, 0x10000000, 0x20000000, \
    0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, \
    1 << 18
MNT_DETACH = 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")

try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # not Linux: no namespaces, no prctl
    libc = None


def prctl(option, value):
    return -1 if libc is None else libc.prctl(option, value, 0, 0, 0)


def check(result, what):
    if result != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(source, target, fstype, flags, data=None):
    source, fstype, data = (None if x is None else x.encode() for x in (source, fstype, data))
    check(libc.mount(source, target.encode(), fstype, flags, data), f"mount {target}")


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def read_only_but(workdir):
    """Every mount read-only (and nosuid) but ``workdir``'s: mount_setattr(2) where the kernel has it
    (5.12+), else each mount of /proc/self/mountinfo remounted read-only with the flags it has."""
    at_fdcwd, at_recursive, rdonly, nosuid = -100, 0x8000, 1, 2
    # (not nodev: /dev's five devices are bind mounts; every tmpfs of the root is nodev itself)
    if libc.syscall(442, at_fdcwd, b"/", at_recursive, ctypes.byref(MountAttr(rdonly | nosuid, 0, 0, 0)), 32) == 0:
        check(libc.syscall(442, at_fdcwd, workdir.encode(), 0, ctypes.byref(MountAttr(0, rdonly, 0, 0)), 32),
              "mount_setattr")
        return
    if ctypes.get_errno() != 38:  # ENOSYS
        check(-1, "mount_setattr")
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in reversed(points):
        point = point.encode().decode("unicode_escape")  # mountinfo writes ' ' as \\040
        if point == workdir:
            continue
        try:
            st = os.statvfs(point)
        except OSError:
            continue  # hidden under another mount: out of reach for the program too
        keep = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096)  # ... NOATIME NODIRATIME RELATIME
        check(libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep,
                         None), f"read-only {point}")


def enter_namespaces(cfg):
    """The creator: new user, PID (for its children), mount, network and IPC namespaces. As root, the id map is
    written from outside by a helper (root stays root inside, for the init's mounts; the program's id maps to an
    unprivileged one outside) and the supplementary groups are dropped; else the user maps onto the program's id
    (one id: nothing else of the machine's users exists in there)."""
    uid, gid, inner, outer = os.geteuid(), os.getegid(), cfg["inner_id"], cfg["outer_id"]
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
    if uid != 0:
        check(libc.unshare(flags), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{inner} {uid} 1"), ("gid_map", f"{inner} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        return
    os.setgroups([])
    ready_r, ready_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(ready_w)
            if os.read(ready_r, 1) == b"u":
                me = os.getppid()
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write(f"0 0 1\n{inner} {outer} 1\n")
                os._exit(0)
        except BaseException:  # noqa: BLE001
            pass
        os._exit(1)
    os.close(ready_r)
    try:
        check(libc.unshare(flags), "unshare")
        os.write(ready_w, b"u")
    finally:
        os.close(ready_w)
        _, status = os.waitpid(helper, 0)
    if status != 0:
        raise OSError("the id map was not written")


def build_root(cfg):
    """In the init of the new PID namespace: the program's root of its own, entered with pivot_root."""
    new, root, inner = cfg["workdir"], cfg["root"], cfg["inner_id"]
    os.umask(0o022)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches tcal's mounts
    nodes = {n: os.open(f"/dev/{n}", os.O_PATH) for n in DEVICES if os.path.exists(f"/dev/{n}")}
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m,nr_inodes=4096")
    # the working directory first: an interpreter that lives under /tmp (a virtual environment there) is then bound
    # inside it, read-only like every other bind, instead of being hidden by it
    os.mkdir(new + "/tmp", 0o755)
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"mode=700,size={cfg['disk_mb']}m,nr_inodes={max(4096, cfg['disk_mb'] * 256)},uid={inner},gid={inner}")
    for source, is_dir in root["binds"]:
        target = new + source
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if is_dir:
            os.makedirs(target, 0o755, exist_ok=True)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(source, target, None, MS_BIND | MS_REC)
    for link, target in root["links"]:
        os.makedirs(os.path.dirname(new + link), 0o755, exist_ok=True)
        os.symlink(target, new + link)
    for path in root["masks"]:
        if os.path.isdir(new + path):  # Python's package directories: empty
            mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=555,size=4k,nr_inodes=2")
    os.mkdir(new + "/proc", 0o555)
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this namespace's processes only
    os.mkdir(new + "/dev", 0o755)
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")  # no disks, no terminals
    for name, fd in nodes.items():
        os.close(os.open(f"{new}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        mount(f"/proc/self/fd/{fd}", f"{new}/dev/{name}", None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.chdir(new)
    check(libc.syscall(PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")  # the machine's files: gone from its view
    os.chdir("/")
    read_only_but("/tmp")
    os.chdir("/tmp")  # the directory of the new mount


def drop_capabilities(become=None):
    """No capability survives the next exec (where there are any to drop: root, or inside the namespaces); with
    ``become``, the unprivileged id the program runs as inside its user namespace."""
    if libc is None or not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        prctl(24, cap)  # PR_CAPBSET_DROP (refused without CAP_SETPCAP: then there is nothing to drop)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    if become is not None and os.geteuid() == 0:  # root of its user namespace: the program's own id instead
        os.setgroups([])
        os.setresgid(become, become, become)
        os.setresuid(become, become, become)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")  # _LINUX_CAPABILITY_VERSION_3




def exec_program(cfg, stdio, fds, status_w):
    """The worker: its own session, its files, its limits, its id, no capabilities; then worker.py."""
    try:
        os.setsid()
        for fd, target in zip(stdio, (0, 1, 2)):
            os.dup2(fd, target)
        for fd in fds:
            os.set_inheritable(fd, True)
        oom_score(1000)  # the first the kernel kills at the memory cap: never the init above it
        set_limits(cfg["limits"])
        drop_capabilities(cfg["inner_id"] if cfg["namespaces"] else None)
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-c", cfg["boot"], cfg["worker"],
                                  *(str(fd) for fd in fds)], cfg["env"])
    except BaseException as e:  # noqa: BLE001
        tell(status_w, "S", f"the program did not start ({e})")
    finally:
        os._exit(127)


def set_limits(limits):
    for kind, value in limits:
        kind = getattr(resource, kind)
        soft, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def tell(fd, kind, text):
    try:
        os.write(fd, f"{kind} {' '.join(str(text).split())}\n".encode())
    except OSError:
        pass


def oom_score(value):
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass


def join_cgroups(cfg, status_w):
    """The worker's side, before anything else: into the run's cgroups (its every descendant follows)."""
    if cfg["cgroup_procs"]:
        oom_score(-1000)  # the creator and the init: never killed for the program's memory (as root)
    try:
        for procs in cfg["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    except BaseException as e:  # noqa: BLE001
        tell(status_w, "S", f"cgroup ({e})")
        os._exit(1)


def namespaced(cfg, stdio, fds, status_w):
    """The creator, then the init: the program in namespaces of its own. Never returns."""
    try:
        # dumpable again (the launcher is not), or its own /proc files are root's and the maps cannot be written;
        # nothing in the new namespaces can see it
        prctl(4, 1)
        enter_namespaces(cfg)
        init = os.fork()
    except BaseException as e:  # noqa: BLE001
        tell(status_w, "S", f"no namespaces ({e})")
        os._exit(1)
    if init:
        for fd in (*fds, *stdio):
            os.close(fd)
        while True:
            try:
                os.waitpid(init, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
        os._exit(0)
    try:
        prctl(4, 0)  # PR_SET_DUMPABLE 0: its memory and descriptors closed to the program
        build_root(cfg)
        program = os.fork()
    except BaseException as e:  # noqa: BLE001
        tell(status_w, "S", f"no namespaces ({e})")
        os._exit(1)
    if program == 0:
        exec_program(cfg, stdio, fds, status_w)
    for fd in (*fds, *stdio):
        os.close(fd)
    while True:
        try:
            got, status = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if got == program:
            tell(status_w, "W", status)
            os._exit(0)  # and the kernel kills what is left in the namespace


# -- the checker ---------------------------------------------------------------------------------------------------

class WorkerGone(BaseException):
    """The worker ended (or wrote what is not a frame of plain data) before check returned."""


class NotPlainCall(BaseException):
    """A call that cannot cross: the test passed the answer something that is not plain data, or the answer
    returned such a thing. A BaseException, so that no ``except Exception`` of a test swallows it."""


class Candidate:
    """What ``check`` gets as ``candidate``: a stand-in that sends each call's arguments to the worker and gives
    back its result, both as plain data. An exception of the answer's comes back as a new exception of the same
    built-in class with its message (never the answer's object)."""

    __slots__ = ("_request", "_reply")

    def __init__(self, request, reply):
        self._request, self._reply = request, reply

    def __call__(self, *args, **kwargs):
        try:
            data = plain_dumps((args, kwargs))
        except NotPlain as e:
            raise NotPlainCall(f"the tests passed the answer {e}: only plain data crosses to the answer's process "
                               "(tcal cannot score this problem in its sandbox)") from None
        try:
            write_frame(self._request, data)
        except OSError:
            raise WorkerGone() from None
        frame = read_frame(self._reply)
        if frame is None:
            raise WorkerGone()
        try:
            reply = plain_loads(frame)
            kind = reply[0]
        except (NotPlain, TypeError, IndexError, KeyError):
            raise WorkerGone() from None
        if kind == "return" and len(reply) == 2:
            return reply[1]
        if kind == "not plain" and len(reply) == 2:
            raise NotPlainCall(f"the answer returned {reply[1]}, not plain data (None, bool, int, float, complex, "
                               "str, bytes, and lists, tuples, dicts and sets of them)")
        if kind == "raise" and len(reply) == 4:
            raise rebuilt(*reply[1:])
        raise WorkerGone()

    def __repr__(self):
        return "<the answer, in its own process>"


def rebuilt(kind, errno, message):
    """A fresh exception of the built-in class named ``kind`` (Exception where there is none), with ``message``."""
    message = message if type(message) is str else ""
    cls = getattr(builtins, kind, None) if type(kind) is str else None
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        cls = Exception
    try:
        e = cls(errno, message) if issubclass(cls, OSError) and type(errno) is int else cls(message)
    except Exception:  # noqa: BLE001 - a class that wants other arguments
        e = Exception(message)
    e.tcal_message = message  # the answer's own message, as it wrote it
    return e


def error_line(result_w, e, chars):
    try:
        kind = next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins")
        message = getattr(e, "tcal_message", None)
        message = " ".join((message if type(message) is str else str(e)).split())[:chars]
        errno = e.errno if isinstance(e, OSError) and type(e.errno) is int else None
    except BaseException:  # noqa: BLE001
        kind, message, errno = "BaseException", "", None
    os.write(result_w, b"E %s %s %s\n" % (kind.encode(), b"-" if errno is None else b"%d" % errno,
                                          message.encode("utf-8", "replace").hex().encode()))


def run_checker(cfg, token, request_w, reply_r, result_w):
    """The checker (a fork of the launcher): the worker's guards, then its hello, then the tests. Never returns."""
    checker = cfg["checker"]
    chars = checker["message_chars"]
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        set_limits(cfg["checker_limits"])
        drop_capabilities()
        seccomp = _tcal_deny_syscalls()
        _tcal_switch_off()  # as in the worker: a test that starts a process fails with a clear reason
        guards = read_frame(reply_r)
        try:
            tag, worker_seccomp, caps = plain_loads(guards)
            assert tag == "guards" and type(worker_seccomp) is bool and type(caps) is int
        except BaseException:  # noqa: BLE001
            raise WorkerGone() from None
        os.write(result_w, b"R %d %d %d\n" % (worker_seccomp, caps, seccomp))  # before any of its code ran
        hello = read_frame(reply_r)
        try:
            hello = plain_loads(hello)
            kind = hello[0]
        except BaseException:  # noqa: BLE001
            raise WorkerGone() from None
        if kind == "raise" and len(hello) == 4:
            error_line(result_w, rebuilt(*hello[1:]), chars)
            os._exit(1)
        if kind != "ready":
            raise WorkerGone()
        if checker["tests"] is not None:
            candidate = Candidate(request_w, reply_r)
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            try:  # the problem's own helpers (poly, encode_cyclic, ...): the answer's copies never reach the tests
                prompt = compile(checker["prompt"] or "", "prompt.py", "exec")
            except SyntaxError:
                prompt = None
            if prompt is not None:
                exec(prompt, namespace)
            namespace[checker["entry_point"]] = candidate
            exec(compile(checker["tests"], "tests.py", "exec"), namespace)
            run = namespace.get("check")
            if not callable(run):
                raise LookupError("the tests define no check()")
            run(candidate)
        os.write(result_w, token.encode())
        os._exit(0)
    except WorkerGone:
        os.write(result_w, b"G gone\n")
        os._exit(1)
    except NotPlainCall as e:
        error_line(result_w, TypeError(str(e)), chars)
        os._exit(1)
    except BaseException as e:  # noqa: BLE001
        try:
            error_line(result_w, e, chars)
        except BaseException:  # noqa: BLE001
            pass
        os._exit(1)


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


def reap():
    """Reap every child that has ended; True once there is no child left (as subreaper: no descendant either)."""
    while True:
        try:
            got, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if got == 0:
            return False


def kill_all(child):
    """Kill every process the program started, wherever it went, and reap them all: (killed, none left)."""
    if reap():
        return 0, True
    killed = set()
    try:
        os.killpg(child, _signal.SIGKILL)
    except OSError:
        pass
    proc = os.path.isdir("/proc")
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for p in descendants() if proc else []:
            try:
                os.kill(p, _signal.SIGKILL)
                killed.add(p)
            except OSError:
                pass
        if reap():
            return len(killed), True
        time.sleep(0.002)
    return len(killed), False


class Pipe:
    """What a pipe brought: the first ``head`` bytes, the last ``tail`` bytes, whether ``token`` came."""

    def __init__(self, fd, head, tail, token=None):
        self.fd, self.head_size, self.tail_size, self.token = fd, head, tail, token
        self.head, self.tail, self.carry, self.found, self.ended = bytearray(), bytearray(), b"", False, False
        os.set_blocking(fd, False)

    def drain(self):
        while not self.ended:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                self.ended = True
                return
            if self.token:
                self.found = self.found or self.token in self.carry + chunk
                self.carry = (self.carry + chunk)[-len(self.token):]
            if len(self.head) < self.head_size:
                self.head += chunk[:self.head_size - len(self.head)]
            self.tail = (self.tail + chunk)[-self.tail_size:]

    def has(self, prefix):
        return any(ln.startswith(prefix) for ln in bytes(self.tail).split(b"\n"))

    def line(self, prefix, last, data=None):
        lines = [ln for ln in bytes(self.tail if data is None else data).split(b"\n") if ln.startswith(prefix)]
        return lines[-1 if last else 0][len(prefix):] if lines else None


def main():
    cfg = marshal.loads(sys.stdin.buffer.read())
    prctl(4, 0)  # PR_SET_DUMPABLE 0: its memory and descriptors closed to the programs
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # fds 0-2 stay taken: the pipes below must not land on them
    report_fd = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    subreaper = sys.platform.startswith("linux") and prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    stop = []
    _signal.signal(_signal.SIGTERM, lambda *a: stop.append(1))
    payload_r, payload_w = os.pipe()
    request_r, request_w = os.pipe()  # the checker's calls to the worker
    reply_r, reply_w = os.pipe()  # the worker's answers
    result_r, result_w = os.pipe()  # the checker's verdict
    status_r, status_w = os.pipe()
    excl = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    stdio = (os.open(os.devnull, os.O_RDONLY), os.open(cfg["stdout"], excl, 0o600),
             os.open(cfg["stderr"], excl, 0o600))
    t0 = time.monotonic()
    worker = os.fork()
    if worker == 0:
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
        for fd in (payload_w, request_w, reply_r, result_r, result_w, status_r, report_fd):
            os.close(fd)
        join_cgroups(cfg, status_w)
        fds = (payload_r, request_r, reply_w)
        if cfg["namespaces"]:
            namespaced(cfg, stdio, fds, status_w)
        exec_program(cfg, stdio, fds, status_w)
    for fd in (payload_r, request_r, reply_w, status_w, *stdio):
        os.close(fd)
    # the token is made after the worker's fork: no process but the checker ever holds it
    token = os.urandom(16).hex()
    checker = os.fork()
    if checker == 0:
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
        for fd in (payload_w, result_r, status_r, report_fd):
            os.close(fd)
        run_checker(cfg, token, request_w, reply_r, result_w)
    for fd in (request_w, reply_r, result_w):
        os.close(fd)
    payload = marshal.dumps(cfg["payload"])
    del cfg["payload"], cfg["checker"]
    os.set_blocking(payload_w, False)
    result = Pipe(result_r, 4096, cfg["tail_bytes"], token.encode())
    del token
    status_pipe = Pipe(status_r, 4096, 4096)
    sent, worker_status, checker_status, timed_out, stopped = 0, None, None, False, False
    deadline = t0 + cfg["timeout"]
    ended = []
    for pid in (worker, checker):
        try:
            ended.append(os.pidfd_open(pid))  # readable once the child has ended: no polling
        except (AttributeError, OSError):
            pass
    while True:
        result.drain()
        status_pipe.drain()
        if payload_w is not None:
            try:
                sent += os.write(payload_w, payload[sent:sent + (1 << 16)])
            except BlockingIOError:
                pass
            except OSError:  # the program ended before reading it all
                sent = len(payload)
            if sent >= len(payload):
                os.close(payload_w)
                payload_w = None
        try:
            got, st = os.waitpid(-1, os.WNOHANG)  # a child, or an orphan of the program's come to the subreaper
        except ChildProcessError:
            break
        if got == worker:
            worker_status = st
        elif got == checker:
            checker_status = st
        if got:
            continue
        if checker_status is not None:
            result.drain()
            # the worker ended first (the checker says so): wait for how it ended, as long as its time lasts
            if worker_status is not None or not result.has(b"G ") or \
                    (cfg["namespaces"] and status_pipe.has(b"W ")):
                break
        now = time.monotonic()
        if stop or now >= deadline:
            timed_out, stopped = not stop, bool(stop)
            break
        readers = [p.fd for p in (result, status_pipe) if not p.ended] + ended
        writers = [payload_w] if payload_w is not None else []
        try:
            select.select(readers, writers, [], min(deadline - now, 1.0 if len(ended) == 2 else 0.05))
        except InterruptedError:
            pass
    seconds = time.monotonic() - t0
    if worker_status is None and not (timed_out or stopped) and len(ended) == 2:
        # the checker is done and closed its end of the calls: the worker ends by itself in a moment, and reaping
        # it then costs nothing (killing it first costs a walk of /proc)
        try:
            select.select([ended[0]], [], [], 0.2)
        except InterruptedError:
            pass
    for fd in ended:
        os.close(fd)
    if payload_w is not None:
        os.close(payload_w)
    killed, all_gone = kill_all(worker)
    end = time.monotonic() + 2
    while not (result.ended and status_pipe.ended) and time.monotonic() < end:
        result.drain()
        status_pipe.drain()
        time.sleep(0.002)
    status = worker_status
    if cfg["namespaces"]:
        told = status_pipe.line(b"W ", last=False)
        status = int(told) if told and told.isdigit() else None
    setup = status_pipe.line(b"S ", last=False)
    hello, error = result.line(b"R ", last=False, data=result.head), result.line(b"E ", last=True)
    if not (setup or result.found or error or result.has(b"G ") or timed_out or stopped):
        setup = b"the checker ended without a verdict"
    fields = {"passed": int(result.found), "timed_out": int(timed_out), "stopped": int(stopped), "seconds": seconds,
              "exit": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else "-",
              "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else "-",
              "hello": hello.hex() if hello is not None else "-", "error": error.hex() if error is not None else "-",
              "setup": setup.hex() if setup else "-", "killed": killed, "all_gone": int(all_gone),
              "subreaper": int(subreaper)}
    body = "".join(f"{key} {value}\n" for key, value in fields.items()).encode()
    report = f"{cfg['nonce']} {len(body)}\n".encode() + body
    while report:
        report = report[os.write(report_fd, report):]


if __name__ == "__main__":
    main()
