"""The Qwen3.5 layout: a hybrid built for it maps onto transformers' own Qwen3_5ForCausalLM exactly, for every
teacher family, and the export refuses what the layout cannot hold."""
import pytest
import torch
from helpers import assert_close, target_hybrid, tiny_keep, tiny_teacher
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import tcal
from tcal.conversion.target import LAYOUT_EPS
from tcal.export.qwen3_5 import LINEAR_NORM_ERROR, blocker, linear_norm_scale, to_qwen3_5
from tcal.utils.errors import TcalError

KEEP = [0, 2]


def ids(B=2, T=40, seed=1, vocab=97):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def as_qwen3_5(hybrid) -> Qwen3_5ForCausalLM:
    layout = to_qwen3_5(hybrid)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**layout.config)).eval()
    missing, unexpected = model.load_state_dict(layout.state_dict, strict=False)
    assert not unexpected and missing in ([], ["lm_head.weight"]), (missing, unexpected)
    model.generation_config.eos_token_id = None  # as target_hybrid's: greedy runs compare all their tokens
    return model


def test_target_hybrid_has_only_what_the_layout_holds(family):
    hybrid, teacher = target_hybrid(family)
    assert hybrid.config.target == "qwen3_5"
    assert hybrid.config.rms_norm_eps == LAYOUT_EPS and hybrid.config.teacher_config().rms_norm_eps == LAYOUT_EPS
    for gdn in hybrid.gdn_modules().values():
        assert all(getattr(gdn, n).bias is None for n in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj"))
        assert not hasattr(gdn, "q_norm") and gdn.o_norm.eps == LAYOUT_EPS
    assert blocker(hybrid) is None
    for i in tiny_keep(family):  # kept layers are the teacher's, weights untouched
        for k, v in teacher.model.layers[i].state_dict().items():
            assert torch.equal(hybrid.model.layers[i].state_dict()[k], v), k


def test_layout_logits_equal_the_hybrids(family, short_conv):
    hybrid, _ = target_hybrid(family, short_conv=short_conv)
    model = as_qwen3_5(hybrid)
    x = ids()
    with torch.no_grad():
        assert_close(model(input_ids=x).logits, hybrid(input_ids=x).logits, 1e-5, f"{family} logits")


def test_greedy_tokens_and_left_padding(family):
    hybrid, _ = target_hybrid(family, short_conv=True)
    model = as_qwen3_5(hybrid)
    prompt = ids(B=1, T=12, seed=3)
    with torch.no_grad():
        want = hybrid.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
        got = model.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    # a batch with a left-padded row: each row equals its unpadded run
    short, long = ids(B=1, T=9, seed=4), ids(B=1, T=16, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :7] = 0
    with torch.no_grad():
        padded = model(input_ids=batch, attention_mask=mask).logits
        assert_close(padded[0, 7:], model(input_ids=short).logits[0], 1e-5, "left-padded row")
        assert_close(padded[1], model(input_ids=long).logits[0], 1e-5, "unpadded row")


def test_linear_norm_scale_bounds_the_error_for_any_input():
    """a keeps the norm linear to LINEAR_NORM_ERROR for the largest q any layer input can make (an input of norm
    sqrt(D) max|w_in| along a head's top singular vector, its bias aligned), and 2a would not."""
    gen = torch.Generator().manual_seed(0)
    D, H, d, eps = 32, 4, 16, 1e-6
    weight, bias = torch.randn(H * d, D, generator=gen), torch.randn(H * d, generator=gen)
    in_norm = 1 + torch.rand(D, generator=gen)
    a = linear_norm_scale(weight, bias, in_norm, heads=H, eps=eps)
    assert a == 2.0 ** round(torch.log2(torch.tensor(a)).item())
    r = D**0.5 * float(in_norm.max())
    worst = 0.0
    for h in range(H):
        w, b = weight[h * d:(h + 1) * d].double(), bias[h * d:(h + 1) * d].double()
        u, s, vt = torch.linalg.svd(w)
        x = r * vt[0] * torch.sign(u[:, 0] @ b)  # W x = r s_0 u_0, turned to add to the bias
        worst = max(worst, float((w @ x + b).pow(2).mean()))
    assert 1 - (1 + a * a * worst / eps) ** -0.5 <= LINEAR_NORM_ERROR
    bound = max(float((torch.linalg.matrix_norm(weight[h * d:(h + 1) * d].double(), ord=2) * r
                       + bias[h * d:(h + 1) * d].double().norm()) ** 2) / d for h in range(H))
    assert 1 - (1 + 4 * a * a * bound / eps) ** -0.5 > LINEAR_NORM_ERROR


def test_native_hybrid_with_a_write_gate_bias_is_refused(tmp_path):
    teacher = tiny_teacher("llama")
    hybrid = tcal.convert(teacher, keep=KEEP, init="copy", target="native")
    assert blocker(hybrid) is None  # copy leaves b_proj's bias at zero: the layout holds that exactly
    with torch.no_grad():
        hybrid.model.layers[1].self_attn.b_proj.bias.fill_(0.5)
    assert blocker(hybrid).startswith("model.layers.1.self_attn.b_proj.bias")
    with pytest.raises(TcalError, match="model.layers.1.self_attn.b_proj.bias.*--target qwen3_5"):
        to_qwen3_5(hybrid)
    qwen3 = tcal.convert(tiny_teacher("qwen3"), keep=KEEP, init="copy", target="native")  # q/k norm in the GDN
    assert blocker(qwen3).startswith("model.layers.1.self_attn.q_norm.weight")


def test_target_refuses_what_the_layout_cannot_express():
    with pytest.raises(TcalError, match="activation is 'gelu'"):
        tcal.convert(tiny_teacher("llama", hidden_act="gelu"), keep=KEEP, target="qwen3_5")
    with pytest.raises(TcalError, match="sliding window"):
        tcal.convert(tiny_teacher("mistral", sliding_window=64), keep=KEEP, target="qwen3_5")
    with pytest.raises(TcalError, match="output_gate=False does not fit --target qwen3_5"):
        tcal.convert(tiny_teacher("llama"), keep=KEEP, target="qwen3_5", output_gate=False)
    with pytest.raises(TcalError, match="unknown target"):
        tcal.convert(tiny_teacher("llama"), keep=KEEP, target="qwen4")
