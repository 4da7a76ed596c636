"""The launcher of tcal's sandbox (:mod:`tcal.evaluate.sandbox`): the process tcal starts for one program.

Never imported: tcal runs this file's compiled code (``python -I -S -B -c BOOT CODE``, see
:mod:`tcal.evaluate.sandbox`), with an empty environment, in its own session. It reads its settings (a marshalled
dict) on stdin, starts the program, and writes one framed report on stdout: ``NONCE LENGTH\\n`` and LENGTH bytes of
``KEY VALUE`` lines, nothing before or after; the nonce is tcal's, per run. It imports nothing it does not need,
because every program pays for it.

With namespaces (``cfg["namespaces"]``), the processes are::

    launcher (tcal's namespaces; a child subreaper)
     └─ creator: new user, PID, mount, network and IPC namespaces, the user mapped to itself
         └─ init (pid 1 of the new PID namespace): a private /proc, /dev with five devices, /run empty, every
            mount read-only but the program's directory; it waits for the program, tells the launcher how it
            ended, and exits, and the kernel kills whatever else is left in the namespace
             └─ program: ``python -I -S -B`` under its limits, without capabilities (sandbox_runner.py)

Without them the launcher starts the program itself. Either way, when the program has ended or its time is up, the
launcher kills every descendant (a walk of ``/proc`` by parent) and reaps them until it has no child left.
"""
import _signal
import ctypes
import marshal
import os
import resource
import select
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x08000000, 0x10000000, 0x20000000, \
    0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, \
    1 << 18
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
    """Every mount read-only but ``workdir``'s: mount_setattr(2) where the kernel has it (5.12+), else each mount
    of /proc/self/mountinfo remounted read-only with the flags it has."""
    at_fdcwd, at_recursive, rdonly = -100, 0x8000, 1
    if libc.syscall(442, at_fdcwd, b"/", at_recursive, ctypes.byref(MountAttr(rdonly, 0, 0, 0)), 32) == 0:
        check(libc.syscall(442, at_fdcwd, workdir.encode(), 0, ctypes.byref(MountAttr(0, rdonly, 0, 0)), 32),
              "mount_setattr")
        return
    if ctypes.get_errno() != 38:  # ENOSYS
        check(-1, "mount_setattr")
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in reversed(points):
        point = point.encode().decode("unicode_escape")  # mountinfo writes ' ' as \040
        if point == workdir:
            continue
        try:
            st = os.statvfs(point)
        except OSError:
            continue  # hidden under another mount: out of reach for the program too
        keep = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096)  # ... NOATIME NODIRATIME RELATIME
        check(libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None),
              f"read-only {point}")


def enter_namespaces():
    """The creator: new user, PID (for its children), mount, network and IPC namespaces, the user mapped onto
    itself (one id: nothing else of the machine's users exists in there)."""
    uid, gid = os.geteuid(), os.getegid()
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def build_root(workdir):
    """In the init of the new PID namespace: what the program will see of the machine."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches tcal's mounts
    mount(workdir, workdir, None, MS_BIND | MS_REC)  # its own mount, to stay writable
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this namespace's processes only
    nodes = {n: os.open(f"/dev/{n}", os.O_PATH) for n in DEVICES if os.path.exists(f"/dev/{n}")}
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")  # no disks, no terminals
    for name, fd in nodes.items():
        os.close(os.open(f"/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        mount(f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    if os.path.isdir("/run") and not (workdir + "/").startswith("/run/"):
        mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755,size=4k")  # daemons' FIFOs
    read_only_but(workdir)
    os.chdir(workdir)  # the directory of the new mount, not the read-only one below it


def drop_capabilities():
    """No capability survives the program's exec (where there are any to drop: root, or inside the namespaces)."""
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

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")  # _LINUX_CAPABILITY_VERSION_3


