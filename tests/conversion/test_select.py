"""Keep policies (tcal.conversion.policy) and layer selection by scores (tcal.conversion.select)."""
import math
import re

import numpy as np
import pytest
import torch
from helpers import tiny_teacher

from tcal.conversion.policy import POLICIES, Policy, layer_index, parse_keep, parse_policy, top_k, uniform_layers
from tcal.conversion.select import (
    Selection,
    SelectionConfig,
    ar_scores,
    ga_scores,
    gdn_for_every_layer,
    select_layers,
    student_of,
)
from tcal.utils.errors import TcalError


def test_parse_policy_forms():
    assert parse_policy("0,4,8", 30).layers == [0, 4, 8]
    assert parse_policy([3, 1], 30).layers == [3, 1]
    p = parse_policy("uniform:8", 30)
    assert (p.kind, p.k) == ("uniform", 8)
    assert parse_policy("ar:25%", 32).k == 8
    assert parse_policy("ga:50%", 30).k == 15
    assert parse_policy([np.int64(2), np.int64(0)], 30).layers == [2, 0]  # numpy / torch integers are integers
    assert parse_policy([torch.tensor(1)], 30).layers == [1]
    assert POLICIES == ("uniform", "interval", "ar", "ga", "niah", "answer")
    assert parse_policy("niah:4", 30).kind == "niah"
    assert parse_policy("answer:50%", 24).k == 12


def test_parse_keep_and_integer_layer_indices():
    assert parse_keep("0, 4,8") == [0, 4, 8]
    assert parse_keep("-1") == [-1]  # range is checked later, with the teacher's layer count
    assert parse_keep("uniform:8") == "uniform:8"
    assert layer_index(np.int64(3)) == 3
    for bad in (0.5, "4", True, 4.0):
        with pytest.raises(TcalError, match="integer layer indices"):
            layer_index(bad)
    with pytest.raises(TcalError, match="integer layer indices, got 0.5"):
        parse_policy([0.5, 4], 30)


@pytest.mark.parametrize("spec, msg", [
    ("uniform:30", "keeps 30 of 30 layers: nothing would be converted"),
    ("uniform:40", "keeps 40 of 30 layers"),
    ("ar:0", "keeps 0 layers; keep at least 1"),
    ("ga:0%", "keeps 0 layers"),
    ("best:4", "unknown keep policy 'best:4'"),
    ("uniform", "unknown keep policy"),
    ("ar:x", "K must be a whole number or a percentage"),
])
def test_bad_policies(spec, msg):
    with pytest.raises(TcalError, match=msg):
        parse_policy(spec, 30)


@pytest.mark.parametrize("spec", ["uniform:150%", "ar:100%", "ga:100.0%"])
@pytest.mark.parametrize("num_layers", [None, 30, 1 << 30])
def test_a_percentage_of_100_or_more_is_refused_as_a_percentage(spec, num_layers):
    count = spec.partition(":")[2]
    with pytest.raises(TcalError) as e:
        parse_policy(spec, num_layers)
    assert str(e.value) == (f"keep policy {spec!r} asks for {count} of the layers; a percentage must be below "
                            f"100% (100% converts nothing), e.g. {spec.partition(':')[0]}:25%")


def test_without_a_layer_count_only_what_needs_no_model_is_checked():
    assert parse_policy("uniform:2000000000", None) == Policy("uniform", 2000000000)  # the teacher decides later
    assert parse_policy("ar:99%", None).kind == "ar"
    for spec, msg in (("uniform:0", "keeps 0 layers"), ("ga:0%", "keeps 0% of the layers; keep at least 1"),
                      ("ar:inf%", "K must be a whole number or a percentage, got 'inf%'"),
                      ("ar:-inf%", "K must be a whole number"), ("ar:nan%", "K must be a whole number")):
        with pytest.raises(TcalError, match=re.escape(msg)):
            parse_policy(spec, None)
    with pytest.raises(TcalError, match="K must be a whole number"):
        parse_policy("uniform:-inf%", 30)


