"""Bad input as a new user types it: exit 2 and one line naming the problem and the fix, the
user's files untouched, nothing left behind that blocks the next correct run."""
import json
import math
import os
import stat

import numpy as np
import pytest
import torch
from helpers import one_error, run

import tcal
from tcal.cli import main
from tcal.utils.errors import TcalError


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def convert_copy(ws, out, *extra):
    return ("convert", "--teacher", ws / "teacher", "--keep", "0,2", "--init", "copy", "--eval", "none",
            "--device", "cpu", "--out", out, *extra)


# -- output directories: never lose a user's file -----------------------------------------------

def test_convert_refuses_a_directory_holding_the_users_files(workspace, capsys):
    out = workspace / "mine"
    out.mkdir()
    (out / "my_notes.txt").write_text("do not lose me")
    one_error(capsys, "holds files tcal did not write", *convert_copy(workspace, out))
    one_error(capsys, "holds files tcal did not write", *convert_copy(workspace, out, "--overwrite"))
    assert listing(out) == ["my_notes.txt"] and (out / "my_notes.txt").read_text() == "do not lose me"
    assert [p.name for p in workspace.iterdir() if p.name.startswith(".")] == []  # no temp folder left


def test_out_dot_works_and_overwrite_replaces_only_tcals_own_files(workspace, capsys, monkeypatch):
    here = workspace / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, errors, err = run(capsys, *convert_copy(workspace, "."))
    assert code == 0, err
    assert (here / "model.safetensors").is_file() and (here / "tcal_config.json").is_file()
    (here / "my_notes.txt").write_text("mine")  # the user adds a file to the finished output
    one_error(capsys, "pass --overwrite", *convert_copy(workspace, "."))
    code, _, err = run(capsys, *convert_copy(workspace, ".", "--overwrite", "--seed", "3"))
    assert code == 0, err
    assert (here / "my_notes.txt").read_text() == "mine"
    assert json.loads((here / "tcal_config.json").read_text())["seed"] == 3
    assert [p.name for p in workspace.iterdir() if p.name.startswith(".")] == []


def test_relative_out_and_the_closing_line_lists_the_files(workspace, capsys, monkeypatch):
    monkeypatch.chdir(workspace)
    code = main([str(a) for a in convert_copy(workspace, "runs/../rel")])
    out = capsys.readouterr().out
    assert code == 0 and (workspace / "rel" / "model.safetensors").is_file()
    last = out.strip().splitlines()[-1]
    assert last.startswith("wrote runs/../rel") and "model.safetensors" in last and "report.md" in last


def test_out_under_a_file_or_a_file_itself_is_one_line(workspace, capsys):
    (workspace / "afile").write_text("x")
    one_error(capsys, "is a file", *convert_copy(workspace, workspace / "afile"))
    one_error(capsys, "cannot write", *convert_copy(workspace, workspace / "afile" / "sub"))
    one_error(capsys, "is a file", "stats", workspace / "teacher", "--out", workspace / "afile")
    assert (workspace / "afile").read_text() == "x"


def test_save_pretrained_into_an_unwritable_place_is_a_tcal_error(tmp_path):
    from helpers import tiny_teacher

    hybrid = tcal.convert(tiny_teacher(), keep=[0, 2], init="copy")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TcalError, match="cannot write"):
        hybrid.save_pretrained(tmp_path / "afile" / "h")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    hybrid.save_pretrained(tmp_path / "mine")  # like transformers: into an existing folder, others kept
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept" and (tmp_path / "mine" / "config.json").is_file()


def test_outputs_get_the_usual_file_modes(workspace, capsys):
    old = os.umask(0o022)
    try:  # evaluated on a file: its tokens are cached, the cache files get the usual modes too
        assert main([str(a) for a in convert_copy(workspace, workspace / "modes", "--eval", workspace / "eval.txt",
                                                  "--eval-window", 32, "--eval-windows", 2)]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (workspace / "modes").iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o644, modes
    assert all(m == 0o644 for m in modes.values()), modes
    tokens = list((workspace / "cache" / "tokens").glob("*.npy"))
    assert len(tokens) == 2  # the evaluation text's token stream and its document bounds
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tokens} == {p.name: 0o644 for p in tokens}


