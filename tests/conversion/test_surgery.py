"""Surgery: teacher + kept layers -> hybrid with every teacher weight in place and copied projections."""
import pytest
import torch
from helpers import tiny_keep, tiny_teacher
from transformers import GPT2Config, GPT2LMHeadModel

import tcal
from tcal import families
from tcal.conversion.surgery import (
    build_hybrid,
    check_keep,
    check_teacher,
    hybrid_config_for,
    repeat_kv_rows,
)
from tcal.utils.errors import TcalError

KEEP = [0, 2]


def test_kept_layers_and_shared_weights_bit_identical(family):
    teacher, keep = tiny_teacher(family), tiny_keep(family)
    hybrid = tcal.convert(teacher, keep=keep, init="copy")
    t_state, h_state = teacher.state_dict(), hybrid.state_dict()
    converted = tuple(f"model.layers.{i}.self_attn." for i in range(4) if i not in keep)
    shared = [k for k in t_state if not k.startswith(converted)]
    assert len(shared) > 10
    for key in shared:
        assert torch.equal(t_state[key], h_state[key]), key
    assert hybrid.config.layer_types == ["full_attention" if i in keep else "linear_attention" for i in range(4)]


def test_copy_init_repeats_kv_rows_and_carries_bias_and_norm(family):
    """The native target carries the teacher's q/k/v biases and q/k norms into the GDN layers."""
    teacher = tiny_teacher(family)
    hybrid = tcal.convert(teacher, keep=KEEP, init="copy", target="native")
    attn = families.get(family).attention_weights(teacher.model.layers[1].self_attn)  # fused or not
    gdn = hybrid.model.layers[1].self_attn
    assert torch.equal(gdn.q_proj.weight, attn.q)
    assert torch.equal(gdn.o_proj.weight, attn.o)
    # Query head h reads KV head h // group (HF repeat_kv order): heads 0,1 <- kv 0; 2,3 <- kv 1.
    d = 16
    for h in range(4):
        kv = h // 2
        assert torch.equal(gdn.k_proj.weight[h * d:(h + 1) * d], attn.k[kv * d:(kv + 1) * d])
        assert torch.equal(gdn.v_proj.weight[h * d:(h + 1) * d], attn.v[kv * d:(kv + 1) * d])
    if attn.q_bias is not None:
        assert torch.equal(gdn.q_proj.bias, attn.q_bias)
        assert torch.equal(gdn.k_proj.bias, repeat_kv_rows(attn.k_bias, 2, 4))
    else:
        assert gdn.q_proj.bias is None
    if attn.q_norm is not None:
        assert torch.equal(gdn.q_norm.weight, attn.q_norm)
        assert torch.equal(gdn.k_norm.weight, attn.k_norm)
    else:
        assert not hasattr(gdn, "q_norm")
    assert (attn.q_bias is not None, attn.q_norm is not None) == (family == "qwen2", family == "qwen3")


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen3", False), ("gemma3", True)])
def test_build_without_construction_inits_equals_the_build_with_them(family, tied, monkeypatch):
    # build_hybrid skips the random inits of construction, which every weight then overwrites: the hybrid must be
    # the one built with them, parameter for parameter, buffer for buffer, tying and logits included
    import contextlib

    import tcal.conversion.surgery as surgery

    teacher = tiny_teacher(family, tie_word_embeddings=tied)
    fast = build_hybrid(teacher, KEEP)
    monkeypatch.setattr(surgery, "no_init_weights", contextlib.nullcontext)
    ref = build_hybrid(teacher, KEEP)
    for kind in ("named_parameters", "named_buffers"):
        got, want = dict(getattr(fast, kind)(remove_duplicate=False)), dict(getattr(ref, kind)(remove_duplicate=False))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), kind
    assert (fast.lm_head.weight is fast.model.embed_tokens.weight) == tied
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(fast(x).logits, ref(x).logits)


def test_repeat_kv_rows_order():
    w = torch.arange(2 * 3, dtype=torch.float32).reshape(2 * 3, 1)  # 2 KV heads of 3 rows
    out = repeat_kv_rows(w, 2, 4)
    assert out[:, 0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]


