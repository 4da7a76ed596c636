"""Conversion surgery, cache equivalence, generation and checkpoints on tiny random teachers."""
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import tcal
from tcal import compat
from tcal.errors import TcalError
from tcal.hybrid import repeat_kv_rows

from conftest import tiny_teacher

KEEP = [0, 2]


def ids(B=2, T=21, seed=1):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_kept_layers_and_shared_weights_bit_identical(family):
    teacher = tiny_teacher(family)
    hybrid = tcal.convert(teacher, keep=KEEP, init="copy")
    t_state, h_state = teacher.state_dict(), hybrid.state_dict()
    converted = tuple(f"model.layers.{i}.self_attn." for i in (1, 3))
    shared = [k for k in t_state if not k.startswith(converted)]
    assert len(shared) > 10
    for key in shared:
        assert torch.equal(t_state[key], h_state[key]), key
    assert hybrid.config.layer_types == ["full_attention", "linear_attention", "full_attention", "linear_attention"]


def test_copy_init_repeats_kv_rows_and_carries_bias_and_norm(family):
    teacher = tiny_teacher(family)
    hybrid = tcal.convert(teacher, keep=KEEP, init="copy")
    attn, gdn = teacher.model.layers[1].self_attn, hybrid.model.layers[1].self_attn
    assert torch.equal(gdn.q_proj.weight, attn.q_proj.weight)
    assert torch.equal(gdn.o_proj.weight, attn.o_proj.weight)
    # Query head h reads KV head h // group (HF repeat_kv order): heads 0,1 <- kv 0; 2,3 <- kv 1.
    d = 16
    for h in range(4):
        kv = h // 2
        assert torch.equal(gdn.k_proj.weight[h * d:(h + 1) * d], attn.k_proj.weight[kv * d:(kv + 1) * d])
        assert torch.equal(gdn.v_proj.weight[h * d:(h + 1) * d], attn.v_proj.weight[kv * d:(kv + 1) * d])
    if family == "qwen2":
        assert torch.equal(gdn.q_proj.bias, attn.q_proj.bias)
        assert torch.equal(gdn.k_proj.bias, repeat_kv_rows(attn.k_proj.bias, 2, 4))
    else:
        assert gdn.q_proj.bias is None
    if family == "qwen3":
        assert torch.equal(gdn.q_norm.weight, attn.q_norm.weight)
        assert torch.equal(gdn.k_norm.weight, attn.k_norm.weight)
    else:
        assert not hasattr(gdn, "q_norm")


def test_zero_gate_equals_teacher_with_converted_attention_removed():
    teacher = tiny_teacher("llama")
    hybrid = tcal.convert(teacher, keep=KEEP, init="zero-gate")
    x = ids()
    for i in (1, 3):  # teacher with those layers' attention output zeroed
        teacher.model.layers[i].self_attn.register_forward_hook(lambda m, a, out: (torch.zeros_like(out[0]), out[1]))
    with torch.no_grad():
        torch.testing.assert_close(hybrid(x).logits, teacher(x).logits, rtol=1e-5, atol=1e-5)


def test_prefill_then_decode_equals_full_forward(family):
    hybrid = tcal.convert(tiny_teacher(family), keep=KEEP, init="copy", use_short_conv=True)
    with torch.no_grad():  # random conv taps, so the cached conv window matters
        for name, p in hybrid.named_parameters():
            if "conv1d" in name:
                p.normal_(0, 0.5)
    x = ids(T=19)
    with torch.no_grad():
        full = hybrid(x, use_cache=False).logits
        out = hybrid(x[:, :11], use_cache=True)
        cache = getattr(out, compat.CACHE_KWARG)
        steps = [out.logits]
        for t in range(11, 19):
            out = hybrid(x[:, t:t + 1], use_cache=True, **{compat.CACHE_KWARG: cache})
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_greedy_generation_with_and_without_cache(family):
    hybrid = tcal.convert(tiny_teacher(family), keep=[1], init="copy")
    x = ids(B=1, T=6)
    with torch.no_grad():
        a = hybrid.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
        b = hybrid.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                            use_cache=False)
    assert a.shape[1] == 18
    assert torch.equal(a, b)