def test_uniform_spacing():
    assert uniform_layers(15, 30) == list(range(0, 30, 2))
    assert uniform_layers(8, 32) == list(range(0, 32, 4))
    assert uniform_layers(8, 30)[0] == 0 and len(uniform_layers(8, 30)) == 8
    assert uniform_layers(1, 30) == [0]


def test_top_k_direction_and_ties():
    scores = [5.0, 9.0, 1.0, 9.0, 3.0]
    assert top_k(scores, 2, largest=True) == [1, 3]
    assert top_k(scores, 2, largest=False) == [2, 4]


def _ppl(model, windows):
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    return math.exp(nll.item())


def test_ar_scores_zero_exactly_one_layer():
    teacher = tiny_teacher("llama")
    windows = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
    scores = ar_scores(teacher, windows, progress=False)
    assert len(scores) == 4
    # Recompute layer 2's score by hand with a hook that zeroes it.
    h = teacher.model.layers[2].self_attn.register_forward_hook(lambda m, a, o: (torch.zeros_like(o[0]), o[1]))
    expect = _ppl(teacher, windows)
    h.remove()
    assert scores[2] == pytest.approx(expect, rel=1e-5)
    # and the teacher is restored afterwards
    assert _ppl(teacher, windows) != pytest.approx(expect, rel=1e-9)


def test_ga_with_original_attention_modules_scores_the_teacher():
    teacher = tiny_teacher("llama")
    windows = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    base = _ppl(teacher, windows)
    originals = {i: layer.self_attn for i, layer in enumerate(teacher.model.layers)}
    assert ga_scores(teacher, windows, originals, progress=False) == pytest.approx([base] * 4, rel=1e-5)


def test_ga_students_use_one_attention_layer_each():
    teacher = tiny_teacher("llama")
    windows = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    modules = gdn_for_every_layer(teacher, "zero-gate")
    scores = ga_scores(teacher, windows, modules, progress=False)
    # zero-gate GDN layers are silent: student i == teacher with every attention but i removed
    for i in (0, 3):
        hooks = [teacher.model.layers[j].self_attn.register_forward_hook(
            lambda m, a, o: (torch.zeros_like(o[0]), o[1])) for j in range(4) if j != i]
        expect = _ppl(teacher, windows)
        for h in hooks:
            h.remove()
        assert scores[i] == pytest.approx(expect, rel=1e-4)
    assert all(type(layer.self_attn).__name__ == "LlamaAttention" for layer in teacher.model.layers)


def test_assemble_swaps_and_restores_even_on_error():
    teacher = tiny_teacher("llama")
    originals = [layer.self_attn for layer in teacher.model.layers]
    modules = gdn_for_every_layer(teacher, "copy")
    assert sorted(modules) == [0, 1, 2, 3] and all(m.layer_idx == i for i, m in modules.items())
    with pytest.raises(RuntimeError), student_of(teacher, [1], modules) as student:
        assert [type(layer.self_attn).__name__ for layer in student.model.layers] == [
            "GatedDeltaNet", "LlamaAttention", "GatedDeltaNet", "GatedDeltaNet"]
        raise RuntimeError("boom")
    assert all(layer.self_attn is a for layer, a in zip(teacher.model.layers, originals))


def test_select_layers_lists_and_uniform_need_no_text():
    teacher = tiny_teacher("llama")
    assert select_layers(teacher, [2, 0]) == Selection("list", [0, 2])
    assert select_layers(teacher, "uniform:2") == Selection("uniform:2", [0, 2])
    with pytest.raises(TcalError, match="pass the teacher's tokenizer"):
        select_layers(teacher, "ar:2")


