"""RULER-style retrieval: prompts generated locally and deterministically, RULER's scoring, bad input."""
import json

import pytest
import torch
from helpers import tiny_teacher, word_tokenizer

import tcal
from tcal.cli import main
from tcal.evaluate.tasks.niah import RETRIEVAL
from tcal.evaluate.tasks.niah.ruler import NEEDLE, TASKS, accuracy_interval, make_samples, niah, niah_details, score
from tcal.recipes.eval import PARTIAL_MARK
from tcal.utils.errors import TcalError

TEXT = ("The committee met in the spring. It discussed the harbor and the roads. Members spoke at length. "
        "A vote was taken on the budget. The budget passed by a narrow margin. Work began in the summer. ") * 40


@pytest.fixture()
def tok():
    return word_tokenizer(TEXT.replace(".", " .").split())


def test_scoring_follows_ruler_string_match_all():
    assert score("The numbers are: 1234567 and 7654321.", ["1234567"]) == 1.0
    assert score("the magic number is 123456", ["1234567"]) == 0.0  # a prefix of the answer is not the answer
    assert score("ABC-def and xyz", ["abc-DEF", "xyz", "qqq", "zzz"]) == 0.5  # case-insensitive, recall of all
    with pytest.raises(TcalError, match="at least one"):
        score("x", [])


def test_the_task_table_and_the_registrys_names_agree():
    assert tuple(TASKS) == RETRIEVAL


@pytest.mark.parametrize("task", list(TASKS))
def test_prompts_fit_the_length_hold_the_answers_and_repeat_for_a_seed(tok, task):
    a = make_samples(task, tok, 400, 5, seed=1, documents=[TEXT])
    b = make_samples(task, tok, 400, 5, seed=1, documents=[TEXT])
    c = make_samples(task, tok, 400, 5, seed=2, documents=[TEXT])
    assert [s.prompt for s in a] == [s.prompt for s in b]  # every model of this tokenizer sees the same prompts
    assert [s.answers for s in a] != [s.answers for s in c]
    assert [s.depth for s in a] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for s in a:
        n = len(tok(s.prompt, add_special_tokens=False)["input_ids"]) + s.max_new_tokens
        assert 300 <= n <= 400, n  # filled close to the length, never past it
        assert all(ans in s.prompt for ans in s.answers)


def test_the_answer_gets_rulers_room_and_a_smaller_room_a_longer_haystack(tok):
    # RULER's tokens_to_generate: niah 128, variable tracking 30, common words 120
    rooms = {t: make_samples(t, tok, 600, 1, documents=[TEXT])[0].max_new_tokens for t in ("single", "vt", "cwe")}
    assert rooms == {"single": 128, "vt": 30, "cwe": 120}
    (wide,), (tight,) = (make_samples("single", tok, 600, 1, documents=[TEXT], max_new_tokens=m) for m in (None, 12))
    n = [len(tok(s.prompt, add_special_tokens=False)["input_ids"]) for s in (wide, tight)]
    assert tight.max_new_tokens == 12 and n[1] - n[0] > 100 and n[1] + 12 <= 600
    assert tight.answers == wide.answers  # the same needle, in more text
    with pytest.raises(TcalError, match="max_new_tokens must be at least 1"):
        make_samples("single", tok, 600, 1, documents=[TEXT], max_new_tokens=0)


def test_a_row_stops_once_it_holds_its_answers_and_no_other_row_changes(tok):
    """The early stop must not change a score: a stopped row is a prefix of its full greedy output that already
    holds every answer, and the rows that do not stop come out exactly as without it."""
    from tcal.engines.tcal_generate import generate_greedy

    torch.manual_seed(0)
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    prompts = ["The committee met in the spring .", "A vote was taken on the budget . Work began"]
    full = generate_greedy(model, tok, prompts, 40, batch_size=2)
    words = full[0].split()
    target = next(w for w in words[5:] if w not in words[:5])  # first appears a few tokens in
    answers = [[target], ["not-in-the-vocabulary"]]
    stopped = generate_greedy(model, tok, prompts, 40, batch_size=2, done=lambda i, t: score(t, answers[i]) == 1.0)
    assert score(stopped[0], [target]) == 1.0 and full[0].startswith(stopped[0]) and len(stopped[0]) < len(full[0])
    assert stopped[0].split()[-1] == target  # stopped at the token that completed the answer
    assert stopped[1] == full[1]


