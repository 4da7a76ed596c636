"""The commands over the output rules of issue 65: one run per --out, a full disk as one line with the earlier output
intact, and the numeric and device flags that were accepted and read by nothing or read wrong. Each failed before."""
import os
import subprocess
import sys

import pytest
from helpers import one_error, run

from tcal.utils.atomic import release_locks


@pytest.fixture()
def assets(workspace):
    from helpers import write_distill_assets

    return write_distill_assets(workspace)


def convert_copy(ws, out, *extra):
    return ("convert", "--teacher", ws / "teacher", "--keep", "0,2", "--init", "copy", "--eval", "none",
            "--device", "cpu", "--out", out, *extra)


def distill_args(ws, out, *extra):
    return ("distill", ws / "hybrid", "--teacher", ws / "teacher", "--data", ws / "train.npy", "--eval",
            ws / "eval.npy", "--eval-window", 32, "--eval-windows", 2, "--seq-len", 32, "--batch-size", 2,
            "--tokens", 128, "--device", "cpu", "--no-progress", "--out", out, *extra)


def test_a_second_convert_into_an_output_another_run_writes_is_refused_naming_it(workspace, capsys):
    """Before: both runs printed "wrote"; the second silently replaced the first."""
    out = workspace / "out"
    code = (f"import sys; sys.argv = ['tcal', 'convert', '--out', {str(out)!r}]\n"
            f"from tcal.utils.atomic import check_out\ncheck_out({str(out)!r}, 'convert')\n"
            "print('locked', flush=True)\nsys.stdin.read()\n")
    first = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert first.stdout.readline().strip() == "locked"
        one_error(capsys, f"is being written by another tcal run (pid {first.pid}: tcal convert --out {out})",
                  *convert_copy(workspace, out))
        assert not out.exists()
    finally:
        first.stdin.close()
        first.wait()
    code, _, err = run(capsys, *convert_copy(workspace, out))
    assert code == 0, err
    assert not [p.name for p in workspace.iterdir() if p.name.startswith(".")]  # the lock went with the command


def test_a_full_disk_during_convert_is_one_line_and_the_earlier_output_stays(workspace, capsys, monkeypatch):
    """Before: safetensors' SafetensorError was a traceback."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    out = workspace / "out"
    code, _, err = run(capsys, *convert_copy(workspace, out))
    assert code == 0, err
    before = (out / "model.safetensors").read_bytes()

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')
    monkeypatch.setattr(mu, "safe_save_file", full)
    one_error(capsys, f"the disk is full: {out} could not be written", *convert_copy(workspace, out, "--overwrite",
                                                                                   "--seed", "1"))
    assert (out / "model.safetensors").read_bytes() == before
    assert not [p.name for p in workspace.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("extra, message", [
    (("--seed", str(2**64)), "--seed must be between 0 and 2**64 - 1"),
    (("--seed", "-1"), "--seed must be between 0 and 2**64 - 1"),
])
def test_a_seed_no_generator_takes_is_one_line(workspace, capsys, extra, message):
    """Before: --seed past 64 bits was a traceback from torch.manual_seed."""
    one_error(capsys, message, *convert_copy(workspace, workspace / "o", *extra))
    assert not (workspace / "o").exists()


@pytest.mark.parametrize("extra, message", [
    (("--min-lr-ratio", "-1"), "--min-lr-ratio is the final learning rate as a fraction of --lr: in [0, 1]"),
    (("--weight-decay", "-1"), "--weight-decay must be >= 0"),
    (("--grad-clip", "-1"), "--grad-clip must be >= 0"),
    (("--max-minutes", "-1"), "--max-minutes must be a number of minutes >= 0"),
    (("--max-minutes", "nan"), "--max-minutes must be a number of minutes >= 0"),
    (("--stop-after-tokens", "-5"), "--stop-after-tokens must be a number of tokens >= 0"),
    (("--dist-timeout", "5"), "--dist-timeout is read by a run under torchrun only"),
    (("--teacher-placement", "shard"), "--teacher-placement is read by a run under torchrun only"),
])
def test_numbers_that_mean_nothing_and_flags_read_by_nothing_are_one_line_before_the_work(assets, capsys, extra,
                                                                                       message):
    """Before: each was accepted (a negative learning rate, no time limit, a flag nothing reads)."""
    one_error(capsys, message, *distill_args(assets, assets / "d", *extra))
    assert not (assets / "d").exists() and not (assets / "d.partial").exists()
    release_locks()


def test_distill_resumes_the_same_files_by_another_spelling_and_refuses_other_files(assets, capsys, monkeypatch):
    """Before: the same teacher by its absolute path was refused (the advice: delete the progress); the same relative
    names from another folder resumed against another teacher."""
    import shutil

    monkeypatch.chdir(assets)
    rel = ("distill", "hybrid", "--teacher", "teacher", "--data", "train.npy", "--eval", "eval.npy", "--eval-window",
           32, "--eval-windows", 2, "--seq-len", 32, "--batch-size", 2, "--tokens", 256, "--device", "cpu",
           "--no-progress", "--out", assets / "d")
    code, _, err = run(capsys, *rel, "--stop-after-tokens", 64)
    assert code == 0 and (assets / "d.partial").is_dir(), err
    other = assets / "elsewhere"
    other.mkdir()
    for name in ("hybrid", "train.npy", "eval.npy"):
        (other / name).symlink_to(assets / name)
    shutil.copytree(assets / "teacher", other / "teacher")
    (other / "teacher" / "config.json").write_text((other / "teacher" / "config.json").read_text() + " ")
    monkeypatch.chdir(other)
    one_error(capsys, "settings changed (teacher)", *rel, "--resume")
    monkeypatch.chdir(assets)
    absolute = [str(assets / a) if a in ("hybrid", "teacher", "train.npy", "eval.npy") else a for a in rel]
    code, _, err = run(capsys, *absolute, "--resume")
    assert code == 0 and (assets / "d" / "report.json").is_file() and not (assets / "d.partial").exists(), err