def test_left_padded_batch_matches_single_sequences():
    hybrid = tcal.convert(tiny_teacher("llama"), keep=KEEP, init="copy", use_short_conv=True)
    x = ids(B=2, T=16)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        batch = hybrid(x, attention_mask=mask, position_ids=pos).logits
        single = hybrid(x[1:, 5:]).logits
    torch.testing.assert_close(batch[1, 5:], single[0], rtol=1e-4, atol=1e-4)


def test_padding_reaches_gdn_layers_only_when_something_is_padded():
    # An all-ones mask (what generate() passes) must not reach the GDN layers: checking it there cost
    # a GPU->host sync per layer per token.
    hybrid = tcal.convert(tiny_teacher("llama"), keep=KEEP, init="copy")
    gdn = next(m for m in hybrid.modules() if isinstance(m, tcal.gdn.GatedDeltaNet))
    seen = []
    gdn.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs.get("tcal_keep")), with_kwargs=True)
    x = ids(B=2, T=8)
    mask = torch.ones_like(x)
    with torch.no_grad():
        hybrid.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert seen and all(k is None for k in seen)
        mask[1, :3] = 0
        seen.clear()
        hybrid(x, attention_mask=mask)
    assert torch.equal(seen[0], mask.float())


def test_save_load_roundtrip_bit_exact(tmp_path, family):
    hybrid = tcal.convert(tiny_teacher(family), keep=KEEP, init="copy", use_short_conv=True)
    hybrid.save_pretrained(tmp_path / "h")
    files = sorted(os.listdir(tmp_path / "h"))
    assert "model.safetensors" in files and "config.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".pth"))]
    assert AutoConfig.from_pretrained(tmp_path / "h").model_type == "tcal_hybrid"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h")
    assert type(reloaded) is tcal.HybridForCausalLM
    x = ids()
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(x).logits, hybrid.eval()(x).logits)


def test_failed_save_leaves_no_directory(tmp_path, monkeypatch):
    hybrid = tcal.convert(tiny_teacher("llama"), keep=KEEP, init="copy")
    from transformers import PreTrainedModel

    def boom(self, path, *a, **k):
        (path / "partial.safetensors").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", boom)
    with pytest.raises(OSError):
        hybrid.save_pretrained(tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_backends_agree_inside_the_model():
    teacher = tiny_teacher("llama")
    a = tcal.convert(teacher, keep=KEEP, init="copy", backend="naive")
    b = tcal.convert(teacher, keep=KEEP, init="copy", backend="chunk")
    x = ids(T=70)
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "keep, message",
    [
        ([0, 9], "keep index 9 out of range: the teacher has 4 layers"),
        ([-1], "keep index -1 out of range"),
        ([1, 1], "keep lists layer 1 more than once"),
        ([], "keep is empty"),
        ([0, 1, 2, 3], "nothing would be converted"),
        ("every-other", "unknown keep policy .every-other."),
    ],
)
def test_bad_keep_lists(keep, message):
    with pytest.raises(TcalError, match=message):
        tcal.convert(tiny_teacher("llama"), keep=keep)


def test_unsupported_architecture_names_supported_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TcalError, match=r"unsupported architecture 'gpt2'; tcal converts llama, qwen2, qwen3, mistral"):
        tcal.convert(gpt2, keep=[0])


def test_unknown_init_and_option():
    with pytest.raises(TcalError, match="unknown init 'magic'"):
        tcal.convert(tiny_teacher("llama"), keep=[0], init="magic")
    with pytest.raises(TcalError, match="init 'copy' takes no options; got warp_drive"):
        tcal.convert(tiny_teacher("llama"), keep=[0], warp_drive=True)


def test_converting_a_hybrid_is_refused():
    hybrid = tcal.convert(tiny_teacher("llama"), keep=[0])
    with pytest.raises(TcalError, match="already a tcal hybrid"):
        tcal.convert(hybrid, keep=[0])