# -- leftovers that block the next run -------------------------------------------------------------

def test_recover_that_fails_early_leaves_no_partial_folder(workspace, capsys):
    out = workspace / "rec"
    one_error(capsys, "no training data", "recover", "--teacher", workspace / "teacher", "--keep", "0,2",
              "--out", out, "--device", "cpu")
    one_error(capsys, "keep", "recover", "--teacher", workspace / "teacher", "--keep", "0,0.5",
              "--data", workspace / "calib.txt", "--out", out, "--device", "cpu")
    assert not (workspace / "rec.partial").exists() and not out.exists()


@pytest.fixture()
def assets(workspace):
    from helpers import write_distill_assets

    return write_distill_assets(workspace)


def distill_args(ws, out, *extra):
    return ("distill", ws / "hybrid", "--teacher", ws / "teacher", "--data", ws / "train.npy", "--eval",
            ws / "eval.npy", "--eval-window", 32, "--eval-windows", 2, "--seq-len", 32, "--batch-size", 2,
            "--tokens", 256, "--device", "cpu", "--no-progress", "--out", out, *extra)


def test_distill_that_fails_at_step_one_leaves_nothing_and_the_rerun_works(assets, capsys):
    out = assets / "run"
    one_error(capsys, "not finite", *distill_args(assets, out, "--lr", "1e30"))
    assert not (assets / "run.partial").exists() and not out.exists()
    code, _, err = run(capsys, *distill_args(assets, out))  # no --resume needed
    assert code == 0 and (out / "model.safetensors").is_file(), err


def test_distill_on_a_teacher_directory_or_a_file_out(assets, capsys):
    out = assets / "run"
    one_error(capsys, "needs a tcal hybrid", "distill", assets / "teacher", *distill_args(assets, out)[2:])
    assert not (assets / "run.partial").exists()
    (assets / "taken").write_text("x")
    one_error(capsys, "is a file", *distill_args(assets, assets / "taken"))
    one_error(capsys, "--lr must be a finite number", *distill_args(assets, out, "--lr", "nan"))
    assert (assets / "taken").read_text() == "x" and not (assets / "taken.partial").exists()


# -- checks that come before the first expensive step ----------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["ablate", "--align-steps", "-1"], "--align-steps must be >= 0"),
    (["ablate", "--calib-windows", "1"], "--calib-windows must be at least 2"),
    (["ablate", "--inits", "copy,magic"], "unknown init 'magic'"),
    (["ablate", "--eval-windows", "0"], "--eval-windows must be at least 1"),
    (["convert", "--init", "magic"], "unknown init 'magic'"),
    (["convert", "--keep", "best:3"], "unknown keep policy"),
    (["convert", "--keep", "uniform:0"], "keep at least 1"),
    (["convert", "--kl-recall-frac", "-1"], "--kl-recall-frac must be in"),
    (["convert", "--init", "phase2", "--kl-recall-frac", "0.5"],
     "--kl-recall-frac is read by the inits with a KL stage (taylor) only, and this run is --init phase2"),
    (["convert", "--init", "phase1", "--fit-matmul", "fast"],  # the fits' products: an init without fits reads none
     "--fit-matmul is read by the inits with Phase 2 (phase2, "),
    (["convert", "--kl-recall-frac", "0.5", "--calib-budget", "reference"], "the reference budget's are 256"),
    (["convert", "--kl-recall-frac", "0.5", "--calib-window", "256", "--kl-recall-span", "256"],
     "needs --calib-window of at least 512"),
    (["pool", "--sources", ","], "--sources is empty"),
    (["pool", "--sources", "wiki:eval"], "evaluation text"),
    (["pool", "--max-tokens", "0"], "--max-tokens must be positive"),
    (["distill", "--lr", "nan"], "--lr must be a finite number"),
    (["distill", "--recall-frac", "2"], "--recall-frac must be in"),
    (["distill", "--recall-frac", "0.5", "--seq-len", "512", "--recall-span", "300"], "--recall-span must be between"),
    (["recover", "--lr", "inf"], "--lr must be a finite number"),
])
def test_argument_errors_come_before_the_teacher_loads(workspace, capsys, argv, message):
    # the teacher does not exist: an argument error must be reported first, by the flag's name
    one_error(capsys, message, *argv, "--teacher", workspace / "no-such-teacher", "--out", workspace / "o")
    assert not (workspace / "o").exists()


