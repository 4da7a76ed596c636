"""A program's temporary directory is removed without ever acting outside it: links are deleted, not followed; a
mount inside it is never entered; only permissions inside it change; what cannot go is left and named."""
import ctypes
import fcntl
import os
import stat
import struct
import subprocess

import pytest

from tcal.evaluate import sandbox_cleanup
from tcal.evaluate.sandbox_cleanup import remove_tree


@pytest.fixture(params=["openat2", "portable"])
def way(request, monkeypatch):
    """openat2(2) where the kernel has it, and the portable way (mount points from /proc/self/mountinfo)."""
    if request.param == "portable":
        monkeypatch.setitem(sandbox_cleanup._openat2_state, "missing", True)
    return request.param


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_what_a_program_leaves_is_removed_and_nothing_outside_changes(tmp_path, way):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.chmod(outside, 0o751)
    run = tmp_path / "tcal-run-x"
    deep = run
    for _ in range(80):  # deeper than one walk goes
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "f").write_text("x")
    (run / "locked" / "inner").mkdir(parents=True)
    (run / "locked" / "inner" / "f").write_text("x")
    os.chmod(run / "locked" / "inner", 0o500)
    os.chmod(run / "locked", 0)
    (run / "to-outside").symlink_to(outside)
    (run / "to-file").symlink_to(outside / "keep.txt")
    os.mkfifo(run / "fifo")
    before = {p: _mode(p) for p in (tmp_path, outside)}
    assert remove_tree(str(run)) == []
    assert not run.exists() and (outside / "keep.txt").read_text() == "mine"
    assert {p: _mode(p) for p in (tmp_path, outside)} == before


def test_a_missing_directory_is_nothing_to_do(tmp_path):
    assert remove_tree(str(tmp_path / "gone")) == []


def _mount_bind(source, target) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.mount(str(source).encode(), str(target).encode(), None, 4096, None) == 0  # MS_BIND


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount needs root")
def test_a_mount_inside_is_never_entered(tmp_path, way):
    """A bind mount of a directory of the same file system (the same device number) inside the temporary directory:
    what it shows is not deleted, the mount point stays, and the warning names it."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep.txt").write_text("mine")
    run = tmp_path / "tcal-run-x"
    (run / "a" / "m").mkdir(parents=True)
    (run / "a" / "f").write_text("x")
    if not _mount_bind(outside, run / "a" / "m"):
        pytest.skip("this machine refuses mounts")
    try:
        left = remove_tree(str(run))
        assert len(left) == 1 and left[0].startswith(f"{run}/a/m (")
        assert (outside / "sub" / "keep.txt").read_text() == "mine" and not (run / "a" / "f").exists()
    finally:
        subprocess.run(["umount", str(run / "a" / "m")], check=False)
    assert remove_tree(str(run)) == [] and not run.exists()


def _immutable(path, on: bool) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x40086602, struct.pack("l", 0x10 if on else 0))  # FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="an immutable file needs root")
def test_a_file_that_cannot_be_deleted_is_left_and_nothing_outside_opens_up(tmp_path):
    run = tmp_path / "tcal-run-x"
    run.mkdir()
    (run / "stuck").write_text("x")
    (run / "other").write_text("x")
    if not _immutable(run / "stuck", True):
        pytest.skip("this file system has no immutable files")
    os.chmod(tmp_path, 0o751)
    try:
        left = remove_tree(str(run))
        assert left == [f"{run}/stuck (Operation not permitted)"] and not (run / "other").exists()
        assert _mode(tmp_path) == 0o751  # the directory above it keeps its permissions
    finally:
        _immutable(run / "stuck", False)
    assert remove_tree(str(run)) == []


def test_a_directory_another_program_keeps_writing_into_is_removed_all_the_same(tmp_path):
    """Where programs share the file system (the process guards), a neighbour may write into a directory while it
    is removed: it is renamed first, so that the neighbour's path no longer reaches it."""
    import threading
    import time

    run = tmp_path / "tcal-run-x"
    run.mkdir()
    stop = threading.Event()

    def neighbour():
        while not stop.is_set():
            try:
                (run / f"f{time.monotonic_ns()}").write_text("x")
            except OSError:
                pass

    writer = threading.Thread(target=neighbour)
    writer.start()
    try:
        time.sleep(0.05)
        assert remove_tree(str(run)) == []
    finally:
        stop.set()
        writer.join()
    assert os.listdir(tmp_path) == []
