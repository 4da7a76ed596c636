"""A user's file anywhere under or beside --out survives every command, with and without --overwrite and --resume
(tcal.utils.atomic, tcal.utils.partial): a folder named OUT.partial that tcal did not write is refused in one line
and left as it is; --overwrite, resume and cleanup touch only the files tcal's manifests list."""
import json

import pytest
from helpers import one_error, run

from tcal.train.checkpoint import partial_dir

SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def users_folder(path, *names):
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_text("mine")
    return path


@pytest.fixture()
def assets(workspace):
    from helpers import write_distill_assets

    return write_distill_assets(workspace)


def distill_args(ws, out, *extra):
    return ("distill", ws / "hybrid", "--teacher", ws / "teacher", "--data", ws / "train.npy", "--eval",
            ws / "eval.npy", "--eval-window", 32, "--eval-windows", 2, "--seq-len", 32, "--batch-size", 2,
            "--tokens", 128, "--device", "cpu", "--no-progress", "--out", out, *extra)


def recover_args(ws, out, *extra):
    return ("recover", "--teacher", ws / "teacher", "--keep", "0,2", "--inits", "copy", "--data", ws / "train.npy",
            "--eval", ws / "eval.npy", "--eval-window", 32, "--eval-windows", 2, "--seq-len", SEQ, "--batch-size",
            BATCH, "--tokens", 2 * TPS, "--eval-every", TPS, "--kl-chunk", 32, "--device", "cpu", "--no-progress",
            "--out", out, *extra)


@pytest.mark.parametrize("command", ["recover", "distill"])
@pytest.mark.parametrize("names", [("notes.txt",), ("curve.csv",)])
def test_a_users_folder_named_like_the_partial_output_is_refused_and_kept(assets, capsys, command, names):
    """Before: recover deleted such a folder whenever it held nothing to resume, distill one holding only a
    curve.csv, both with exit 0."""
    out = assets / "o" / "run"
    mine = users_folder(partial_dir(out), *names)
    args = recover_args if command == "recover" else distill_args
    for extra in ((), ("--resume",)):
        one_error(capsys, f"{mine} exists and tcal did not write it", *args(assets, out, *extra))
    assert tree(mine) == sorted(names) and not out.exists()


def test_recover_overwrite_and_resume_keep_the_users_files_in_tcals_folders(assets, capsys, monkeypatch):
    """Before: --overwrite swapped every folder of the finished output whole, so a note in OUT/copy/ was gone."""
    import tcal.train.trainer

    out = assets / "rv"
    code, _, err = run(capsys, *recover_args(assets, out))
    assert code == 0, err
    before = (out / "copy" / "model.safetensors").stat().st_mtime_ns
    (out / "copy" / "notes.txt").write_text("mine")  # inside a run's folder
    (out / "notes.txt").write_text("mine")  # beside tcal's files
    one_error(capsys, "pass --overwrite", *recover_args(assets, out))
    code, _, err = run(capsys, *recover_args(assets, out, "--overwrite", "--seed", "1"))
    assert code == 0, err
    assert (out / "copy" / "notes.txt").read_text() == "mine" and (out / "notes.txt").read_text() == "mine"
    assert (out / "copy" / "model.safetensors").stat().st_mtime_ns != before
    assert json.loads((out / "tcal_config.json").read_text())["seed"] == 1
    assert not partial_dir(out).exists()

    # a run killed after its conversion: the user's note in the partial folder stays there when the resumed run
    # publishes tcal's files
    real = tcal.train.trainer.distill
    monkeypatch.setattr(tcal.train.trainer, "distill", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
    again = assets / "again"
    with pytest.raises(RuntimeError, match="killed"):
        from tcal.cli import main

        main([str(a) for a in recover_args(assets, again)])
    capsys.readouterr()
    (partial_dir(again) / "notes.txt").write_text("mine")
    monkeypatch.setattr(tcal.train.trainer, "distill", real)
    one_error(capsys, "holds an interrupted `tcal recover`; pass --resume", *recover_args(assets, again))
    one_error(capsys, "settings changed (tokens)", *recover_args(assets, again, "--resume", "--tokens", 4 * TPS))
    code, _, err = run(capsys, *recover_args(assets, again, "--resume"))
    assert code == 0, err
    assert (again / "recovery.json").is_file() and not (again / "notes.txt").exists()
    assert tree(partial_dir(again)) == ["notes.txt"]