def test_binary_data_as_a_text_corpus_is_refused(workspace, capsys):
    (workspace / "noise.txt").write_bytes(np.random.default_rng(0).bytes(4096))
    one_error(capsys, "is not text", "eval", workspace / "teacher", "--data", workspace / "noise.txt",
              "--window", 16, "--windows", 1)
    one_error(capsys, "is not text", "convert", "--teacher", workspace / "teacher", "--init", "phase2",
              "--calib", workspace / "noise.txt", "--out", workspace / "o")
    assert not (workspace / "o").exists()


@pytest.mark.parametrize("argv", [
    ["eval", "{teacher}", "--data", "{spec}"],
    ["eval", "{teacher}", "--task", "single", "--haystack", "{spec}"],
    ["eval", "{teacher}", "--lm-eval", "tcal_lastword", "--lm-eval-data", "{spec}"],
    ["stats", "{teacher}", "--data", "{spec}"],
    ["convert", "--teacher", "{teacher}", "--calib", "{spec}"],
    ["convert", "--teacher", "{teacher}", "--calib", "{ws}/calib.txt+{spec}"],
    ["convert", "--teacher", "{teacher}", "--calib", "{ws}/calib.txt", "--eval", "{spec}"],
    ["ablate", "--teacher", "{teacher}", "--calib", "{spec}"],
    ["ablate", "--teacher", "{teacher}", "--calib", "{ws}/calib.txt", "--eval", "{ws}/eval.txt,{spec}"],
])
@pytest.mark.parametrize("spec", ["{ws}/my corpus.txt", "{ws}/my corpus", "./my corpus", "~/no such dir/my corpus"])
def test_a_missing_path_with_a_space_is_not_read_as_text(workspace, capsys, monkeypatch, argv, spec):
    # the teacher does not exist: the data argument must be reported first, as the path it is
    monkeypatch.chdir(workspace)
    spec = spec.replace("{ws}", str(workspace))
    argv = [a.replace("{spec}", spec).replace("{teacher}", str(workspace / "no-such-teacher"))
            .replace("{ws}", str(workspace)) for a in argv]
    out = () if argv[:3:2] == ["eval", "--data"] else ("--out", workspace / "o")  # perplexity writes no directory
    message = one_error(capsys, f"corpus file {spec} does not exist; check the path", *argv, *out)
    assert f"write text:{spec}" in message
    assert not (workspace / "o").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("argv", [
    ["convert", "--teacher", "{teacher}"],
    ["ablate", "--teacher", "{teacher}"],
    ["recover", "--teacher", "{teacher}"],
    ["distill", "{ws}/no-such-hybrid", "--teacher", "{teacher}"],
    ["stats", "{teacher}"],
    ["eval", "{teacher}", "--task", "single"],
    ["eval", "{teacher}", "--lm-eval", "tcal_lastword"],
    ["pool", "--teacher", "{teacher}"],
    ["export", "{ws}/no-such-hybrid"],
    ["bench", "smollm2-135m", "--num-layers", "2", "--keep", "0", "--contexts", "16", "--device", "cpu"],
])
def test_an_out_that_cannot_be_created_is_refused_first(workspace, capsys, argv):
    # os.access lets root write to /proc; only creating a directory there shows it cannot be done
    argv = [a.replace("{teacher}", str(workspace / "no-such-teacher")).replace("{ws}", str(workspace)) for a in argv]
    one_error(capsys, "cannot write --out /proc/forbidden/x: a directory cannot be created in /proc "
                      "(No such file or directory); choose a writable --out", *argv, "--out", "/proc/forbidden/x")


