import os
import tempfile

import pytest
from helpers import publish_output

from tcal.utils.atomic import atomic_dir, check_out, publish_dir, release_locks
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
    release_locks()  # the end of the command: its locks go, with the folders made for them
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


# -- one owner of output folders: tcal touches only the files its manifest lists --------------------------------------

def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tcal"))


def test_overwrite_replaces_and_removes_only_tcals_files_at_any_depth(tmp_path):
    from tcal.utils.atomic import owned_files

    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1", "best/model.txt": "1", "best/old.txt": "1", "copy/deep/a.txt": "1"})
    assert owned_files(out) == ["best/model.txt", "best/old.txt", "copy/deep/a.txt", "model.txt", "tcal_config.json"]
    (out / "best" / "my_notes.txt").write_text("mine")  # the user's files inside tcal's folders and beside them
    (out / "copy" / "deep" / "mine.txt").write_text("mine")
    (out / "notes.txt").write_text("mine")
    publish_output(out, {"model.txt": "2", "best/model.txt": "2"})
    assert _tree(out) == ["best/model.txt", "best/my_notes.txt", "copy/deep/mine.txt", "model.txt", "notes.txt",
                          "tcal_config.json"]
    assert (out / "best" / "model.txt").read_text() == "2" and (out / "best" / "my_notes.txt").read_text() == "mine"
    publish_output(out, {"model.txt": "3"})  # a folder tcal emptied goes; one holding the user's file stays
    assert _tree(out) == ["best/my_notes.txt", "copy/deep/mine.txt", "model.txt", "notes.txt", "tcal_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left


def test_a_file_of_the_users_where_the_new_output_writes_one_is_refused_not_replaced(tmp_path):
    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1"})
    (out / "report.md").write_text("mine")  # a name the next output writes, and not tcal's
    (out / "best").write_text("mine too")  # a file where the next output has a folder
    with pytest.raises(TcalError, match="report.md is not a file tcal wrote there"):
        publish_output(out, {"model.txt": "2", "report.md": "tcal"})
    with pytest.raises(TcalError, match="best is not a file tcal wrote there"):
        publish_output(out, {"model.txt": "2", "best/model.txt": "tcal"})
    assert (out / "report.md").read_text() == "mine" and (out / "best").read_text() == "mine too"
    assert (out / "model.txt").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_output_of_a_tcal_before_the_full_manifest_is_still_replaced(tmp_path):
    """An older manifest lists top-level names: its listed files are replaced or removed; inside its listed folders
    only what the new output writes again is replaced. An output with no manifest, known by its tcal_config.json,
    gets the files the new output writes."""
    from tcal.utils.atomic import MANIFEST

    out = tmp_path / "old"
    (out / "best").mkdir(parents=True)
    for rel in ("model.txt", "stale.txt", "best/model.txt", "best/notes.txt", "tcal_config.json"):
        (out / rel).write_text("old")
    (out / MANIFEST).write_text("model.txt\nstale.txt\nbest\ntcal_config.json\n")
    publish_output(out, {"model.txt": "new", "best/model.txt": "new"})
    assert _tree(out) == ["best/model.txt", "best/notes.txt", "model.txt", "tcal_config.json"]
    assert (out / "best" / "model.txt").read_text() == "new" and (out / "best" / "notes.txt").read_text() == "old"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tcal_config.json").write_text('{"stage": "convert"}')
    (bare / "model.txt").write_text("old")
    (bare / "notes.txt").write_text("mine")
    publish_output(bare, {"model.txt": "new"})
    assert (bare / "model.txt").read_text() == "new" and (bare / "notes.txt").read_text() == "mine"


def test_save_pretrained_replaces_same_names_as_transformers_does(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("the user's")
    (out / "notes.txt").write_text("kept")
    with atomic_dir(out, theirs="replace") as tmp:
        (tmp / "config.json").write_text("tcal's")
    assert (out / "config.json").read_text() == "tcal's" and (out / "notes.txt").read_text() == "kept"


# -- unfinished work: OUT.partial -------------------------------------------------------------------------------------

def test_a_partial_folder_tcal_did_not_write_is_refused_and_kept(tmp_path):
    from tcal.utils.partial import open_work

    out = tmp_path / "o" / "run"
    mine = tmp_path / "o" / "run.partial"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    for resume in (False, True):
        with pytest.raises(TcalError, match=r"run.partial exists and tcal did not write it \(it has no .tcal_partial\)"):
            open_work(out, "recover", resume=resume)
    assert _tree(mine) == ["notes.txt"]


def test_work_records_what_it_writes_and_removes_only_that(tmp_path):
    from tcal.utils.partial import MARK, Work, open_work, read_mark

    out = tmp_path / "run"
    work = open_work(out, "distill", settings={"lr": 1})
    assert not work.path.exists()  # made at its first write
    work.write_text("curve.csv", "0\n")
    with work.dir("checkpoint") as tmp:
        (tmp / "model.txt").write_text("1")
    (work.path / "checkpoint" / "mine.txt").write_text("mine")  # the user's files in tcal's folders
    (work.path / "notes.txt").write_text("mine")
    with work.dir("checkpoint") as tmp:  # replaced whole; the user's file moves into the new folder
        (tmp / "model.txt").write_text("2")
    assert _tree(work.path) == ["checkpoint/mine.txt", "checkpoint/model.txt", "curve.csv", "notes.txt"]
    assert (work.path / "checkpoint" / "model.txt").read_text() == "2"
    assert read_mark(work.path)["files"] == ["checkpoint/model.txt", "curve.csv"]
    with pytest.raises(TcalError, match="holds an interrupted `tcal distill`; pass --resume"):
        open_work(out, "distill", settings={"lr": 1})
    with pytest.raises(TcalError, match=r"settings changed \(lr\)"):
        open_work(out, "distill", settings={"lr": 2}, resume=True)
    with pytest.raises(TcalError, match="holds an unfinished `tcal distill`, not `tcal recover`"):
        open_work(out, "recover", resume=True)
    assert open_work(out, "distill", settings={"lr": 1}, resume=True).files == work.files
    # the finished run: tcal's files become OUT, the user's stay where they were
    published = Work(work.path, "distill").publish(out)
    assert _tree(published) == ["checkpoint/model.txt", "curve.csv"]
    assert _tree(work.path) == ["checkpoint/mine.txt", "notes.txt"] and not (work.path / MARK).exists()
    with pytest.raises(TcalError, match="tcal did not write it"):  # no longer tcal's: refused, never removed
        open_work(out, "distill", resume=True)


def test_work_without_progress_starts_over_and_a_publish_of_only_tcals_files_is_one_rename(tmp_path):
    from tcal.utils.atomic import owned_files
    from tcal.utils.partial import open_work

    out = tmp_path / "run"
    work = open_work(out, "instruct")
    work.write_text("answers.jsonl", "")
    fresh = open_work(out, "instruct", progress=lambda w: False)  # nothing to resume: tcal's files go
    assert not fresh.path.exists()
    fresh.write_json("a/b.json", {"x": 1})
    inode = (fresh.path / "a" / "b.json").stat().st_ino
    fresh.publish(out)
    assert (out / "a" / "b.json").stat().st_ino == inode and not fresh.path.exists()
    assert owned_files(out) == ["a/b.json"]