def test_a_scoped_policy_converts_only_layers_of_its_type():
    # 8 layers, global at 3 and 7: @sliding picks among 0-2, 4-6 and keeps both global ones
    teacher = tiny_teacher("gemma3", num_hidden_layers=8)
    sel = select_layers(teacher, "uniform:50%@sliding")
    assert sel.policy == "uniform:3@sliding" and sel.layers == [0, 2, 3, 5, 7]
    assert select_layers(teacher, "uniform:1@full").layers == [0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(TcalError, match="keeps 6 of 6 sliding_attention layers"):
        select_layers(teacher, "uniform:6@sliding")
    with pytest.raises(TcalError, match="no sliding_attention layers"):
        select_layers(tiny_teacher("llama"), "uniform:1@sliding")


def test_auto_keeps_half_and_every_global_layer_where_there_are_some():
    from tcal.conversion.policy import auto_policy, resolve_auto

    assert auto_policy(None) == auto_policy(["full_attention"] * 4) == "uniform:50%"
    assert auto_policy(["sliding_attention"] * 4) == "uniform:50%"  # no global layer to spare
    assert auto_policy(["sliding_attention"] * 3 + ["full_attention"]) == "uniform:50%@sliding"
    assert resolve_auto(" auto ", None) == "uniform:50%" and resolve_auto("uniform:2", None) == "uniform:2"
    assert resolve_auto([0, 2], None) == [0, 2]
    # the same layers as the policy it stands for, on either kind of teacher
    gemma, llama = tiny_teacher("gemma3", num_hidden_layers=8), tiny_teacher("llama", num_hidden_layers=6)
    assert select_layers(gemma, "auto") == select_layers(gemma, "uniform:50%@sliding")
    assert select_layers(gemma, "auto").layers == [0, 2, 3, 5, 7]
    assert select_layers(llama, "auto") == select_layers(llama, "uniform:50%") == Selection("uniform:3", [0, 2, 4])
    # commands check the syntax before the teacher loads; a resolved count needs the teacher's layer types
    assert parse_policy("auto", None).kind == "uniform"
    with pytest.raises(TcalError, match="resolve_auto"):
        parse_policy("auto", 8)


def test_the_commands_default_to_auto():
    from tcal.recipes.ablate import AblateConfig
    from tcal.recipes.convert import ConvertConfig

    assert ConvertConfig().keep == AblateConfig().keep == "auto"
    # on SmolLM2's 30 layers auto is the list convert had as its default, so its results are unchanged
    assert select_layers(tiny_teacher("llama", num_hidden_layers=30), "auto").layers == list(range(0, 30, 2))


def test_converting_every_global_layer_warns():
    from tcal.conversion.convert import convert_with_record
    from tcal.conversion.policy import global_layers_note

    types = ["sliding_attention"] * 3 + ["full_attention"]
    assert global_layers_note(types, [0, 2]) and global_layers_note(types, [1, 3]) is None
    assert global_layers_note(["full_attention"] * 4, [0]) is None and global_layers_note(None, [0]) is None
    with pytest.warns(UserWarning, match="converts every global-attention layer"):
        conv = convert_with_record(tiny_teacher("gemma3", num_hidden_layers=4), [0, 1])
    assert "every global-attention layer" in conv.record["warnings"][0]


@pytest.mark.parametrize("spec, msg", [("uniform:2@middle", "use @sliding or @full"),
                                       ("0,4@sliding", "explicit layer list takes no @ scope")])
def test_bad_scopes(spec, msg):
    with pytest.raises(TcalError, match=msg):
        parse_policy(spec, None)


def test_scored_policies_pick_among_the_scope(tmp_path):
    from helpers import word_tokenizer

    words = "the cat sat on a mat dog ran far away".split()
    tok = word_tokenizer(words)
    teacher = tiny_teacher("gemma3", vocab_size=len(tok), num_hidden_layers=8)
    rng = np.random.default_rng(0)
    (tmp_path / "calib.txt").write_text(" ".join(rng.choice(words, 400)))
    cfg = SelectionConfig(data=str(tmp_path / "calib.txt"), window=16, val_windows=2, skip_windows=3,
                          cache_dir=str(tmp_path / "cache"))
    sel = select_layers(teacher, "ar:2@sliding", tokenizer=tok, cfg=cfg, progress=False)
    sliding = [0, 1, 2, 4, 5, 6]
    best = sorted(sorted(sliding, key=lambda i: -sel.scores[i])[:2])
    assert len(sel.scores) == 8 and sel.layers == sorted(best + [3, 7])


def test_ar_selection_scores_once_then_reads_the_cache(tmp_path):
    from helpers import word_tokenizer

    words = "the cat sat on a mat dog ran far away".split()
    tok = word_tokenizer(words)
    teacher = tiny_teacher("llama", vocab_size=len(tok))
    rng = np.random.default_rng(0)
    (tmp_path / "calib.txt").write_text(" ".join(rng.choice(words, 400)))
    cfg = SelectionConfig(data=str(tmp_path / "calib.txt"), window=16, val_windows=2, skip_windows=3,
                          cache_dir=str(tmp_path / "cache"))
    first = select_layers(teacher, "ar:2", tokenizer=tok, cfg=cfg, progress=False)
    assert not first.cached and len(first.scores) == 4 and first.score_name == "ppl_with_layer_attention_removed"
    assert first.layers == top_k(first.scores, 2, largest=True) and first.policy == "ar:2"
    again = select_layers(teacher, "ar:2", tokenizer=tok, cfg=cfg, progress=False)
    assert again.cached and again.scores == first.scores and again.layers == first.layers


def test_validation_slice_of_a_mixture_skips_the_calibration_side_of_each_part(tmp_path):
    # tcal convert --keep ar:K scores on a slice of --calib, which may be a mixture "a+b" (the default is one)
    from helpers import word_tokenizer

    from tcal.conversion.select import validation_windows
    from tcal.data.tokens import mixed_windows

    words = "the cat sat on a mat dog ran far away".split()
    tok = word_tokenizer(words)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(words[:5] * 40))
    b.write_text(" ".join(words[5:] * 40))
    cfg = SelectionConfig(data=f"{a}+{b}", window=4, val_windows=4, skip_windows=4)
    val = validation_windows(tok, cfg)
    assert torch.equal(val, mixed_windows(f"{a}+{b}", tok, window=4, n_windows=8)[4:])
    part = {int(w[1]) in tok.convert_tokens_to_ids(words[:5]) for w in val}
    assert part == {True, False}  # both corpora in the slice


