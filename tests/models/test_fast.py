"""FastDecoder / StaticHybridCache: the static-cache path equals the eager model.

On CPU the same code runs without CUDA graphs (the cache bookkeeping, padding, packing and the
decode attention are what is checked); the CUDA tests at the end run the captured graphs, fla's fused
step and the prefill graphs against the eager model, and skip without a GPU.
"""
import pytest
import torch
from helpers import assert_close, tiny_teacher

import tcal
from tcal.models.fast import FastDecoder, StaticHybridCache, combine_slices, decode_attention, masked_softmax
from tcal.utils.errors import TcalError

KEEP = [0, 2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ids(B=2, T=13, seed=1, vocab=97):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def hybrid_for(family="llama", conv=True, seed=0, target="native", teacher=None, **kw):
    """Native by default: its GDN layers carry the teachers' biases and q/k norms, the most the fast path handles.
    ``teacher``: config overrides of the tiny teacher."""
    hybrid = tcal.convert(tiny_teacher(family, seed=seed, **(teacher or {})), keep=KEEP, init="copy",
                          use_short_conv=conv, target=target, **kw)
    with torch.no_grad():  # random taps and gates, so the conv window and the decay matter
        g = torch.Generator().manual_seed(seed + 7)
        for name, p in hybrid.named_parameters():
            if "conv1d" in name or "a_proj" in name or "b_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return hybrid.eval()


def eager_logits(model, x, mask=None):
    """Logits at every position of x, from one eager forward (the reference)."""
    kw = {}
    if mask is not None:
        kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    with torch.no_grad():
        return model(x, use_cache=False, **kw).logits


def fast_logits(fast, x, T0, mask=None):
    """Prefill x[:, :T0], then feed x[:, T0:] one token at a time: logits of positions T0-1 ... end-1."""
    out = [fast.prefill(x[:, :T0], None if mask is None else mask[:, :T0])]
    for t in range(T0, x.shape[1]):
        out.append(fast.step(x[:, t:t + 1]))
    return torch.stack(out, 1)


@pytest.mark.parametrize("target", ["native", "qwen3_5"])
@pytest.mark.parametrize("pack", [True, False])
def test_prefill_and_decode_match_eager(family, pack, target):
    hybrid = hybrid_for(family, target=target)
    x = ids(T=20)
    fast = FastDecoder(hybrid, max_len=32, batch_size=2, pack=pack)
    assert_close(fast_logits(fast, x, 9), eager_logits(hybrid, x)[:, 8:], 1e-5, f"{family} {target} fast vs eager")


def test_plain_teacher_runs_on_the_static_cache_too():
    teacher = tiny_teacher("qwen2")
    x = ids(T=16)
    fast = FastDecoder(teacher, max_len=16, batch_size=2)
    assert not fast.gdn and fast.cache.state == {}
    assert_close(fast_logits(fast, x, 5), eager_logits(teacher, x)[:, 4:], 1e-5, "teacher fast vs eager")


def test_qk_norm_and_no_output_gate():
    hybrid = hybrid_for("qwen3", conv=False, qk_norm=True, output_gate=False)
    x = ids(T=12)
    fast = FastDecoder(hybrid, max_len=12, batch_size=2)
    assert_close(fast_logits(fast, x, 4), eager_logits(hybrid, x)[:, 3:], 1e-5, "qk_norm, no gate")


def test_greedy_generation_equals_hf_generate_for_64_tokens():
    hybrid = hybrid_for("qwen2")
    x = ids(B=1, T=7)
    fast = FastDecoder(hybrid, max_len=7 + 64, batch_size=1)
    hybrid.generation_config.eos_token_id = None  # pure greedy: FastDecoder never stops early
    with torch.no_grad():
        ref = hybrid.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
    got = fast.generate(x, max_new_tokens=64)
    assert got.shape == (1, 71)
    assert torch.equal(got, ref)


def test_left_padded_batch_matches_each_row_alone():
    hybrid = hybrid_for("llama")
    x = ids(B=3, T=14)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    mask[2, :13] = 0  # one real token
    fast = FastDecoder(hybrid, max_len=24, batch_size=3)
    batch = fast.generate(x, max_new_tokens=10, attention_mask=mask)
    c = fast.cache
    assert c.pad.tolist() == [0, 5, 13] and c.length == 14 + 9 and int(c.pos) == 23
    assert c.valid[1, :5].sum() == 0 and bool(c.valid[1, 5:23].all()) and not bool(c.valid[:, 23:].any())
    alone = FastDecoder(hybrid, max_len=24, batch_size=1)
    for row, start in enumerate((0, 5, 13)):
        single = alone.generate(x[row:row + 1, start:], max_new_tokens=10)
        assert torch.equal(batch[row, 14:], single[0, 14 - start:]), f"row {row}"
    # and the padded prefill's logits equal the eager model's on the same padded batch
    ref = eager_logits(hybrid, x, mask)[:, -1]
    assert_close(fast.prefill(x, mask), ref, 1e-5, "padded prefill vs eager")


@pytest.mark.parametrize("L", [11, 4096])  # 4096 slots: the reduction is split over 8 slices
def test_decode_attention_equals_masked_softmax(L):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, 3, 8, generator=g), torch.randn(2, 2, L, 8, generator=g), torch.randn(2, 2, L, 8, generator=g)
    mask = torch.rand(2, 1, 3, L, generator=g) > 0.3
    mask[..., 0] = True
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    s = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    ref = (s.softmax(-1) @ vr).transpose(1, 2)
    assert_close(decode_attention(q, k, v, mask, 0.3), ref, 1e-5, "decode attention")  # fp32 sum order
    # the decode step hands compiled copies in through `fuse`: they are the ones called
    calls = []
    fuse = {name: (lambda fn, name: lambda *a: calls.append(name) or fn(*a))(fn, name)
            for name, fn in (("softmax", masked_softmax), ("combine", combine_slices))}
    assert_close(decode_attention(q, k, v, mask, 0.3, fuse), ref, 1e-5, "decode attention, fuse")
    assert calls == (["softmax", "combine"] if L == 4096 else ["softmax"])


