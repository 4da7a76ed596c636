"""tcal instruct end to end on a tiny teacher with a chat template, and distillation on the instruct set it writes:
the KL on the answers, raw text mixed in, the development answer KL at every curve point and the best checkpoint."""
import json

import numpy as np
import pytest
from helpers import one_error, run, tiny_teacher, word_tokenizer

from tcal.data.instruct import is_instruct_set, load_instruct_dev, load_instruct_set

CODE = "".join(f'def f{i}(a, b):\n    """Sum {i} of a and b."""\n    c = a + b\n    return c * {i}\n\n\n'
               for i in range(10))
WORDS = ("def ( a , b ) : Sum of and . c = + return * ``` Complete Write Implement Here the following "
         + " ".join(f"f{i} {i}" for i in range(10))).split()


@pytest.fixture(scope="module")
def chat_teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    tok = word_tokenizer(WORDS, extra=["<|im_start|>", "<|im_end|>", "user", "assistant"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    teacher = tiny_teacher("llama", vocab_size=len(tok), max_position_embeddings=512)
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    (root / "src").mkdir()
    (root / "src" / "mod.py").write_text(CODE)
    return root


def test_reference_answers_make_an_instruct_set_with_a_development_split(chat_teacher, tmp_path, capsys, tmp_cache):
    out = tmp_path / "set"
    code, errors, _ = run(capsys, "instruct", "--teacher", str(chat_teacher / "teacher"), "--sources",
                          f"dir:{chat_teacher / 'src'}", "--answers", "reference", "--dev-tasks", "2", "--seq-len",
                          "128", "--out", str(out), "--no-progress")
    assert code == 0, errors
    assert is_instruct_set(out)
    ids, mask, manifest = load_instruct_set(out)
    assert manifest["tasks"] == 10 and manifest["dev_tasks"] == 2 and manifest["samples"] == 8
    assert ids.shape[1] == 128 and 0 < mask.sum() < mask.size
    dev_ids, dev_mask = load_instruct_dev(out)
    assert dev_ids.shape[1] == 128 and int(dev_mask.sum()) > 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["split"] for r in rows].count("dev") == 2 and all(r["answer"].startswith("```python") for r in rows)


def test_samples_of_a_run_pack_again_into_the_same_windows(chat_teacher, tmp_path, capsys, tmp_cache):
    """--samples rebuilds an instruct set from a run's samples.jsonl (plain or .xz) without asking the teacher:
    the same windows, masks and development windows at the same --seq-len, and whole samples at another."""
    import lzma

    first = tmp_path / "first"
    common = ["--teacher", str(chat_teacher / "teacher"), "--no-progress"]
    code, errors, _ = run(capsys, "instruct", *common, "--sources", f"dir:{chat_teacher / 'src'}", "--answers",
                          "reference", "--dev-tasks", "2", "--seq-len", "128", "--out", str(first))
    assert code == 0, errors
    packed = tmp_path / "samples.jsonl.xz"
    packed.write_bytes(lzma.compress((first / "samples.jsonl").read_bytes()))
    again = tmp_path / "again"
    code, errors, _ = run(capsys, "instruct", *common, "--samples", str(packed), "--seq-len", "128",
                          "--out", str(again))
    assert code == 0, errors
    a_ids, a_mask, _ = load_instruct_set(first)
    b_ids, b_mask, manifest = load_instruct_set(again)
    assert np.array_equal(a_ids, b_ids) and np.array_equal(a_mask, b_mask)
    assert all(np.array_equal(x, y) for x, y in zip(load_instruct_dev(first), load_instruct_dev(again)))
    assert manifest["samples"] == 8 and manifest["dev_tasks"] == 2
    wide = tmp_path / "wide"
    code, errors, _ = run(capsys, "instruct", *common, "--samples", str(packed), "--seq-len", "256",
                          "--out", str(wide))
    assert code == 0, errors
    w_ids, w_mask, _ = load_instruct_set(wide)
    assert w_ids.shape[0] < a_ids.shape[0] and int(w_mask.sum()) == int(a_mask.sum())


def test_an_earlier_set_that_repeats_a_task_packs_with_a_note(chat_teacher, tmp_path, capsys, tmp_cache):
    """Before: `tcal instruct --samples` refused tcal's own published set ("record 219 repeats the task ..."); now the
    repeat is read once, the windows are those of the set without it, and the run says what it left out."""
    first = tmp_path / "first"
    common = ["--teacher", str(chat_teacher / "teacher"), "--no-progress", "--seq-len", "128"]
    code, errors, _ = run(capsys, "instruct", *common, "--sources", f"dir:{chat_teacher / 'src'}", "--answers",
                          "reference", "--dev-tasks", "2", "--out", str(first))
    assert code == 0, errors
    lines = (first / "samples.jsonl").read_text().splitlines()
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join([*lines, lines[3]]) + "\n")
    again = tmp_path / "again"
    code, errors, err = run(capsys, "instruct", *common, "--samples", str(dup), "--out", str(again))
    assert code == 0, errors
    assert "note: dup.jsonl: 1 record(s) repeat a task of another record (the first: record 11" in err
    a_ids, a_mask, _ = load_instruct_set(first)
    b_ids, b_mask, manifest = load_instruct_set(again)
    assert np.array_equal(a_ids, b_ids) and np.array_equal(a_mask, b_mask)
    assert manifest["tasks"] == 10 and len(manifest["notes"]) == 1


