import os

import pytest

from tcal.utils.atomic import atomic_dir, publish_dir


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
