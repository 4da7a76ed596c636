"""Instruct-format data: code tasks from source, their chat rendering, packing with the answer mask, instruct sets."""
import numpy as np
import pytest
import torch
from helpers import word_tokenizer

from tcal.data import instruct as I
from tcal.utils.errors import TcalError

SOURCE = '''"""A module."""
import math


def area(r):
    """The area of a circle of radius r."""
    x = r * r
    return math.pi * x


@cache
def decorated(x):
    """Left out: decorated."""
    y = x
    return y


def undocumented(x):
    y = x
    return y


def too_short(x):
    """One line of body is not a task."""
    return x


class Box:
    def method(self):
        """Methods are not top-level functions."""
        a = 1
        return a
'''


def test_tasks_are_the_documented_top_level_functions_with_a_body():
    tasks = I.code_tasks([SOURCE, "def broken(:\n"], source="mine")
    assert [t.name for t in tasks] == ["area"]
    (t,) = tasks
    assert t.key == "mine:0:area"
    assert t.prompt == 'def area(r):\n    """The area of a circle of radius r."""'
    assert t.solution.startswith(t.prompt) and t.solution.endswith("return math.pi * x")
    assert t.instruction() in I.INSTRUCTIONS and t.instruction() == I.code_tasks([SOURCE], source="mine")[0].instruction()


def test_a_task_sharing_text_with_an_excluded_set_is_left_out():
    assert I.code_tasks([SOURCE], exclude=["nothing like it at all here"]) != []
    shared = "def area(r):\n    \"\"\"The area of a circle of radius r.\"\"\"\n    x = r * r\n    return math.pi * x"
    assert I.code_tasks([SOURCE], exclude=[shared]) == []


