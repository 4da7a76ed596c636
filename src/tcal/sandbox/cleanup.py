"""Removing a program's temporary directory without ever acting outside it.

Whatever the program left there (directories it made unreadable, trees too deep for one walk, symbolic links, a
mount, a file the kernel will not delete), the removal works through directory descriptors: a symbolic link is
deleted, never followed; a directory that is a mount point (any mount, bind mounts of the same file system
included) is never entered; only directories inside the temporary directory, and the directory itself, ever have
their permissions changed. What cannot be removed is left where it is and named in a warning; nothing raises.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import uuid

_DEEP = 32  # directories below this depth are moved up to the top and removed in a later pass
_RESOLVE = 0x01 | 0x02 | 0x04 | 0x08  # RESOLVE_NO_XDEV | NO_MAGICLINKS | NO_SYMLINKS | BENEATH
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_PATH = getattr(os, "O_PATH", 0)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2_state: dict = {}


def _openat2(dfd: int, name: str, flags: int) -> int | None:
    """openat2(2) that refuses to cross a mount or follow a link; None where the kernel has no openat2."""
    if _openat2_state.get("missing"):
        return None
    try:
        libc = _openat2_state.get("libc") or ctypes.CDLL(None, use_errno=True)
        _openat2_state["libc"] = libc
        libc.syscall.restype = ctypes.c_long
        how = _OpenHow(flags, 0, _RESOLVE)
        fd = libc.syscall(ctypes.c_long(437), ctypes.c_long(dfd), ctypes.c_char_p(os.fsencode(name)),
                          ctypes.byref(how), ctypes.c_long(ctypes.sizeof(how)))
    except (OSError, AttributeError):
        _openat2_state["missing"] = True
        return None
    if fd < 0:
        e = ctypes.get_errno()
        if e in (errno.ENOSYS, errno.EPERM) and "works" not in _openat2_state:
            _openat2_state["missing"] = True  # no openat2, or a filter refuses it: the portable way below
            return None
        raise OSError(e, os.strerror(e), name)
    _openat2_state["works"] = True
    return fd


def _mount_points() -> set[tuple[int, int]]:
    """(device, inode) of every mount point of this process (where /proc/self/mountinfo says)."""
    points = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                try:
                    st = os.stat(line.split()[4].encode().decode("unicode_escape"), follow_symlinks=False)
                    points.add((st.st_dev, st.st_ino))
                except (OSError, IndexError, UnicodeDecodeError):
                    continue
    except OSError:
        pass
    return points


class _Walk:
    def __init__(self, path: str):
        self.path, self.points = path, None
        self.left: dict[str, None] = {}  # what stays, with why (an ordered set: a later pass finds it again)

    def open_dir(self, dfd: int, name: str, flags: int = _DIR_FLAGS) -> int | None:
        """The directory ``name`` in ``dfd``, never across a mount or a link: None where it is a mount point."""
        try:
            fd = _openat2(dfd, name, flags)
        except OSError as e:
            if e.errno == errno.EXDEV:
                return None
            raise
        if fd is not None:
            return fd
        fd = os.open(name, flags, dir_fd=dfd)
        st, up = os.fstat(fd), os.fstat(dfd)
        if self.points is None:
            self.points = _mount_points()
        if st.st_dev != up.st_dev or (st.st_dev, st.st_ino) in self.points:
            os.close(fd)
            return None
        return fd

    def open_up(self, dfd: int, name: str) -> int | None:
        """Open a directory the program made unreadable: its own permissions opened up, nothing else's."""
        try:
            return self.open_dir(dfd, name)
        except PermissionError:
            pass
        if not _O_PATH:
            raise PermissionError(errno.EACCES, "no O_PATH", name)
        where = self.open_dir(dfd, name, _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if where is None:
            return None
        try:
            os.chmod(f"/proc/self/fd/{where}", 0o700)  # this very directory, reached through its descriptor
        finally:
            os.close(where)
        return self.open_dir(dfd, name)

    def clear(self, fd: int, root: int, where: str, depth: int) -> tuple[int, bool]:
        """Remove what directory ``fd`` holds: (the number of directories moved up to ``root`` for a later pass,
        whether something in it stays)."""
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
                os.fchmod(fd, 0o700)
        except OSError:
            pass
        moved, kept = 0, False
        for name in os.listdir(fd):
            try:
                try:
                    os.unlink(name, dir_fd=fd)  # a file, a link (never followed), a device, ...
                    continue
                except IsADirectoryError:
                    pass
                try:
                    os.rmdir(name, dir_fd=fd)  # an empty directory (a mount point is refused: EBUSY)
                    continue
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EACCES, errno.EPERM):
                        raise
                if depth >= _DEEP:
                    os.rename(name, f".tcal-deep-{uuid.uuid4().hex}", src_dir_fd=fd, dst_dir_fd=root)
                    moved += 1
                    continue
                sub = self.open_up(fd, name)
                if sub is None:
                    self.left[f"{where}/{name} (a mount point)"] = None
                    kept = True
                    continue
                try:
                    deeper, stays = self.clear(sub, root, f"{where}/{name}", depth + 1)
                finally:
                    os.close(sub)
                moved, kept = moved + deeper, kept or stays
                if not stays:  # else it holds what stays, and is named by it
                    os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as e:
                self.left[f"{where}/{name} ({e.strerror})"] = None
                kept = True
        return moved, kept


def remove_tree(path: str, attempts: int = 5) -> list[str]:
    """Remove the directory ``path`` and everything in it, never acting outside it (see the module's docstring);
    what was left, with why (empty when all is gone). Never raises.

    It is renamed first (a hidden name beside it), and emptied again while something keeps writing into it (another
    program of the same user, where programs share the file system), ``attempts`` times at most."""
    walk = _Walk(path)
    try:
        parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            name = given = os.path.basename(path)
            try:
                os.rename(given, f".{given}-removed", src_dir_fd=parent, dst_dir_fd=parent)
                name = f".{given}-removed"
            except OSError:
                pass
            for attempt in range(attempts):
                root = walk.open_up(parent, name)
                if root is None:
                    walk.left[f"{path} (a mount point)"] = None
                    break
                try:
                    for _ in range(10_000):  # each pass moves what lies too deep up to the top
                        if not walk.clear(root, root, path, 0)[0]:
                            break
                finally:
                    os.close(root)
                if walk.left:
                    break
                try:
                    os.rmdir(name, dir_fd=parent)
                    break
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == attempts - 1:
                        walk.left[f"{path} ({e.strerror})"] = None
                        break
        finally:
            if name != given and walk.left:  # what stays keeps the name the warning gives
                with contextlib.suppress(OSError):
                    os.rename(name, given, src_dir_fd=parent, dst_dir_fd=parent)
            os.close(parent)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a removal never ends a run
        walk.left[f"{path} ({type(e).__name__}: {e})"] = None
    left = list(walk.left)
    if left:
        logging.getLogger(__name__).warning("left in the temporary directory of a generated program: %s",
                                            "; ".join(left[:5]) + (" ..." if len(left) > 5 else ""))
    return left