def test_niah_selection_scores_answer_nll_with_each_layer_removed(tmp_path):
    from helpers import word_tokenizer

    from tcal.conversion.select import answer_prompts, niah_scores
    from tcal.evaluate.tasks.niah.ruler import NEEDLE, make_samples

    text = "The committee met in the spring. It discussed the harbor and the roads. Work began in summer. " * 30
    tok = word_tokenizer(text.replace(".", " .").split() + NEEDLE.split())
    teacher = tiny_teacher("llama", vocab_size=len(tok), max_position_embeddings=512)
    (tmp_path / "hay.txt").write_text(text)
    cfg = SelectionConfig(niah_length=96, niah_samples=2, niah_haystack=str(tmp_path / "hay.txt"),
                          cache_dir=str(tmp_path / "cache"))
    sel = select_layers(teacher, "niah:2", tokenizer=tok, cfg=cfg, progress=False)
    assert sel.policy == "niah:2" and sel.score_name == "answer_nll_with_layer_attention_removed"
    assert len(sel.scores) == 4 and all(math.isfinite(s) for s in sel.scores)
    assert sel.layers == top_k(sel.scores, 2, largest=True)  # the layers whose removal costs most stay
    assert sel.scores == niah_scores(teacher, tok, cfg, progress=False)
    assert select_layers(teacher, "niah:2", tokenizer=tok, cfg=cfg, progress=False).cached
    # the scored prompts are the selection's own (seed 1), not the evaluation's (seed 0), and end in the answer
    ((ids, n), _) = answer_prompts(tok, cfg)
    evaluation = make_samples("single", tok, 96, 2, seed=0, documents=[text], max_new_tokens=12)
    assert tok.decode(ids[0, :-n]) != tok.decode(tok(evaluation[0].prompt)["input_ids"])
    assert n >= 2 and ids.shape[1] <= 96 + n
    # the default length (2,048) on a teacher of 128 positions: scored on prompts that fit, said in the protocol
    from tcal.conversion.select import NIAH_ANSWER_ROOM

    short = tiny_teacher("llama", vocab_size=len(tok), max_position_embeddings=128)
    wide = SelectionConfig(niah_samples=2, niah_haystack=str(tmp_path / "hay.txt"), cache_dir=str(tmp_path / "c2"))
    got = select_layers(short, "niah:2", tokenizer=tok, cfg=wide, progress=False)
    assert got.protocol["niah"][0] == 128 - NIAH_ANSWER_ROOM and all(math.isfinite(x) for x in got.scores)