def test_needle_depth_is_where_the_needle_sits(tok):
    first, last = make_samples("single", tok, 600, 2, documents=[TEXT])
    for s, lo, hi in ((first, 0.0, 0.15), (last, 0.85, 1.0)):
        needle = NEEDLE.split("{")[0]
        pos = s.prompt.index(needle) / len(s.prompt)
        assert lo <= pos <= hi, (s.depth, pos)


def test_multi_answer_tasks_ask_for_every_value(tok):
    (mv,) = make_samples("multivalue", tok, 500, 1, documents=[TEXT])
    (mq,) = make_samples("multiquery", tok, 500, 1, documents=[TEXT])
    (mk,) = make_samples("multikey", tok, 500, 1, documents=[TEXT])
    assert len(mv.answers) == 4 and len(mq.answers) == 4 and len(mk.answers) == 1
    assert mk.prompt.count("One of the special magic numbers for") == 4  # three distractor needles


def test_bad_input_is_a_tcal_error(tok):
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    with pytest.raises(TcalError, match="known tasks: single"):
        niah(model, tok, [128], task="needle")
    with pytest.raises(TcalError, match="samples must be at least 1"):
        niah(model, tok, [128], samples=0)
    with pytest.raises(TcalError, match="position limit 512"):
        niah(model, tok, [1024], haystack="text:" + TEXT)
    with pytest.raises(TcalError, match="too few sentences"):
        make_samples("single", tok, 4000, 1, documents=["One short sentence here. And another one."])
    with pytest.raises(TcalError, match="too short"):
        make_samples("single", tok, 20, 1, documents=[TEXT])
    with pytest.raises(TcalError, match="tokenizer"):
        niah(model, None, [128])


def test_niah_runs_a_model_and_returns_accuracy_by_length(tok):
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    res = niah(model, tok, [256, 384], samples=2, task="single-noise", batch_size=2)
    assert list(res) == [256, 384] and all(0.0 <= v <= 1.0 for v in res.values())
    rows = niah_details(model, tok, task="single", length=256, samples=3, haystack="text:" + TEXT)
    assert [r["depth"] for r in rows] == [0.0, 0.5, 1.0] and all(isinstance(r["output"], str) for r in rows)


def test_eval_command_writes_table_json_heat_map_and_resumes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))
    tok = word_tokenizer(TEXT.replace(".", " .").split() + NEEDLE.split())
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "hay.txt").write_text(TEXT)
    argv = ["eval", tmp_path / "m", "--task", "single,single-noise", "--lengths", "256,384", "--samples", "2",
            "--haystack", tmp_path / "hay.txt", "--out", tmp_path / "niah", "--device", "cpu"]
    assert main([str(a) for a in argv]) == 0
    out = tmp_path / "niah"
    data = json.loads((out / "niah.json").read_text())
    assert [(c["task"], c["length"]) for c in data["cells"]] == [("single", 256), ("single", 384),
                                                                  ("single-noise", 256), ("single-noise", 384)]
    assert {c["max_new_tokens"] for c in data["cells"]} == {128}
    md = (out / "niah.md").read_text()
    assert "| single-noise |" in md and (out / "niah.png").stat().st_size > 1000
    for c in data["cells"]:  # the stored interval is the one the table prints, around the cell's accuracy
        lo, hi = c["interval"]
        assert lo <= c["accuracy"] <= hi and f"{c['accuracy']:.2f} ({lo:.2f}-{hi:.2f})" in md
    assert not (tmp_path / "niah.partial").exists()
    # an interrupted run keeps its finished cells: the rerun computes only what is missing
    partial = tmp_path / "again.partial"
    partial.mkdir()
    (partial / PARTIAL_MARK).write_text('{"stage": "eval"}')  # as tcal marks its own unfinished work
    first = {k: v for k, v in data.items() if k in ("settings",)}
    first["cells"] = {f"{c['task']}@{c['length']}": c for c in data["cells"][:3]}
    (partial / "niah.json").write_text(json.dumps(first))
    calls = []
    import tcal.evaluate.tasks.niah.ruler as niah_module

    real = niah_module.niah_details
    monkeypatch.setattr(niah_module, "niah_details", lambda *a, **k: calls.append(k) or real(*a, **k))
    argv[-3] = tmp_path / "again"
    assert main([str(a) for a in argv]) == 0
    assert [(k["task"], k["length"]) for k in calls] == [("single-noise", 384)]
    capsys.readouterr()
    assert main([str(a) for a in argv] + ["--max-new-tokens", "0", "--out", str(tmp_path / "y")]) == 2
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err
    assert main([str(a) for a in argv[:2]] + ["--task", "needle", "--out", str(tmp_path / "x")]) == 2
    assert "unknown task 'needle' in --tasks" in capsys.readouterr().err


