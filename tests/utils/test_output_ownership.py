"""Every path tcal deletes, replaces or writes is proved inside its output without following a link; marks and
manifests are read as data; one run per output (a lock beside it); --overwrite swaps the new output in, so a kill at
any moment leaves the old output or the new one; leftovers of killed runs are removed by the next run (issue 65).
Each test failed before: the case it names lost a file, wrote outside its folder, printed a traceback or let two runs
write one output."""
import errno
import json
import os
import subprocess
import sys
import time

import pytest
from helpers import publish_output

from tcal.utils import atomic
from tcal.utils.atomic import MANIFEST, atomic_dir, check_out, release_locks
from tcal.utils.errors import TcalError
from tcal.utils.partial import MARK, Work, open_work, partial_dir


@pytest.fixture(autouse=True)
def _locks():
    yield
    release_locks()


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if (p.is_file() or p.is_symlink())
                  and not p.name.startswith(".tcal"))


def _outside(tmp_path, *names):
    d = tmp_path / "outside"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_text("precious")
    return d


# -- every path proved inside -----------------------------------------------------------------------------------------

def test_overwrite_never_follows_a_link_the_user_put_in_the_output(tmp_path):
    """Before: a symlinked subfolder inside an output had the files of the folder it points to deleted."""
    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1", "copy/model.txt": "1", "copy/stale.txt": "1"})
    outside = _outside(tmp_path, "model.txt", "stale.txt")
    (out / "copy" / "model.txt").unlink()
    (out / "copy" / "stale.txt").unlink()
    (out / "copy").rmdir()
    (out / "copy").symlink_to(outside)  # the user's link where tcal had a folder
    with pytest.raises(TcalError, match="copy is not a file tcal wrote there"):
        publish_output(out, {"model.txt": "2", "copy/model.txt": "2"})
    publish_output(out, {"model.txt": "2"})  # the stale files listed under copy/ are not reached through the link
    assert sorted(p.name for p in outside.iterdir()) == ["model.txt", "stale.txt"]
    assert (out / "copy").is_symlink() and (out / "model.txt").read_text() == "2"


@pytest.mark.parametrize("entry", ["../victim.txt", "/ABS", "checkpoint/../../../victim.txt"])
def test_a_partial_mark_listing_paths_out_of_its_folder_is_refused_and_nothing_removed(tmp_path, entry):
    """Before: distill --resume and tcal eval removed what such a mark listed, outside the folder."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    entry = entry.replace("/ABS", str(victim))
    out = tmp_path / "o" / "run"
    work = partial_dir(out)
    work.mkdir(parents=True)
    (work / MARK).write_text(json.dumps({"format": "tcal-partial-v2", "stage": "eval", "settings": None,
                                         "files": [entry], "temps": []}))
    for resume in (False, True):
        with pytest.raises(TcalError, match="is not a mark tcal wrote"):
            open_work(out, "eval", resume=resume, resumes=False, progress=lambda w: False)
    assert victim.read_text() == "precious" and (work / MARK).is_file()


def test_a_partial_file_reached_through_a_link_is_not_removed(tmp_path):
    out = tmp_path / "run"
    work = Work(partial_dir(out), "distill")
    work.write_text("best/model.txt", "1")
    outside = _outside(tmp_path, "model.txt")
    (work.path / "best" / "model.txt").unlink()
    (work.path / "best").rmdir()
    (work.path / "best").symlink_to(outside)
    work.discard()
    assert (outside / "model.txt").read_text() == "precious"


def test_an_unmarked_partial_holding_a_checkpoint_is_refused_whatever_it_holds(tmp_path):
    """Before: --resume adopted it (a legacy checkpoint) and removed the user's files in checkpoint/ and best/."""
    out = tmp_path / "run"
    work = partial_dir(out)
    for rel in ("checkpoint/resume/state.json", "checkpoint/mine.txt", "best/mine.txt"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("{}")
    legacy = lambda p: (["checkpoint/resume/state.json", "checkpoint/mine.txt", "best/mine.txt"], {})  # noqa: E731
    with pytest.raises(TcalError, match="tcal did not write it"):
        open_work(out, "distill", resume=True, legacy=legacy, progress=lambda w: False)
    assert _tree(work) == ["best/mine.txt", "checkpoint/mine.txt", "checkpoint/resume/state.json"]


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", b"null", b'{"format": "tcal-files-v2", "files": null}',
                                     b'{"format": "tcal-files-v2", "files": ["../x"]}', b"[1, 2]"])
def test_a_manifest_that_is_not_tcals_is_one_line_never_a_traceback(tmp_path, content):
    """Before: a binary manifest was a UnicodeDecodeError; null or a list were read as names."""
    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1"})
    (out / MANIFEST).write_bytes(content)
    with pytest.raises(TcalError, match="is not a manifest tcal wrote"):
        check_out(out, "convert", overwrite=True)
    assert (out / "model.txt").read_text() == "1"


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", b"null", b'{"stage": "distill", "files": null}',
                                     b'{"stage": "distill", "files": [1]}', b'{"stage": "distill", "temps": "x"}'])
