"""Gemma 3 teachers: sliding-window and global layers, q/k norm, four norms a layer, scaled embeddings. A hybrid
of a tiny random Gemma 3 against transformers' own model: conversion, the window of kept sliding layers in the
eager and cached paths, save and reload, and the target it gets."""
import pytest
import torch
from helpers import assert_close, tiny_teacher
from transformers import AutoModelForCausalLM

import tcal
from tcal.conversion.target import resolve_target
from tcal.utils.errors import TcalError

KEEP = [0, 3]  # a sliding layer and the global one stay attention; 1 and 2 (sliding) become GDN


def ids(B=2, T=30, seed=1):  # longer than the 8-token window
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture()
def teacher():
    return tiny_teacher("gemma3")


def test_zero_gate_hybrid_is_the_teacher_without_the_converted_attention(teacher):
    """Kept layers keep their kind: the sliding layer still slides (the sequence is past its window), the
    global one does not, with their own RoPE bases."""
    hybrid = tcal.convert(teacher, keep=KEEP, init="zero-gate")
    assert hybrid.config.layer_types == ["sliding_attention", "linear_attention", "linear_attention",
                                         "full_attention"]
    hooks = [teacher.model.layers[i].self_attn.register_forward_hook(
        lambda mod, args, out: (torch.zeros_like(out[0]), *out[1:])) for i in (1, 2)]
    try:
        with torch.no_grad():
            want = teacher(ids()).logits
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        assert_close(hybrid(ids()).logits, want, 1e-6, "zero-gate hybrid vs teacher without layers 1, 2")


def test_cached_decode_past_the_window_and_reload(teacher, tmp_path):
    hybrid = tcal.convert(teacher, keep=KEEP, init="copy").eval()
    x = ids()
    with torch.no_grad():
        full = hybrid(x).logits
        out = hybrid(x[:, :12], use_cache=True)
        cache, steps = out.past_key_values, []
        for t in range(12, 30):
            out = hybrid(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[:, -1])
    assert_close(torch.stack(steps, 1), full[:, 12:], 1e-5, "cached decode vs full forward")
    hybrid.save_pretrained(tmp_path / "h")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, full)


def test_gdn_layers_take_the_head_dim_and_the_zero_centred_qk_norm(teacher):
    hybrid = tcal.convert(teacher, keep=KEEP, init="copy")
    attn, gdn = teacher.model.layers[1].self_attn, hybrid.model.layers[1].self_attn
    assert gdn.head_dim == teacher.config.head_dim and gdn.shape.qk_norm
    # Gemma's RMSNorm multiplies by 1 + w, a GDN's by w
    assert torch.equal(gdn.q_norm.weight, attn.q_norm.weight + 1) and torch.equal(gdn.k_norm.weight, attn.k_norm.weight + 1)


def test_gemma_converts_to_the_native_layout(teacher):
    assert resolve_target("auto", teacher.config) == "native"
    assert tcal.convert(teacher, keep=KEEP, init="copy").config.target == "native"
    with pytest.raises(TcalError, match="'gemma3_text' model; the Qwen3.5 layout holds llama"):
        tcal.convert(teacher, keep=KEEP, init="copy", target="qwen3_5")


@pytest.mark.parametrize("family, keep", [("gemma3", [0, 3]), ("llama", [1, 3])])
def test_mask_sizes_asked_at_a_linear_layer_come_from_the_first_full_attention_layer(family, keep):
    # transformers up to 5.17 asks the cache about the first non-sliding layer, here a GDN layer (1 or 0)
    from transformers import DynamicCache

    hybrid = tcal.convert(tiny_teacher(family, num_hidden_layers=4), keep=keep, init="copy").eval()
    cache = DynamicCache(config=hybrid.config)
    with torch.no_grad():
        hybrid(input_ids=ids(), past_key_values=cache, use_cache=True)
    linear = next(i for i, t in enumerate(hybrid.config.layer_types) if t == "linear_attention" and i)
    full = hybrid.config.layer_types.index("full_attention")
    assert cache.get_mask_sizes(1, layer_idx=linear) == cache.get_mask_sizes(1, layer_idx=full)
    assert cache.get_seq_length(layer_idx=linear) == cache.get_seq_length(layer_idx=full) == ids().shape[1]
    out = hybrid.generate(ids(), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, hybrid.generate(ids(), max_new_tokens=8, do_sample=False, use_cache=False))