@pytest.mark.parametrize("argv", [
    ["convert", "--teacher", "{teacher}", "--keep", "uniform:150%"],
    ["ablate", "--teacher", "{teacher}", "--keep", "ar:100%"],
    ["bench", "--keep", "uniform:150%", "--device", "cpu"],
])
def test_a_keep_percentage_of_100_or_more_is_named_as_a_percentage(workspace, capsys, argv):
    argv = [a.replace("{teacher}", str(workspace / "no-such-teacher")) for a in argv]
    keep = argv[argv.index("--keep") + 1]
    one_error(capsys, f"keep policy {keep!r} asks for {keep.partition(':')[2]} of the layers; a percentage must "
                      "be below 100%", *argv, "--out", workspace / "o")
    assert not (workspace / "o").exists()


def test_a_latin1_corpus_is_named_not_utf8_not_binary(workspace, capsys):
    text = " ".join(["the café sat on the crème brûlée"] * 40)
    (workspace / "fr.txt").write_bytes(text.encode("latin-1"))
    fixed = workspace / "fr.utf8.txt"
    for argv in (["eval", workspace / "no-such-teacher", "--data", workspace / "fr.txt"],
                 ["convert", "--teacher", workspace / "no-such-teacher", "--calib", workspace / "fr.txt",
                  "--out", workspace / "o"]):
        one_error(capsys, f"{workspace / 'fr.txt'} is not UTF-8 (byte 0xE9 at offset 7); if it is Latin-1 / "
                          f"Windows-1252 text, convert it with `iconv -f cp1252 -t utf-8 {workspace / 'fr.txt'} > "
                          f"{fixed}` and give that file", *argv)
    fixed.write_bytes(text.encode("latin-1").decode("cp1252").encode("utf-8"))  # what iconv writes
    code, _, err = run(capsys, "eval", workspace / "teacher", "--data", fixed, "--window", 8, "--windows", 1)
    assert code == 0, err


# -- the Python API names the argument --------------------------------------------------------------

def test_python_api_errors(workspace):
    from helpers import tiny_teacher

    from tcal.taylor.phase2 import AlignConfig

    teacher = tiny_teacher()
    with pytest.raises(TcalError, match="integer layer indices"):
        tcal.convert(teacher, keep=[0.5, 2], init="copy")
    with pytest.raises(TcalError, match="lr_qkv"):
        AlignConfig(lr_qkv=math.nan)
    with pytest.raises(TcalError, match="tokenizer"):
        tcal.perplexity(teacher, None, "some text to score here", window=4, windows=1)
    assert tcal.perplexity(teacher, None, torch.randint(0, 97, (1, 8)), window=8, windows=1) > 0


def test_converting_every_global_layer_is_one_warning_line(tmp_path, capsys):
    # a Gemma 3 teacher whose layer 3 is its only global one, and a keep list that converts it
    from helpers import tiny_teacher, word_tokenizer

    from tcal.cli import _format_warning
    from tcal.utils.errors import TcalWarning

    words = "the cat sat on a mat dog ran far away".split()
    tiny_teacher("gemma3", num_hidden_layers=4).save_pretrained(tmp_path / "gemma")
    word_tokenizer(words).save_pretrained(tmp_path / "gemma")
    with pytest.warns(TcalWarning, match=r"^the keep list converts every global-attention layer \(3\)") as seen:
        code, _, err = run(capsys, "convert", "--teacher", tmp_path / "gemma", "--keep", "0,1", "--init", "copy",
                           "--eval", "text:" + " ".join(words * 20), "--eval-windows", 1, "--eval-window", 8,
                           "--no-progress", "--out", tmp_path / "o")
    assert code == 0, err
    w = seen[0]
    line = _format_warning(w.message, w.category, w.filename, w.lineno)
    assert line.startswith("tcal: warning: the keep list") and line.count("\n") == 1
    assert "- warning: the keep list converts every global-attention layer" in (tmp_path / "o" / "report.md").read_text()