def test_a_partial_mark_that_is_not_tcals_is_one_line_never_a_traceback(tmp_path, content):
    out = tmp_path / "run"
    work = partial_dir(out)
    work.mkdir()
    (work / "curve.csv").write_text("mine")
    (work / MARK).write_bytes(content)
    with pytest.raises(TcalError):
        open_work(out, "distill", resume=True)
    assert (work / "curve.csv").read_text() == "mine"


# -- names ------------------------------------------------------------------------------------------------------------

def test_a_dangling_out_link_and_a_link_are_named_as_such(tmp_path):
    """Before: a dangling --out link was refused as "Not a directory"."""
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(TcalError, match="is a symbolic link to .*nowhere, which does not exist"):
        check_out(tmp_path / "link", "convert")
    (tmp_path / "there").mkdir()
    (tmp_path / "to-there").symlink_to(tmp_path / "there")
    with pytest.raises(TcalError, match="is a symbolic link"):
        check_out(tmp_path / "to-there", "convert")


def test_a_long_name_is_refused_for_its_own_reason_and_one_that_fits_is_written(tmp_path):
    """Before: a 250-character name was refused because tcal's temporary name beside it was too long."""
    with pytest.raises(TcalError, match="its name is 250 bytes, and the unfinished work"):
        check_out(tmp_path / ("x" * 250), "convert")
    out = check_out(tmp_path / ("y" * 247), "convert")
    publish_output(out, {"model.txt": "1"})
    publish_output(out, {"model.txt": "2"})
    assert (out / "model.txt").read_text() == "2"


def test_a_non_utf8_out_is_one_line(tmp_path):
    with pytest.raises(TcalError, match=r"is not a UTF-8 name"):
        check_out(os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9"), "convert")


# -- one run per output -----------------------------------------------------------------------------------------------

def _holder(out, tmp_path):
    """Another process that holds the lock of ``out`` until its stdin closes."""
    code = (f"import sys; sys.argv = ['tcal', 'convert', '--out', {str(out)!r}]\n"
            f"from tcal.utils.atomic import check_out\ncheck_out({str(out)!r}, 'convert')\n"
            "print('locked', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_one_output_is_refused_naming_the_first(tmp_path):
    """Before: two runs into one --out both printed "wrote"; the second replaced the first."""
    out = tmp_path / "out"
    proc = _holder(out, tmp_path)
    try:
        with pytest.raises(TcalError, match=rf"is being written by another tcal run \(pid {proc.pid}: tcal convert "):
            check_out(out, "convert")
    finally:
        proc.stdin.close()
        proc.wait()
    assert check_out(out, "convert") == out  # the first ended: its lock went with it
    release_locks()
    assert not atomic.lock_path(out).exists()


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_message(tmp_path):
    out = tmp_path / "out"
    proc = _holder(out, tmp_path)
    proc.kill()
    proc.wait()
    assert atomic.lock_path(out).exists()  # killed: its lock file is still there, the kernel's lock is not
    with pytest.warns(UserWarning, match=rf"locked by a run that has ended .*pid {proc.pid}"):
        check_out(out, "convert")


# -- kill-safe replacement --------------------------------------------------------------------------------------------

class Killed(BaseException):
    pass


def _loadable(out, version):
    """The whole output of one version: every file of it, from the same run."""
    return (out / "model.txt").read_text() == version and (out / "config.txt").read_text() == version


@pytest.mark.parametrize("where", ["link", "exchange", "rmtree", "rename-1", "rename-2"])
def test_a_kill_during_overwrite_leaves_the_old_or_the_new_output_and_the_next_run_cleans_up(tmp_path, monkeypatch,
                                                                                           where):
    """Before: a kill during --overwrite's file-by-file merge left the new config beside the old weights."""
    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1", "config.txt": "1"})
    (out / "notes.txt").write_text("mine")
    if where.startswith("rename"):
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
        real = os.rename
        calls = []

        def rename(a, b):
            calls.append(a)
            if len(calls) == int(where[-1]):
                raise Killed
            return real(a, b)
        monkeypatch.setattr(os, "rename", rename)
    else:
        target = {"link": (os, "link"), "exchange": (atomic, "_exchange"), "rmtree": (atomic.shutil, "rmtree")}[where]
        real = getattr(*target)

        def killed(*a, **k):
            if where == "rmtree" and "tmp-" not in str(a[0]):
                return real(*a, **k)
            raise Killed
        monkeypatch.setattr(*target, killed)
    with pytest.raises(Killed):
        publish_output(out, {"model.txt": "2", "config.txt": "2"})
    monkeypatch.undo()
    if where != "rename-2":  # killed between the two renames: no OUT until the next run puts it back
        assert _loadable(out, "1") or _loadable(out, "2")
    check_out(out, "convert", overwrite=True)  # the next run on that output
    assert _loadable(out, "1") or _loadable(out, "2")
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith("tcal-lock")) == ["out"]


def test_overwrite_keeps_the_users_files_as_the_same_files(tmp_path):
    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1", "best/model.txt": "1"})
    (out / "best" / "notes.txt").write_text("mine")
    (out / "empty").mkdir()
    (out / "link").symlink_to(tmp_path / "nowhere")
    inode = (out / "best" / "notes.txt").stat().st_ino
    publish_output(out, {"model.txt": "2"})
    assert (out / "best" / "notes.txt").stat().st_ino == inode and (out / "empty").is_dir()
    assert (out / "link").is_symlink() and (out / "model.txt").read_text() == "2"
    assert not (out / "best" / "model.txt").exists()


def test_a_checkpoint_moved_aside_by_a_killed_run_is_put_back_and_temps_removed(tmp_path, monkeypatch):
    """Before: killed runs left .checkpoint.old-PID and .checkpoint.tmp-* that nothing removed."""
    out = tmp_path / "run"
    work = Work(partial_dir(out), "distill")
    with work.dir("checkpoint") as tmp:
        (tmp / "model.txt").write_text("1")
    (work.path / "checkpoint" / "mine.txt").write_text("mine")
    real = os.replace

    def replace(a, b):
        if str(a).endswith("tmp") or ".checkpoint.tmp-" not in str(a):
            return real(a, b)
        raise Killed  # the second rename: the old checkpoint is aside, the new one not in place
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed), work.dir("checkpoint") as tmp:
        (tmp / "model.txt").write_text("2")
    monkeypatch.undo()
    os.makedirs(work.path / ".checkpoint.tmp-left")  # a temporary folder of an older kill, recorded
    mark = json.loads((work.path / MARK).read_text())
    mark["temps"].append(".checkpoint.tmp-left")
    (work.path / MARK).write_text(json.dumps(mark))
    assert not (work.path / "checkpoint").exists()
    open_work(out, "distill", resume=True, progress=lambda w: True)
    assert _tree(work.path) == ["checkpoint/mine.txt", "checkpoint/model.txt"]
    assert (work.path / "checkpoint" / "model.txt").read_text() == "1"
    assert sorted(p.name for p in work.path.iterdir()) == [MARK, "checkpoint"]