@pytest.mark.integration
def test_teacher_finds_the_needle_and_a_copy_init_hybrid_loses_it():
    teacher, tok = tcal.load_teacher("smollm2-135m")
    torch.set_num_threads(2)
    t = niah(teacher, tok, [512], samples=4, task="single")
    h = niah(tcal.convert(teacher, keep="uniform:50%", init="copy"), tok, [512], samples=4, task="single")
    assert t[512] >= 0.75 and h[512] <= 0.25, (t, h)


def test_retrieval_probes_score_what_niah_scores(tok, monkeypatch):
    """A training curve's probe builds its prompts once and scores any model on them: the same numbers as niah()
    for the same seed. A stand-in generator answers every other prompt right, so both must give exactly 0.5."""
    import re

    import tcal.evaluate.tasks.niah.ruler as niah_module
    from tcal.evaluate.tasks.niah.ruler import retrieval_probes

    def half_right(model, tokenizer, prompts, max_new_tokens, **kw):
        return [re.search(r"is: (\d+)\.", p).group(1) if i % 2 == 0 else "no idea" for i, p in enumerate(prompts)]

    monkeypatch.setattr(niah_module, "generate_greedy", half_right)
    model = tiny_teacher(vocab_size=len(tok), max_position_embeddings=512)
    probes = retrieval_probes(tok, [256, 384], 4, haystack="text:" + TEXT)
    assert list(probes) == ["single@256", "single@384"]
    assert {n: p(model) for n, p in probes.items()} == {"single@256": 0.5, "single@384": 0.5}
    assert niah(model, tok, [256, 384], samples=4, haystack="text:" + TEXT) == {256: 0.5, 384: 0.5}
    with pytest.raises(TcalError, match="tokenizer"):
        retrieval_probes(None, [128], 2)
    with pytest.raises(TcalError, match="samples"):
        retrieval_probes(tok, [128], 0)


def test_accuracy_interval_is_wilsons():
    # 18 of 20: p = 0.9, centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    lo, hi = accuracy_interval([1.0] * 18 + [0.0] * 2)
    assert lo == pytest.approx(0.6990, abs=1e-3) and hi == pytest.approx(0.9721, abs=1e-3)
    # all or nothing keeps a width of its own instead of collapsing onto 0 or 1
    lo, hi = accuracy_interval([1.0] * 20)
    assert hi == 1.0 and 0.8 < lo < 0.85
    lo, hi = accuracy_interval([0.0] * 20)
    assert lo == 0.0 and 0.15 < hi < 0.2
    # more prompts, a narrower interval around the same accuracy
    lo100, hi100 = accuracy_interval([1.0] * 90 + [0.0] * 10)
    lo20, hi20 = accuracy_interval([1.0] * 18 + [0.0] * 2)
    assert lo20 < lo100 < 0.9 < hi100 < hi20
    with pytest.raises(TcalError, match="at least one"):
        accuracy_interval([])