# -- lists, lengths and text that slip through ---------------------------------------------------------

@pytest.mark.parametrize("keep, message", [
    ("1,,2", "keep '1,,2' has an empty entry"),
    ("1,2,", "keep '1,2,' has an empty entry"),
    (",1", "keep ',1' has an empty entry"),
    ("0,a", "keep '0,a': 'a' is not a layer index"),
    ("0,2,0", "keep '0,2,0' names layer 0 more than once"),
])
def test_a_malformed_keep_list_is_an_error(workspace, capsys, keep, message):
    out = workspace / "out"
    one_error(capsys, message, "convert", "--teacher", workspace / "teacher", "--keep", keep, "--init", "copy",
              "--eval", "none", "--device", "cpu", "--out", out)
    assert not out.exists()
    from helpers import tiny_teacher

    with pytest.raises(TcalError, match=message.replace("(", r"\(")):  # the library's parser: the API too
        tcal.convert(tiny_teacher(), keep=keep, init="copy")


def test_eval_lengths_empty_is_said_in_the_command_lines_words(workspace, capsys):
    err = one_error(capsys, "--lengths is empty; give context lengths in tokens, e.g. --lengths 512,1024",
                    "eval", "--model", workspace / "no-such-model", "--task", "niah", "--lengths", "",
                    "--out", workspace / "niah", "--device", "cpu")  # said before the (missing) model is read
    assert "lengths=[" not in err and not (workspace / "niah").exists()