def test_new_batch_size_rebuilds_and_stays_correct():
    hybrid = hybrid_for("mistral")
    fast = FastDecoder(hybrid, max_len=20, batch_size=1)
    x = ids(B=3, T=11)
    assert_close(fast_logits(fast, x, 6), eager_logits(hybrid, x)[:, 5:], 1e-5, "after rebuild for B=3")
    assert fast.batch_size == 3 and fast.cache.batch_size == 3


def test_changed_weights_are_picked_up():
    hybrid = hybrid_for("llama")
    fast = FastDecoder(hybrid, max_len=16, batch_size=2)
    x = ids(T=10)
    fast.prefill(x[:, :4])
    with torch.no_grad():
        for m in hybrid.gdn_modules().values():
            m.q_proj.weight.mul_(1.5)  # in place, as an optimizer step would
            m.v_conv1d.weight.add_(0.1)
    assert_close(fast_logits(fast, x, 4), eager_logits(hybrid, x)[:, 3:], 1e-5, "after an in-place update")


def test_limits_are_one_line_errors():
    hybrid = hybrid_for("llama")
    fast = FastDecoder(hybrid, max_len=10, batch_size=1)
    x = ids(B=1, T=6)
    with pytest.raises(TcalError, match="max_len >= 12"):
        fast.generate(x, max_new_tokens=7)
    with pytest.raises(TcalError, match="max_len >= 11"):
        fast.prefill(ids(B=1, T=11))
    fast.generate(x, max_new_tokens=5)  # exactly fills the cache: 6 + 5 - 1 = 10 slots
    with pytest.raises(TcalError, match="cache is full"):
        fast.step(x[:, :1])
    right = torch.ones(2, 6, dtype=torch.long)
    right[0, -2:] = 0
    with pytest.raises(TcalError, match="left padding"):
        FastDecoder(hybrid, max_len=10, batch_size=2).prefill(ids(B=2, T=6), right)
    with pytest.raises(TcalError, match="float64"):
        FastDecoder(hybrid_for("llama").double(), max_len=10)
    with pytest.raises(TcalError, match="cuda_graphs=True"):
        FastDecoder(hybrid, max_len=10, cuda_graphs=True)  # the model is on the CPU


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_layers_keep_their_window(family):
    """Kept attention layers that slide (Mistral's every layer, Gemma 3's local ones over 8 tokens) attend
    through their window in the static cache too: prefill and decode past the window equal the eager model,
    a left-padded row included."""
    hybrid = hybrid_for(family, teacher={"sliding_window": 8})
    x = ids(T=24)
    fast = FastDecoder(hybrid, max_len=32, batch_size=2)
    # the cache is longer than the window, so each sliding layer kept as attention slides: Mistral's every layer,
    # Gemma 3's local ones (its tiny teacher's layer 3 is global)
    types = (hybrid.config.teacher_config().layer_types if family == "gemma3"
             else ["sliding_attention"] * hybrid.config.num_hidden_layers)
    sliding = [i for i in KEEP if types[i] == "sliding_attention"]
    assert sliding and fast.windows == {i: 8 for i in sliding}
    assert_close(fast_logits(fast, x, 11), eager_logits(hybrid, x)[:, 10:], 1e-5, f"{family} window, fast vs eager")
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    assert_close(fast_logits(fast, x, 11, mask), eager_logits(hybrid, x, mask)[:, 10:], 1e-5,
                 f"{family} window, left padding")


