import os
import tempfile

import pytest

from tcal.utils.atomic import atomic_dir, check_out, publish_dir
from tcal.utils.errors import TcalError


def test_atomic_dir_publishes_whole_with_umask_permissions(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not out.exists()
    assert (out / "a.txt").read_text() == "a"
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or old directories left


def test_atomic_dir_failure_keeps_the_previous_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("failed half-way")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_publish_dir_replace_or_keep_existing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "theirs.txt").write_text("x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "mine.txt").write_text("y")
    publish_dir(mine, out, replace=False)  # a cache another process filled first is kept
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"] and not mine.exists()
    mine.mkdir()
    (mine / "mine.txt").write_text("y")
    assert publish_dir(mine, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("out", ["/proc/forbidden/x", "/proc/x"])
def test_check_out_proves_a_directory_can_be_created(out):
    # os.access says yes here for root; creating a directory says no, for every user
    with pytest.raises(TcalError) as e:
        check_out(out, "convert")
    assert str(e.value) == (f"cannot write --out {out}: a directory cannot be created in /proc (No such file or "
                            "directory); choose a writable --out")


def test_check_out_leaves_nothing_behind(tmp_path):
    assert check_out(tmp_path / "a" / "b", "convert") == tmp_path / "a" / "b"
    (tmp_path / "empty").mkdir()
    assert check_out(tmp_path / "empty", "convert", flag="--dir") == tmp_path / "empty"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["empty"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TcalError, match=f"cannot write --out {tmp_path}/afile/sub: {tmp_path}/afile is a file"):
        check_out(tmp_path / "afile" / "sub", "convert")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_check_out_checks_inside_an_existing_output(tmp_path, monkeypatch):
    # into an existing directory the files are moved one by one: it must take a new entry too
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda dir=None, **kw: real(
        dir="/proc" if os.fspath(dir) == os.fspath(tmp_path / "done") else dir, **kw))
    (tmp_path / "done").mkdir()
    with pytest.raises(TcalError, match="a directory cannot be created in"):
        check_out(tmp_path / "done", "convert")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]
