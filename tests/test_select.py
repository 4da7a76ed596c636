"""Layer selection policies."""
import math

import pytest
import torch

from tcal.errors import TcalError
from tcal.select import ar_scores, ga_scores, gdn_for_every_layer, parse_policy, top_k, uniform_layers

from conftest import tiny_teacher


def test_parse_policy_forms():
    assert parse_policy("0,4,8", 30).layers == [0, 4, 8]
    assert parse_policy([3, 1], 30).layers == [3, 1]
    p = parse_policy("uniform:8", 30)
    assert (p.kind, p.k) == ("uniform", 8)
    assert parse_policy("ar:25%", 32).k == 8
    assert parse_policy("ga:50%", 30).k == 15


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