def test_build_hybrid_matches_convert_copy_and_config(family):
    teacher = tiny_teacher(family)
    a, b = build_hybrid(teacher, KEEP), tcal.convert(teacher, keep=KEEP, init="copy")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    cfg = hybrid_config_for(teacher, [2, 0], target="native", use_short_conv=True)
    assert cfg.gdn_use_short_conv and cfg.gdn_qkv_bias == (family == "qwen2") and cfg.gdn_qk_norm == (family == "qwen3")
    cfg = hybrid_config_for(teacher, [2, 0], use_short_conv=True)  # the default target: what the layout holds
    assert cfg.target == "qwen3_5" and cfg.gdn_use_short_conv and not (cfg.gdn_qkv_bias or cfg.gdn_qk_norm)
    assert cfg.gdn_layers == [1, 3]
    with pytest.raises(TcalError, match="unknown GDN option 'warp'"):
        hybrid_config_for(teacher, KEEP, warp=1)
    assert check_keep([2, 0], 4) == [0, 2] and check_keep((i for i in [3]), 4) == [3]
    assert check_teacher(teacher) is families.get(family)


@pytest.mark.parametrize(
    "keep, message",
    [
        ([0, 9], "keep index 9 out of range: the teacher has 4 layers"),
        ([-1], "keep index -1 out of range"),
        ([1, 1], "keep lists layer 1 more than once"),
        ([], "keep is empty"),
        ([0, 1, 2, 3], "nothing would be converted"),
        ("every-other", "unknown keep policy .every-other."),
        ([0.5, 3], "keep must list integer layer indices, got 0.5"),
        ([True, 3], "keep must list integer layer indices, got True"),
    ],
)
def test_bad_keep_lists(keep, message):
    with pytest.raises(TcalError, match=message):
        tcal.convert(tiny_teacher("llama"), keep=keep)


def test_unsupported_architecture_names_supported_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TcalError, match=r"unsupported architecture 'gpt2'; tcal converts ") as e:
        tcal.convert(gpt2, keep=[0])
    assert all(f.model_type in str(e.value) for f in families.FAMILIES.values())


def test_converting_a_hybrid_is_refused():
    hybrid = tcal.convert(tiny_teacher("llama"), keep=[0])
    with pytest.raises(TcalError, match="already a tcal hybrid"):
        tcal.convert(hybrid, keep=[0])


@pytest.mark.parametrize("tied", [True, False])
def test_a_hybrid_sharing_the_teachers_tensors_is_the_same_hybrid_and_leaves_the_teacher_alone(tied):
    """share_weights: every kept tensor is the teacher's storage (no copy), the GDN layers are the hybrid's own;
    the same weights and logits as a copying build; a calibrated conversion (Phase 2 and the KL stage train the
    GDN layers) leaves the teacher bit-identical; unshare() gives the hybrid copies that train on their own."""
    from tcal.conversion.surgery import build_hybrid, unshare
    from tcal.taylor.stage_config import AlignConfig, KLConfig

    teacher = tiny_teacher("qwen2", tie_word_embeddings=tied)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    copied = build_hybrid(teacher, KEEP, seed=3)
    shared = build_hybrid(teacher, KEEP, seed=3, share_weights=True)
    teacher_ptrs = {v.data_ptr() for v in teacher.state_dict().values()}
    for name, t in shared.state_dict().items():
        assert torch.equal(t, copied.state_dict()[name]), name
        assert (t.data_ptr() in teacher_ptrs) == (".self_attn." not in name or
                                                  int(name.split(".")[2]) in KEEP), name
    assert (shared.lm_head.weight is shared.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(shared(ids).logits, copied(ids).logits)
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    tcal.convert(teacher, keep=KEEP, init="taylor", calib_ids=calib, share_weights=True,
                 align=AlignConfig(steps=3), kl=KLConfig(steps=3, batch_size=2))
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    unshare(shared, teacher)
    assert not {v.data_ptr() for v in shared.state_dict().values()} & teacher_ptrs
    assert (shared.lm_head.weight is shared.model.embed_tokens.weight) == tied
    with torch.no_grad():
        for p in shared.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
