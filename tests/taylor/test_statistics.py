"""Teacher statistics: the pure formulas on constructed attention, and the hooked teacher passes."""
import math

import pytest
import torch
from helpers import tiny_teacher

from tcal.taylor.capture import LayerIO, capture_teacher_io, check_layers, decoder_layers, eager_attention
from tcal.taylor.statistics import (
    STATS_FILE,
    LayerStats,
    TeacherStats,
    attention_distance,
    attention_distance_nosink,
    attention_entropy,
    attention_entropy_normalised,
    attention_sink_mass,
    collect_stats,
    concentration_absolute,
    concentration_minmax,
    load_stats,
    row_distance,
    save_stats,
    summarise,
)
from tcal.utils.errors import TcalError

# 3 layers, 4 query / 2 KV heads of 8
CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=128)


def tiny(family="llama", seed=0):
    m = tiny_teacher(family, seed, **CFG)
    with torch.no_grad():  # sharper, less uniform attention than the default init gives
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
    return m


def uniform_causal(T, H=1):
    p = torch.tril(torch.ones(T, T))
    p = p / p.sum(-1, keepdim=True)
    return p.expand(H, T, T).clone()


# --- pure formulas ---------------------------------------------------------------------------


def test_uniform_causal_distance_by_hand():
    # rows: t=0 -> 0.5 (self, floored), t=1 -> (0.5 + 1)/2, t=2 -> (0.5 + 1 + 2)/3, t=3 -> (0.5 + 1 + 2 + 3)/4
    expected = (0.5 + 1.5 / 2 + 3.5 / 3 + 6.5 / 4) / 4  # = 1.0104166...
    d = attention_distance(uniform_causal(4, H=2))
    assert d.shape == (2,)
    torch.testing.assert_close(d, torch.full((2,), expected), rtol=0, atol=1e-6)
    assert abs(expected - 1.0104166667) < 1e-9