def test_cache_layout_and_reset():
    hybrid = hybrid_for("qwen2")
    c = StaticHybridCache(hybrid, batch_size=2, max_len=9)
    assert sorted(c.keys) == KEEP and sorted(c.state) == [1, 3]
    assert c.keys[0].shape == (2, 2, 9, 16) and c.state[1].shape == (2, 4, 16, 16)
    assert c.conv[1].shape == (2, 3 * 64, 3) and c.state[1].dtype == torch.float32
    assert c.nbytes() == 2 * 2 * (2 * 2 * 9 * 16 * 4) + 2 * (2 * 4 * 16 * 16 * 4 + 2 * 192 * 3 * 4)
    ptrs = [t.data_ptr() for t in (*c.keys.values(), *c.state.values(), c.valid, c.pos)]
    c.state[1].fill_(1.0)
    c.valid.fill_(True)
    c.pos.fill_(4)
    c.reset()
    assert float(c.state[1].abs().sum()) == 0 and not bool(c.valid.any()) and int(c.pos) == 0
    assert ptrs == [t.data_ptr() for t in (*c.keys.values(), *c.state.values(), c.valid, c.pos)]


# -- CUDA: captured graphs, fla's fused step, prefill graphs -------------------------------------------


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_cuda_graphs_match_eager(family, dtype, tol):
    hybrid = hybrid_for(family).to("cuda", dtype)
    x = ids(T=40).cuda()
    fast = FastDecoder(hybrid, max_len=48, batch_size=2)
    assert fast._decode_graph is not None and fast._use_glue  # captured, with the compiled norms and softmax
    got = fast_logits(fast, x, 24)
    ref = eager_logits(hybrid, x)[:, 23:]
    assert_close(got.float(), ref.float(), tol, f"{family} {dtype} graphs vs eager")
    if dtype == torch.float32:
        greedy = FastDecoder(hybrid, max_len=24 + 64, batch_size=2).generate(x[:, :24], max_new_tokens=64)
        hybrid.generation_config.eos_token_id = None
        with torch.no_grad():
            want = hybrid.generate(x[:, :24], attention_mask=torch.ones_like(x[:, :24]), max_new_tokens=64,
                                   do_sample=False)
        assert torch.equal(greedy, want)


@cuda
def test_cuda_split_slot_decode_matches_eager():
    # 2048 slots: the decode attention reduces over slot slices (compiled combine); 40 real tokens in them
    hybrid = hybrid_for("qwen3").to("cuda", torch.float32)
    x = ids(T=40).cuda()
    fast = FastDecoder(hybrid, max_len=2048, batch_size=2)
    assert fast._use_glue and fast.cache.slots == 2048
    assert_close(fast_logits(fast, x, 24).float(), eager_logits(hybrid, x)[:, 23:].float(), 2e-3, "split decode")


@cuda
def test_cuda_padded_prefill_graph_and_eager_prefill_agree():
    hybrid = hybrid_for("qwen2").to("cuda", torch.float32)
    x = ids(B=2, T=30).cuda()
    mask = torch.ones_like(x)
    mask[0, :9] = 0
    graphs = FastDecoder(hybrid, max_len=40, batch_size=2)
    eager = FastDecoder(hybrid, max_len=40, batch_size=2, cuda_graphs=False)
    a = graphs.generate(x, max_new_tokens=8, attention_mask=mask)
    b = eager.generate(x, max_new_tokens=8, attention_mask=mask)
    assert graphs._prefill and torch.equal(a, b)
    assert_close(graphs.prefill(x, mask), eager_logits(hybrid, x, mask)[:, -1], 2e-3, "padded prefill graph")