# -- a full disk ------------------------------------------------------------------------------------------------------

def test_a_full_disk_is_one_line_naming_the_folder_and_the_earlier_output_stays(tmp_path, monkeypatch):
    out = tmp_path / "out"
    publish_output(out, {"model.txt": "1"})

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(TcalError, match=f"the disk is full: {out} could not be written"), atomic_dir(out) as tmp:
        (tmp / "model.txt").write_text("2")
        monkeypatch.setattr(atomic, "_usual_modes", full)
        time.sleep(0)
    assert (out / "model.txt").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- resume compares what was read --------------------------------------------------------------------------------------

def test_resume_compares_the_files_read_not_their_spelling(tmp_path, monkeypatch):
    """Before: the same model by its absolute path was refused; the same relative name from another folder, naming
    another model, or a model re-converted in place, was resumed (an eval then mixed two models in one report)."""
    from tcal.utils.partial import read_settings

    for d in ("a", "b"):
        (tmp_path / d / "model").mkdir(parents=True)
        (tmp_path / d / "model" / "model.safetensors").write_text(d)
    out = tmp_path / "ev"
    monkeypatch.chdir(tmp_path / "a")
    work = open_work(out, "eval", resumes=False, settings=read_settings({"model": "model"}, ("model",)))
    work.write_text("ppl.json", "{}")
    # the same files by another spelling: resumed
    open_work(out, "eval", resumes=False, settings=read_settings({"model": str(tmp_path / "a" / "model")}, ("model",)))
    # the same relative name from another folder: another model, refused
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(TcalError, match=r"settings changed \(model\)"):
        open_work(out, "eval", resumes=False, settings=read_settings({"model": "model"}, ("model",)))
    # the model re-converted in place: refused
    monkeypatch.chdir(tmp_path / "a")
    (tmp_path / "a" / "model" / "model.safetensors").write_text("a, converted again")
    with pytest.raises(TcalError, match=r"settings changed \(model\)"):
        open_work(out, "eval", resumes=False, settings=read_settings({"model": "model"}, ("model",)))
    assert (work.path / "ppl.json").is_file()


def test_settings_without_the_files_read_still_compare_by_value():
    from tcal.utils.partial import differing, read_settings

    assert read_settings({"teacher": "smollm2-135m", "data": "wiki:calib"}) == {"teacher": "smollm2-135m",
                                                                             "data": "wiki:calib"}
    assert differing({"teacher": "x", "lr": 1}, {"teacher": "y", "lr": 1}) == ["teacher"]