def _chat_tokenizer():
    words = "def area ( r ) : The of a circle radius r. x = * return math.pi ```python ``` Complete".split()
    tok = word_tokenizer(words, extra=["<|im_start|>", "<|im_end|>", "user", "assistant"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_render_puts_the_answer_after_the_generation_prompt_and_closes_the_turn():
    tok = _chat_tokenizer()
    (task,) = I.code_tasks([SOURCE])
    prompt, answer = I.render(tok, task, "``` x = r ```")
    assert tok.decode(prompt).endswith("assistant")
    assert answer[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(answer[:-1]) == "``` x = r ```"
    with pytest.raises(TcalError, match="chat template"):
        I.prompt_text(word_tokenizer(["a"]), task)


def test_pack_keeps_samples_whole_and_marks_the_positions_that_predict_an_answer():
    samples = [([1, 2, 3], [4, 5]), ([6, 7], [8]), ([9] * 9, [10] * 3), ([11], [12, 13])]
    ids, mask = I.pack(samples, seq_len=8, pad_id=0)
    # first fit in order: [1 2 3 4 5 6 7 8], [11 12 13 pad...]; the 12-token sample does not fit and is left out
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 0, 0, 0, 0, 0]]
    # position t is marked when token t + 1 is an answer token of the same sample
    assert mask.tolist() == [[False, False, True, True, False, False, True, False],
                             [True, True, False, False, False, False, False, False]]
    for r in range(ids.shape[0]):
        for t in range(7):
            if mask[r, t]:
                assert int(ids[r, t + 1]) in (4, 5, 8, 12, 13)
    with pytest.raises(TcalError, match="no sample fits"):
        I.pack([([1] * 5, [2] * 5)], seq_len=8, pad_id=0)


def test_an_instruct_set_round_trips_and_a_damaged_one_is_named(tmp_path):
    ids, mask = I.pack([([1, 2], [3, 4])] * 3, seq_len=4, pad_id=0)
    I.save_instruct_set(tmp_path, ids, mask, {"answers": "reference"})
    assert I.is_instruct_set(tmp_path) and not I.is_instruct_set(tmp_path / "nothing")
    got_ids, got_mask, manifest = I.load_instruct_set(tmp_path)
    assert np.array_equal(got_ids, ids.numpy()) and np.array_equal(got_mask, mask.numpy())
    assert manifest["seq_len"] == 4 and manifest["loss_tokens"] == int(mask.sum()) and manifest["answers"] == "reference"
    np.save(tmp_path / "mask.npy", np.zeros((2, 4), dtype=bool))
    with pytest.raises(TcalError, match="do not match"):
        I.load_instruct_set(tmp_path)


def test_the_answer_mask_reaches_the_loss_as_the_rows_it_keeps():
    from tcal.modules.distill_loss import chunked_distill_loss

    torch.manual_seed(0)
    hs, ht = torch.randn(10, 6), torch.randn(10, 6)
    head_s, head_t = torch.nn.Linear(6, 11), torch.nn.Linear(6, 11)
    keep = torch.tensor([True, False] * 5)
    _, kl_masked, _ = chunked_distill_loss(hs, head_s, ht, head_t, row_mask=keep, chunk_rows=3)
    _, kl_rows, _ = chunked_distill_loss(hs[keep], head_s, ht[keep], head_t, chunk_rows=3)
    assert kl_masked == pytest.approx(kl_rows, rel=1e-6)
    with pytest.raises(TcalError, match="selects no rows"):
        chunked_distill_loss(hs, head_s, ht, head_t, row_mask=torch.zeros(10, dtype=torch.bool))


def _rows(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SAMPLE = {"key": "src:0:f", "split": "train", "prompt": "<|im_start|>user\nf<|im_end|>\n", "answer": "```x```"}


def test_samples_that_repeat_a_task_are_read_once_with_a_note(tmp_path):
    """Before: an earlier tcal's set with a repeated task ("record 219 repeats the task 'code:calib:485:multiply'")
    was refused, so tcal could not read its own published instruct sets."""
    from tcal.data.instruct import read_samples

    g = dict(SAMPLE, key="src:0:g", answer="```g```")
    notes = []
    rows = read_samples(_rows(tmp_path / "dup.jsonl", [SAMPLE, g, dict(SAMPLE, answer="```y```"), g]), notes)
    assert [(r["key"], r["answer"]) for r in rows] == [("src:0:f", "```x```"), ("src:0:g", "```g```")]
    assert notes == ["dup.jsonl: 2 record(s) repeat a task of another record (the first: record 3, task 'src:0:f', "
                     "as record 1); each task is read once"]
    # a task in both splits is kept as a development task only: no step trains on it
    notes = []
    rows = read_samples(_rows(tmp_path / "split.jsonl", [SAMPLE, g, dict(SAMPLE, split="dev")]), notes)
    assert [(r["key"], r["split"]) for r in rows] == [("src:0:g", "train"), ("src:0:f", "dev")]
    assert "(1 in both splits: kept as development tasks only)" in notes[0] and "the first: record 1" in notes[0]
    assert len(read_samples(_rows(tmp_path / "ok.jsonl", [SAMPLE, dict(g, split="dev")]))) == 2


def test_samples_without_an_answer_are_refused(tmp_path):
    """Before: empty answers were packed without a word."""
    from tcal.data.instruct import read_samples

    for rows, message in (([dict(SAMPLE, answer=" ")], "record 1 (src:0:f) has an empty answer"),
                          ([dict(SAMPLE, prompt="")], "record 1 (src:0:f) has an empty prompt")):
        with pytest.raises(TcalError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_samples(_rows(tmp_path / "bad.jsonl", rows))
    with pytest.raises(TcalError, match="is a directory"):
        read_samples(tmp_path)


def test_a_truncated_xz_samples_file_is_one_error(tmp_path):
    """Before: an EOFError traceback."""
    import lzma

    from tcal.data.instruct import read_samples

    whole = lzma.compress(_rows(tmp_path / "s.jsonl", [dict(SAMPLE, key=f"src:{i}:f") for i in range(200)]).read_bytes())
    (tmp_path / "cut.jsonl.xz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TcalError, match=r"cut.jsonl.xz is not a readable samples.jsonl of `tcal instruct` \(it ends "
                                        r"early: truncated\)"):
        read_samples(tmp_path / "cut.jsonl.xz")