def test_samples_that_are_not_an_instruct_runs_are_one_line(chat_teacher, tmp_path, capsys, tmp_cache):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "k", "prompt": "p"}\n')
    out = tmp_path / "out"
    one_error(capsys, "record 1 lacks", "instruct", "--teacher", str(chat_teacher / "teacher"), "--samples", str(bad),
              "--out", str(out), "--no-progress")
    assert not out.exists()
    one_error(capsys, "not a readable samples.jsonl", "instruct", "--samples", str(tmp_path / "none.jsonl"),
              "--out", str(out), "--no-progress")


def test_teacher_answers_are_cut_at_the_end_of_their_code_block_and_resume(chat_teacher, tmp_path, capsys,
                                                                            tmp_cache, monkeypatch):
    """The teacher's own answers: kept up to the end of the first code block, dropped where none closes; an
    interrupted run's answers are read back with --resume, not generated again."""
    import tcal.engines.tcal_generate as G

    calls = []

    def fake(model, tokenizer, prompts, max_new_tokens, **kw):
        calls.append(len(prompts))
        return [("```python\nc = a + b\n```\ntrailing words" if i % 2 == 0 else "```python\nnever closes")
                for i in range(len(prompts))]

    monkeypatch.setattr(G, "generate_greedy", fake)
    out = tmp_path / "set"
    args = ("instruct", "--teacher", str(chat_teacher / "teacher"), "--sources", f"dir:{chat_teacher / 'src'}",
            "--dev-tasks", "1", "--seq-len", "128", "--batch-size", "4", "--out", str(out), "--no-progress")
    code, errors, _ = run(capsys, *args)
    assert code == 0, errors
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dropped_unfinished"] == 5 and manifest["samples"] + manifest["dev_tasks"] == 5
    answers = [json.loads(line)["answer"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert set(answers) == {"```python\nc = a + b\n```"}
    assert sum(calls) == 10
    # an interrupted run: its answers so far are on disk; --resume answers only the rest
    from tcal.utils.partial import Work

    partial = Work(tmp_path / "again.partial", "instruct")  # what the killed run left: tcal's marked folder
    log = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()][:3]
    partial.write_text("answers.jsonl", "".join(json.dumps({"key": r["key"], "answer": r["answer"]}) + "\n"
                                                for r in log) + '{"key": "cut')
    calls.clear()
    code, errors, _ = run(capsys, *args[:-3], "--out", str(tmp_path / "again"), "--resume", "--no-progress")
    assert code == 0, errors
    assert sum(calls) == 7
    monkeypatch.setattr(G, "generate_greedy", lambda m, t, prompts, n, **kw: ["```python\nopen"] * len(prompts))
    one_error(capsys, "finished none of the 10 tasks", *args[:-3], "--out", str(tmp_path / "none"), "--no-progress")


def test_bad_instruct_flags_are_one_line(chat_teacher, tmp_path, capsys, tmp_cache):
    base = ("instruct", "--teacher", str(chat_teacher / "teacher"), "--out", str(tmp_path / "o"))
    one_error(capsys, "--dev-tasks must be in", *base, "--dev-tasks", "5000")
    one_error(capsys, "--sources is empty", *base, "--sources", " , ")
    one_error(capsys, "contains evaluation text", *base, "--sources", "code:eval")
    (tmp_path / "o.partial").mkdir()  # a folder tcal did not write: refused, and left as it is
    one_error(capsys, "tcal did not write it", *base)
    one_error(capsys, "tcal did not write it", *base, "--resume")
    assert (tmp_path / "o.partial").is_dir()


def test_distillation_on_an_instruct_set_trains_on_the_answers_and_keeps_the_best_checkpoint(
        chat_teacher, tmp_path, capsys, tmp_cache):
    import tcal

    out = tmp_path / "set"
    code, errors, _ = run(capsys, "instruct", "--teacher", str(chat_teacher / "teacher"), "--sources",
                          f"dir:{chat_teacher / 'src'}", "--answers", "reference", "--dev-tasks", "2", "--seq-len", "128",
                          "--out", str(out), "--no-progress")
    assert code == 0, errors
    teacher, tok = tcal.load_teacher(str(chat_teacher / "teacher"))
    hybrid_dir = tmp_path / "hybrid"
    tcal.convert(teacher, keep=[0, 2], init="copy", target="native").save_pretrained(hybrid_dir)
    tok.save_pretrained(hybrid_dir)
    raw = tmp_path / "raw.npy"
    np.save(raw, np.random.default_rng(0).integers(0, len(tok), 4000).astype(np.uint16))
    ev = tmp_path / "eval.npy"
    np.save(ev, np.random.default_rng(1).integers(0, len(tok), 512).astype(np.uint16))
    args = ("distill", str(hybrid_dir), "--teacher", str(chat_teacher / "teacher"), "--data", str(out),
            "--eval", str(ev), "--eval-window", "32", "--eval-windows", "2", "--batch-size", "4",
            "--tokens", "1024", "--eval-every", "512", "--eval-early", "0", "--lr", "3e-3", "--no-progress")
    one_error(capsys, "instruct set of 128-token windows: use --seq-len 128", *args, "--out", str(tmp_path / "x"))
    # before the models load: a hybrid and a teacher that do not exist are not reached
    one_error(capsys, "instruct set of 128-token windows: use --seq-len 128", "distill", str(tmp_path / "none"),
              "--teacher", str(tmp_path / "none"), *args[4:], "--out", str(tmp_path / "x"))
    one_error(capsys, "--mix-data " + str(out) + " is an instruct set (tcal instruct); --mix-data takes raw text",
              *args, "--seq-len", "128", "--mix-data", str(out), "--out", str(tmp_path / "x"))
    code, errors, _ = run(capsys, *args, "--seq-len", "128", "--mix-data", str(raw), "--mix-frac", "0.25",
                          "--out", str(tmp_path / "d"))
    assert code == 0, errors
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    curve = report["curve"]
    assert [r["tokens"] for r in curve] == [0, 512, 1024] and all("answer_kl" in r for r in curve)
    best = min(curve, key=lambda r: r["answer_kl"])
    assert report["best"]["tokens"] == best["tokens"] and report["best"]["answer_kl"] == best["answer_kl"]
    assert (tmp_path / "d" / "best" / "config.json").is_file()
    assert report["data"]["kind"] == "instruct" and report["data"]["mix"]["frac"] == 0.25
    assert report["teacher_probes"]["answer_kl"] == pytest.approx(0.0, abs=1e-6)


# -- the user's files, the samples' checks, and what a resumed run must match -------------------------------------

@pytest.fixture()
def reference_set(chat_teacher, tmp_path, capsys):
    out = tmp_path / "set"
    code, errors, _ = run(capsys, "instruct", "--teacher", str(chat_teacher / "teacher"), "--sources",
                          f"dir:{chat_teacher / 'src'}", "--answers", "reference", "--dev-tasks", "2", "--seq-len",
                          "128", "--out", str(out), "--no-progress")
    assert code == 0, errors
    return out


def test_samples_are_copied_under_tcals_own_name_never_over_the_users_file(chat_teacher, reference_set, tmp_path,
                                                                           capsys, tmp_cache):
    """Before: the copy kept the samples file's name, so --samples my.jsonl replaced the user's OUT/my.jsonl, and a
    samples file named manifest.json the set's manifest."""
    rows = (reference_set / "samples.jsonl").read_text()
    (reference_set / "my.jsonl").write_text("mine")
    for name in ("my.jsonl", "manifest.json"):
        given = tmp_path / "elsewhere" / name
        given.parent.mkdir(exist_ok=True)
        given.write_text(rows)
        code, errors, _ = run(capsys, "instruct", "--teacher", str(chat_teacher / "teacher"), "--samples", str(given),
                              "--seq-len", "128", "--out", str(reference_set), "--overwrite")
        assert code == 0, errors
        assert (reference_set / "my.jsonl").read_text() == "mine" and is_instruct_set(reference_set)
        assert (reference_set / "samples.jsonl").read_text() == rows


def _samples(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_samples_for_another_chat_template_or_with_only_development_tasks_are_one_line(chat_teacher, reference_set,
                                                                                     tmp_path, capsys, tmp_cache):
    rows = [json.loads(line) for line in (reference_set / "samples.jsonl").read_text().splitlines()]
    other = _samples(tmp_path / "other.jsonl", [dict(rows[0], prompt="<start_of_turn>user\nhi<end_of_turn>\n")]
                     + rows[1:])
    one_error(capsys, "the prompt of record 1", "instruct", "--teacher", str(chat_teacher / "teacher"), "--samples",
              str(other), "--out", str(tmp_path / "o"))
    dev = _samples(tmp_path / "dev.jsonl", [r for r in rows if r["split"] == "dev"])
    one_error(capsys, "holds development samples only", "instruct", "--teacher", str(chat_teacher / "teacher"),
              "--samples", str(dev), "--seq-len", "128", "--out", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_a_resumed_run_must_ask_the_same_teacher_the_same_way(chat_teacher, tmp_path, capsys, tmp_cache):
    """Before: --resume reused the answers of another teacher or another --max-new-tokens and labelled them this
    run's."""
    from tcal.recipes.instruct import InstructConfig, answer_settings
    from tcal.utils.partial import Work, partial_dir

    out = tmp_path / "set"
    base = ("instruct", "--teacher", str(chat_teacher / "teacher"), "--sources", f"dir:{chat_teacher / 'src'}",
            "--out", str(out), "--no-progress")
    cfg = InstructConfig(teacher=str(chat_teacher / "teacher"), sources=f"dir:{chat_teacher / 'src'}")
    Work(partial_dir(out), "instruct", answer_settings(cfg)).write_text(
        "answers.jsonl", json.dumps({"key": "k", "answer": None}) + "\n")  # what an interrupted run leaves
    one_error(capsys, "settings changed (max_new_tokens)", *base, "--resume", "--max-new-tokens", "100")
    one_error(capsys, "settings changed (teacher)", *base[:1], "--teacher", str(tmp_path / "another"), *base[3:],
              "--resume")
    one_error(capsys, "pass --resume to continue it", *base)
    assert (partial_dir(out) / "answers.jsonl").is_file()


def test_a_users_partial_folder_survives_resume(chat_teacher, tmp_path, capsys, tmp_cache):
    """Before: --resume wrote into the user's OUT.partial and then deleted it."""
    mine = tmp_path / "user.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    one_error(capsys, "tcal did not write it", "instruct", "--teacher", str(chat_teacher / "teacher"), "--sources",
              f"dir:{chat_teacher / 'src'}", "--out", str(tmp_path / "user"), "--resume")
    assert (mine / "notes.txt").read_text() == "mine" and [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_bad_counts_name_themselves_and_a_set_with_no_training_task_says_why(chat_teacher, tmp_path, capsys,
                                                                            tmp_cache, monkeypatch):
    import tcal.engines.tcal_generate as G

    base = ("instruct", "--teacher", str(chat_teacher / "teacher"), "--sources", f"dir:{chat_teacher / 'src'}",
            "--seq-len", "128", "--no-progress")
    one_error(capsys, "--max-tasks must be at least 1, got 0", *base, "--max-tasks", "0", "--out", str(tmp_path / "a"))
    monkeypatch.setattr(G, "generate_greedy", lambda m, t, prompts, n, **kw: [
        "```python\nc = a + b\n```" if i % 2 == 0 else "```python\nopen" for i in range(len(prompts))])
    one_error(capsys, "all 5 tasks kept are development tasks (--dev-tasks 5), so none is left to train on", *base,
              "--dev-tasks", "5", "--out", str(tmp_path / "b"))