def test_uniform_causal_entropy_and_concentration():
    T = 6
    p = uniform_causal(T, H=3)
    H = attention_entropy(p)
    expected = sum(math.log(t + 1) for t in range(T)) / T
    torch.testing.assert_close(H, torch.full((3,), expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(attention_entropy_normalised(p), torch.ones(3), rtol=0, atol=1e-6)
    torch.testing.assert_close(concentration_absolute(p), torch.zeros(3), rtol=0, atol=1e-6)


def test_previous_token_one_hot_gives_distance_one():
    # 3 query rows at absolute positions 2, 3, 4 of 5 keys (a cache offset), each on its previous token.
    Tq, Tk = 3, 5
    p = torch.zeros(2, Tq, Tk)
    for i in range(Tq):
        p[:, i, Tk - Tq + i - 1] = 1.0
    torch.testing.assert_close(attention_distance(p), torch.ones(2))
    torch.testing.assert_close(attention_entropy(p), torch.zeros(2))
    torch.testing.assert_close(concentration_absolute(p), torch.ones(2))


def test_previous_token_full_window_row_zero_attends_to_itself():
    T = 8
    p = torch.zeros(1, T, T)
    p[0, 0, 0] = 1.0
    for t in range(1, T):
        p[0, t, t - 1] = 1.0
    torch.testing.assert_close(attention_distance(p), torch.tensor([(0.5 + (T - 1)) / T]))


def test_self_attention_only_is_half_a_token_and_above_diagonal_ignored():
    p = torch.eye(5)[None].clone()
    p[0, 1, 3] = 7.0  # non-causal garbage must not count
    torch.testing.assert_close(row_distance(p), torch.full((1, 5), 0.5))
    torch.testing.assert_close(attention_entropy(p), torch.zeros(1))


def test_batched_mean_over_batch_and_rows():
    a, b = uniform_causal(4), torch.eye(4)[None]
    p = torch.stack([torch.cat([a, b]), torch.cat([b, a])])  # (B=2, H=2, T, T)
    both = (attention_distance(a) + attention_distance(b)) / 2
    torch.testing.assert_close(attention_distance(p), both.expand(2))


def test_single_position_rows():
    p = torch.ones(3, 1, 1)
    torch.testing.assert_close(attention_entropy_normalised(p), torch.zeros(3))
    torch.testing.assert_close(concentration_absolute(p), torch.ones(3))
    torch.testing.assert_close(attention_distance(p), torch.full((3,), 0.5))


def test_sink_free_distance():
    # half the mass on token 0 (the sink), half on the previous token
    T = 9
    p = torch.zeros(2, T, T)
    p[:, 0, 0] = 1.0
    for t in range(1, T):
        p[:, t, 0] += 0.5
        p[:, t, t - 1] += 0.5
    p[1] = 0.0  # head 1: everything on the sink
    p[1, :, 0] = 1.0
    raw = attention_distance(p)
    assert raw[0] > 2.0 and raw[1] > 3.0  # the sink makes both look like long-memory heads
    torch.testing.assert_close(attention_distance_nosink(p), torch.tensor([1.0, 0.5]))
    # row 1 is all sink (its previous token is token 0)
    torch.testing.assert_close(attention_sink_mass(p), torch.tensor([(1 + 0.5 * (T - 2)) / (T - 1), 1.0]))
    # no sink at all: rows t >= 1 of the ordinary distance
    q = uniform_causal(5)
    q[0, :, 0] = 0.0
    q[0, 1:] /= q[0, 1:].sum(-1, keepdim=True)
    expected = sum(sum(max(t - s, 0.5) for s in range(1, t + 1)) / t for t in range(1, 5)) / 4
    torch.testing.assert_close(attention_distance_nosink(q), torch.tensor([expected]))


def test_concentration_minmax_reference_formula():
    torch.testing.assert_close(concentration_minmax(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([1.0, 0.5, 0.0]))
    # all heads equal: the range is floored at 1e-3, every head gets 1
    torch.testing.assert_close(concentration_minmax(torch.tensor([2.0, 2.0])), torch.tensor([1.0, 1.0]))
    # a spread below the floor is divided by the floor, not blown up to [0, 1]
    torch.testing.assert_close(concentration_minmax(torch.tensor([1.0, 1.0005])), torch.tensor([1.0, 0.5]), rtol=0, atol=1e-4)


# --- teacher passes ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_collect_stats_matches_output_attentions(family):
    m = tiny(family)
    ids = torch.randint(0, CFG["vocab_size"], (3, 12))
    impl = m.config._attn_implementation
    stats = collect_stats(m, ids, layers=[0, 2], batch_size=2, progress=False)
    assert m.config._attn_implementation == impl  # restored
    assert list(stats) == [0, 2] and len(stats) == 2
    with eager_attention(m), torch.no_grad():
        out = m(ids, output_attentions=True, output_hidden_states=True)
    for i in (0, 2):
        p = out.attentions[i]
        s = stats[i]
        assert s.tokens == 3 * 12 and s.num_heads == 4 and s.head_dim == 8
        torch.testing.assert_close(torch.tensor(s.distance), attention_distance(p), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(s.distance_nosink), attention_distance_nosink(p), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(s.sink_mass), attention_sink_mass(p), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(s.entropy), attention_entropy(p), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(s.concentration_absolute), concentration_absolute(p),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(s.concentration_minmax), concentration_minmax(attention_entropy(p)),
                                   rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            x = m.model.layers[i].input_layernorm(out.hidden_states[i])
        assert abs(s.x_rms - float(x.pow(2).mean().sqrt())) < 1e-5
    assert len({round(v, 3) for v in stats[0].distance}) > 1  # heads differ: a real, non-uniform test


def test_capture_teacher_io_is_consistent():
    m = tiny("qwen2")
    ids = torch.randint(0, CFG["vocab_size"], (3, 10))
    io = capture_teacher_io(m, ids, [1, 2], batch_size=2)
    with torch.no_grad():
        out = m(ids, output_hidden_states=True)
    for i in (1, 2):
        layer = m.model.layers[i]
        with torch.no_grad():
            x = layer.input_layernorm(out.hidden_states[i])
            y = layer.self_attn.o_proj(io[i].ctx.reshape(3, 10, -1))
        torch.testing.assert_close(io[i].x, x)
        assert io[i].ctx.shape == (3, 10, 4, 8)
        torch.testing.assert_close(y, io[i].out)
    stats = collect_stats(m, ids, [1], progress=False)
    ctx = io[1].ctx
    torch.testing.assert_close(torch.tensor(stats[1].ctx_rms), ctx.pow(2).mean((0, 1, 3)).sqrt(), rtol=1e-5, atol=1e-6)
    assert abs(stats[1].ctx_vec_rms - float(ctx.pow(2).mean(-1).sqrt().mean())) < 1e-6
    assert abs(stats[1].out_rms - float(io[1].out.pow(2).mean().sqrt())) < 1e-6
    sub = io[1].select(slice(1, 3))
    assert isinstance(sub, LayerIO) and sub.num_sequences == 2 and sub.ctx.shape[0] == 2
    assert capture_teacher_io(m, ids, [2], with_ctx=False)[2].ctx is None
    assert check_layers(m, None) == [0, 1, 2] and check_layers(m, [2, 0, 2]) == [0, 2]
    assert len(decoder_layers(m)) == 3


def test_batching_does_not_change_stats():
    m = tiny()
    ids = torch.randint(0, CFG["vocab_size"], (4, 9))
    a = collect_stats(m, ids, [1], batch_size=4, progress=False)[1]
    b = collect_stats(m, ids, [1], batch_size=1, progress=False)[1]
    for name in ("distance", "entropy", "entropy_normalised", "ctx_rms"):
        torch.testing.assert_close(torch.tensor(getattr(a, name)), torch.tensor(getattr(b, name)), rtol=1e-5, atol=1e-6)


def test_bad_layers_and_inputs():
    m = tiny()
    with pytest.raises(TcalError, match="out of range"):
        collect_stats(m, torch.zeros(1, 4, dtype=torch.long), [5], progress=False)
    with pytest.raises(TcalError, match="sequences, tokens"):
        collect_stats(m, torch.zeros(4, dtype=torch.long), [0], progress=False)


def test_save_load_summary(tmp_path):
    m = tiny()
    stats = collect_stats(m, torch.randint(0, CFG["vocab_size"], (2, 8)), progress=False)
    path = save_stats(stats, tmp_path)
    back = load_stats(path)
    assert isinstance(back, TeacherStats) and list(back) == [0, 1, 2]
    assert back[1] == stats[1] and back.meta["seq_len"] == 8
    assert load_stats(tmp_path)[0] == stats[0]
    text = summarise(stats)
    assert len(text.splitlines()) == 2 + 3 and "d med" in text
    assert path.endswith(STATS_FILE)
    with pytest.raises(TcalError, match="tcal stats"):
        load_stats(tmp_path / "nowhere.json")
    assert isinstance(back[0], LayerStats)