@pytest.fixture()
def eval_copies(workspace):
    """Files that hold the evaluation text eval.txt: all of it, and half of it."""
    text = (workspace / "eval.txt").read_text().split()
    (workspace / "copy.txt").write_text(" ".join(text))
    (workspace / "half.txt").write_text(" ".join(text[: len(text) // 2]))
    return workspace


# half: the first 750 of the 1,500 words hold 738 of the 1,488 13-word sequences
@pytest.mark.parametrize("name, covering", [("copy.txt", "100.0%"), ("half.txt", "49.6%")])
def test_calibration_and_training_text_holding_evaluation_text_is_refused(eval_copies, capsys, name, covering):
    ws, out = eval_copies, eval_copies / "out"
    ev = ws / "eval.txt"
    share = f"contains evaluation text: 100.0% of its 13-word sequences occur in {ev}, covering {covering} of it"
    one_error(capsys, f"calibration data '{ws / name}' {share}", "convert", "--teacher", ws / "teacher", "--keep",
              "0,2", "--init", "taylor", "--calib", ws / name, "--eval", ev, "--device", "cpu", "--out", out)
    one_error(capsys, f"calibration data '{ws / name}' {share}", "convert", "--teacher", ws / "teacher", "--keep",
              "ar:1", "--init", "copy", "--calib", f"{ws / 'calib.txt'}+{ws / name}", "--eval", ev, "--device", "cpu",
              "--out", out)  # a scored policy reads the calibration text too; each part of a mixture is checked
    one_error(capsys, f"calibration data '{ws / name}' {share}", "ablate", "--teacher", ws / "teacher", "--keep",
              "0,2", "--calib", ws / name, "--eval", ev, "--device", "cpu", "--out", out)
    one_error(capsys, f"training data '{ws / name}' {share}", "recover", "--teacher", ws / "teacher", "--keep", "0,2",
              "--inits", "copy,zero-gate", "--data", ws / name, "--eval", ev, "--device", "cpu", "--out", out)
    (ws / "hybrid").mkdir()
    one_error(capsys, f"training data '{ws / name}' {share}", "distill", ws / "hybrid", "--teacher", ws / "teacher",
              "--data", ws / name, "--eval", ev, "--device", "cpu", "--out", out)
    assert not out.exists() and not (ws / "out.partial").exists()


@pytest.fixture()
def wiki_eval_copies(workspace, monkeypatch):
    """The user's tcal cache (the built-in corpora, downloaded once), and files holding all of wiki:eval and half."""
    monkeypatch.delenv("TCAL_CACHE", raising=False)
    from tcal.data.corpora import load_corpus

    docs = load_corpus("wiki:eval").documents
    (workspace / "wiki_all.txt").write_text("\n\n".join(docs))
    (workspace / "wiki_half").mkdir()
    (workspace / "wiki_half" / "half.txt").write_text("\n\n".join(docs[: len(docs) // 2]))
    return workspace


@pytest.mark.integration
def test_text_of_a_builtin_evaluation_split_is_refused_whatever_the_command_evaluates(wiki_eval_copies, capsys):
    ws, out = wiki_eval_copies, wiki_eval_copies / "out"
    one_error(capsys, f"calibration data '{ws / 'wiki_all.txt'}' contains evaluation text", "convert", "--teacher",
              ws / "teacher", "--keep", "0,2", "--init", "phase1", "--calib", ws / "wiki_all.txt", "--eval", "none",
              "--device", "cpu", "--out", out)
    err = one_error(capsys, "pool source 'dir:", "pool", "--teacher", ws / "teacher", "--sources",
                    f"dir:{ws / 'wiki_half'}", "--out", out, "--no-progress")
    assert "occur in wiki:eval" in err and not out.exists()
    teacher, tokenizer = tcal.load_teacher(str(ws / "teacher"))
    with pytest.raises(TcalError, match="occur in wiki:eval, covering 100.0% of it"):  # the library calibrates too
        tcal.convert(teacher, keep=[0, 2], init="phase1", calib=str(ws / "wiki_all.txt"), tokenizer=tokenizer)


# -- inputs that were once a traceback, ignored, or accepted when they should not be -----------------------------

@pytest.mark.parametrize("keep", ["interval:\u00b2", "\u00b2", "0,\u00b2", "uniform:\u2460"])
def test_digits_int_does_not_take_are_one_line(workspace, capsys, keep):
    one_error(capsys, "keep", *convert_copy(workspace, workspace / "out")[:4], keep, "--init", "copy", "--eval", "none",
              "--device", "cpu", "--out", workspace / "out")
    assert not (workspace / "out").exists()


@pytest.mark.parametrize("command", ["convert", "eval", "stats"])
def test_a_device_tcal_cannot_use_is_refused_before_the_teacher_loads(workspace, capsys, command):
    where = {"convert": ("--teacher", workspace / "no-such-teacher", "--out", workspace / "out"),
             "eval": (workspace / "no-such-teacher",), "stats": (workspace / "no-such-teacher",)}[command]
    for device in ("gpu", "tpu", "cuda:x"):
        one_error(capsys, f"unknown --device '{device}'; use cpu, cuda, cuda:N or auto", command, *where, "--device",
                  device)


def test_calibration_text_an_init_does_not_read_is_refused(workspace, capsys):
    ws, out = workspace, workspace / "out"
    one_error(capsys, "or the scored keep policies (ar, ga, niah) only, and this run is --init copy --keep 0,2 --eval "
              "none: drop --calib", "convert", "--teacher",
              ws / "teacher", "--keep", "0,2", "--init", "copy", "--calib", ws / "calib.txt", "--eval", "none",
              "--device", "cpu", "--out", out)
    assert not out.exists()
    code, _, err = run(capsys, *convert_copy(ws, out))  # without --calib: converted as before
    assert code == 0, err


def test_a_mixture_whose_parts_each_pass_is_refused_when_together_they_hold_the_evaluation_text(workspace, capsys):
    """Four files with a different sixth of eval.txt each: 17 % of it per part, under the 20 % limit; 67 % together."""
    ws, out = workspace, workspace / "out"
    words = (ws / "eval.txt").read_text().split()
    sixth = len(words) // 6
    parts = []
    for i in range(4):
        (ws / f"part{i}.txt").write_text(" ".join(words[i * sixth:(i + 1) * sixth]) + "\n\n"
                                         + (ws / "calib.txt").read_text())
        parts.append(str(ws / f"part{i}.txt"))
    mixture = "+".join(parts)
    from tcal.data.overlap import check_no_eval_text

    for part in parts:  # each alone passes
        check_no_eval_text(part, [str(ws / "eval.txt")], role="calibration data")
    err = one_error(capsys, f"calibration data '{mixture}' contains evaluation text", "convert", "--teacher",
                    ws / "teacher", "--keep", "0,2", "--init", "taylor", "--calib", mixture, "--eval", ws / "eval.txt",
                    "--device", "cpu", "--out", out)
    assert "covering 6" in err and not out.exists()


def test_calib_auto_follows_a_local_copy_or_hybrid_of_a_builtin_coder_back_to_it(workspace, tmp_path):
    import warnings

    from tcal.conversion.resolve import resolve_teacher_args
    from tcal.data.teacher_table import CODE_CALIB, PROSE_CALIB, builtin_origin
    from tcal.taylor.budget import CalibArgs

    copy = tmp_path / "my-qwen"  # the converted cache directory, copied elsewhere
    copy.mkdir()
    (copy / "tcal_teacher.json").write_text(json.dumps({"name": "qwen2.5-coder-0.5b"}))
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "tcal_config.json").write_text(json.dumps({"stage": "convert", "teacher": str(copy)}))
    distilled = tmp_path / "distilled"
    distilled.mkdir()
    (distilled / "tcal_config.json").write_text(json.dumps({"stage": "distill", "teacher": str(hybrid)}))
    for spec in (copy, hybrid, distilled):
        assert builtin_origin(str(spec)) == "qwen2.5-coder-0.5b"
        args = CalibArgs()
        resolve_teacher_args(args, str(spec), check=False)
        assert args.calib == CODE_CALIB
    assert builtin_origin(str(workspace / "teacher")) is None
    coder = tmp_path / "Qwen2.5-Coder-7B"  # a model tcal does not know, named like a code model: said aloud
    coder.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = CalibArgs()
        resolve_teacher_args(args, str(coder), check=False)
    assert args.calib == PROSE_CALIB and any(f"pass --calib {CODE_CALIB}" in str(w.message) for w in caught)


def test_a_damaged_cached_teacher_is_refused_not_scored_nan(workspace, capsys, tmp_cache):
    """A built-in teacher's converted cache whose bytes changed on disk: one line that says to delete it."""
    import shutil

    from tcal.data import teachers

    d = tmp_cache / "teachers" / "smollm2-135m"
    shutil.copytree(workspace / "teacher", d)
    import transformers

    files = {f.name: teachers.sha256_file(f) for f in d.glob("*.safetensors")}
    (d / "tcal_teacher.json").write_text(json.dumps({"name": "smollm2-135m", "transformers": transformers.__version__,
                                                     "files": files}))
    code, _, err = run(capsys, "eval", "smollm2-135m", "--data", workspace / "eval.txt", "--window", 8, "--windows", 1)
    assert code == 0, err
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64  # NaNs in the last tensor
    weights.write_bytes(bytes(data))
    one_error(capsys, f"the cached smollm2-135m teacher in {d} is damaged (model.safetensors: sha256", "eval",
              "smollm2-135m", "--data", workspace / "eval.txt", "--window", 8, "--windows", 1)
    (d / "tcal_teacher.json").write_text(json.dumps({"name": "smollm2-135m", "transformers": transformers.__version__}))
    assert not teachers._converted_ok(d)  # a conversion that recorded no hashes is converted again
