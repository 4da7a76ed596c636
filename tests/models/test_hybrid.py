"""The hybrid model: config, cache equivalence, generation and padding on tiny random teachers."""
import torch
from helpers import assert_close, tiny_teacher

import tcal
from tcal.models.configuration_hybrid import FULL, LINEAR, HybridConfig
from tcal.modules.gdn import GatedDeltaNet
from tcal.utils import compat

KEEP = [0, 2]


def ids(B=2, T=21, seed=1):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_config_layer_lists_and_teacher_config():
    hybrid = tcal.convert(tiny_teacher("qwen2"), keep=KEEP, init="copy", target="native")
    cfg = hybrid.config
    assert isinstance(cfg, HybridConfig) and cfg.model_type == "tcal_hybrid"
    assert cfg.layer_types == [FULL, LINEAR, FULL, LINEAR]
    assert cfg.gdn_layers == [1, 3] and cfg.attention_layers == [0, 2]
    assert cfg.teacher_config().model_type == "qwen2"
    shape = cfg.gdn_shape()
    assert (shape.hidden_size, shape.num_heads, shape.head_dim, shape.qkv_bias) == (64, 4, 16, True)
    assert sorted(hybrid.gdn_modules()) == [1, 3]
    assert all(isinstance(m, GatedDeltaNet) for m in hybrid.gdn_modules().values())


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
    assert_close(torch.cat(steps, 1), full, 1e-4, f"{family} prefill + decode vs full forward")


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
    assert_close(batch[1, 5:], single[0], 1e-4, "left-padded row vs single sequence")


def test_padding_reaches_gdn_layers_only_when_something_is_padded():
    # An all-ones mask (what generate() passes) must not reach the GDN layers: checking it there cost
    # a GPU->host sync per layer per token.
    hybrid = tcal.convert(tiny_teacher("llama"), keep=KEEP, init="copy")
    gdn = next(m for m in hybrid.modules() if isinstance(m, GatedDeltaNet))
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


def test_backends_agree_inside_the_model():
    teacher = tiny_teacher("llama")
    a = tcal.convert(teacher, keep=KEEP, init="copy", backend="naive")
    b = tcal.convert(teacher, keep=KEEP, init="copy", backend="chunk")
    x = ids(T=70)
    with torch.no_grad():
        assert_close(b(x).logits, a(x).logits, 1e-4, "chunk vs naive backend logits")