def test_ga_modules_take_the_layer_local_part_of_a_kl_init(monkeypatch):
    """ga assembles students from per-layer modules, so an init with a whole-model KL stage (taylor) must
    contribute its layer-local stages only: the modules would otherwise be tuned for two other layouts."""
    import tcal.conversion.select as select

    seen = []

    def fake_initialise(hybrid, teacher, spec, calib, **kw):
        seen.append(spec)
        return {}

    monkeypatch.setattr(select, "initialise", fake_initialise)
    gdn_for_every_layer(tiny_teacher("llama"), "taylor", torch.zeros(2, 8, dtype=torch.long))
    assert len(seen) == 2 and all(not s.kl and s.align == "local" and s.phase2 for s in seen)
    assert seen[0].name == "taylor"


CODE = """
def area(r):
    \"\"\"The area of a circle.\"\"\"
    x = r * r
    return x * 3


def total(a, b):
    \"\"\"The sum of a and b.\"\"\"
    c = a + b
    return c
"""


def test_answer_selection_scores_the_answers_with_each_attention_layer_removed(tmp_path):
    from helpers import word_tokenizer

    from tcal.conversion.select import answer_nll, answer_windows

    words = ("def area ( r ) : The of a circle . x = * return 3 total b sum and c + \"\"\" ``` "
             "Complete Write Implement Here").split()
    tok = word_tokenizer(words, extra=["<|im_start|>", "<|im_end|>", "user", "assistant"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    teacher = tiny_teacher("llama", vocab_size=len(tok))
    cfg = SelectionConfig(answer_data="text:" + CODE, answer_tasks=2, answer_window=128,
                          cache_dir=str(tmp_path / "cache"))
    ids, mask = answer_windows(tok, cfg)
    assert ids.shape[1] == 128 and 0 < int(mask.sum()) < ids.numel()
    sel = select_layers(teacher, "answer:2", tokenizer=tok, cfg=cfg, progress=False)
    assert sel.score_name == "code_answer_nll_with_layer_attention_removed" and len(sel.scores) == 4
    assert sel.layers == top_k(sel.scores, 2, largest=True)
    # each score is the answer NLL of the teacher with that one layer's attention output zeroed
    base = answer_nll(teacher, ids, mask)
    with student_of(teacher, [0, 2, 3], {1: _Zero()}):
        assert answer_nll(teacher, ids, mask) == pytest.approx(sel.scores[1], rel=1e-5)
    assert base not in sel.scores
    assert select_layers(teacher, "answer:2", tokenizer=tok, cfg=cfg, progress=False).cached
    with pytest.raises(TcalError, match="no chat template"):
        select_layers(teacher, "answer:2", tokenizer=word_tokenizer(words), cfg=cfg, progress=False)


class _Zero(torch.nn.Module):
    """An attention module whose output is zero (what removal_scores' hook makes of a layer)."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None