def exec_program(cfg, stdio, payload_r, result_w, status_w):
    """The program process: its own session, its files, its limits, no capabilities; then the runner."""
    try:
        os.setsid()
        for fd, target in zip(stdio, (0, 1, 2)):
            os.dup2(fd, target)
        os.set_inheritable(payload_r, True)
        os.set_inheritable(result_w, True)
        for kind, value in cfg["limits"]:
            kind = getattr(resource, kind)
            soft, hard = resource.getrlimit(kind)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(kind, (value, value))
        drop_capabilities()
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-c", cfg["boot"], cfg["runner"], str(payload_r),
                                  str(result_w)], cfg["env"])
    except BaseException as e:
        tell(status_w, "S", f"the program did not start ({e})")
    finally:
        os._exit(127)


def tell(fd, kind, text):
    try:
        os.write(fd, f"{kind} {' '.join(str(text).split())}\n".encode())
    except OSError:
        pass


def namespaced(cfg, stdio, payload_r, result_w, status_w):
    """The creator, then the init: the program in namespaces of its own. Never returns."""
    try:
        # dumpable again (the launcher is not), or its own /proc files are root's and the maps cannot be written;
        # nothing in the new namespaces can see it
        prctl(4, 1)
        enter_namespaces()
        init = os.fork()
    except BaseException as e:
        tell(status_w, "S", f"no namespaces ({e})")
        os._exit(1)
    if init:
        for fd in (result_w, payload_r, *stdio):
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
        build_root(cfg["workdir"])
        program = os.fork()
    except BaseException as e:
        tell(status_w, "S", f"no namespaces ({e})")
        os._exit(1)
    if program == 0:
        exec_program(cfg, stdio, payload_r, result_w, status_w)
    for fd in (result_w, payload_r, *stdio):
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
    result_r, result_w = os.pipe()
    status_r, status_w = os.pipe()
    excl = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    stdio = (os.open(os.devnull, os.O_RDONLY), os.open(cfg["stdout"], excl, 0o600),
             os.open(cfg["stderr"], excl, 0o600))
    t0 = time.monotonic()
    child = os.fork()
    if child == 0:
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
        for fd in (payload_w, result_r, status_r, report_fd):
            os.close(fd)
        if cfg["namespaces"]:
            namespaced(cfg, stdio, payload_r, result_w, status_w)
        exec_program(cfg, stdio, payload_r, result_w, status_w)
    for fd in (payload_r, result_w, status_w, *stdio):
        os.close(fd)
    # the token is made after the fork: no process but the program ever holds it
    token = os.urandom(16).hex()
    payload = marshal.dumps({"token": token, **cfg["payload"]})
    del cfg["payload"]
    os.set_blocking(payload_w, False)
    result = Pipe(result_r, 4096, cfg["tail_bytes"], token.encode())
    status_pipe = Pipe(status_r, 4096, 4096)
    sent, child_status, timed_out, stopped = 0, None, False, False
    deadline = t0 + cfg["timeout"]
    try:
        ended = os.pidfd_open(child)  # readable once the child has ended: no polling
    except (AttributeError, OSError):
        ended = None
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
            got, st = os.waitpid(-1, os.WNOHANG)  # the child, or an orphan of the program's come to the subreaper
        except ChildProcessError:
            break
        if got == child:
            child_status = st
            break
        if got:
            continue
        now = time.monotonic()
        if stop or now >= deadline:
            timed_out, stopped = not stop, bool(stop)
            break
        readers = [p.fd for p in (result, status_pipe) if not p.ended] + ([ended] if ended is not None else [])
        writers = [payload_w] if payload_w is not None else []
        try:
            select.select(readers, writers, [], min(deadline - now, 0.05 if ended is None else 1.0))
        except InterruptedError:
            pass
    if ended is not None:
        os.close(ended)
    seconds = time.monotonic() - t0
    if payload_w is not None:
        os.close(payload_w)
    killed, all_gone = kill_all(child)
    end = time.monotonic() + 2
    while not (result.ended and status_pipe.ended) and time.monotonic() < end:
        result.drain()
        status_pipe.drain()
        time.sleep(0.002)
    status = child_status
    if cfg["namespaces"]:
        told = status_pipe.line(b"W ", last=False)
        status = int(told) if told and told.isdigit() else None
    setup = status_pipe.line(b"S ", last=False)
    hello, error = result.line(b"R ", last=False, data=result.head), result.line(b"E ", last=True)
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
