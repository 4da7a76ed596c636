"""The GatedDeltaNet layer: names, padding, conv/cache behaviour."""
import pytest
import torch
from helpers import assert_close

from tcal.modules.conv import ShortConvolution
from tcal.modules.gdn import GatedDeltaNet, inverse_softplus
from tcal.modules.gdn_shape import GDNShape
from tcal.modules.norms import HeadRMSNorm, l2norm


def layer(**over):
    torch.manual_seed(0)
    shape = GDNShape(hidden_size=32, num_heads=2, head_dim=8, **over)
    gdn = GatedDeltaNet(shape, layer_idx=0)
    with torch.no_grad():  # non-trivial convs so that padding through the conv is tested
        for name, p in gdn.named_parameters():
            if "conv1d" in name:
                p.normal_(0, 0.5)
    return gdn.eval()


def test_fla_parameter_names():
    names = {n.split(".")[0] for n, _ in layer(use_short_conv=True, qk_norm=True).named_parameters()}
    assert names == {"q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "A_log", "dt_bias",
                     "o_norm", "q_conv1d", "k_conv1d", "v_conv1d", "q_norm", "k_norm"}
    assert "g_proj" not in {n.split(".")[0] for n, _ in layer(output_gate=False).named_parameters()}


def test_default_decay_is_fla_range():
    gdn = layer()
    assert ((gdn.A_log.exp() >= 1 - 1e-5) & (gdn.A_log.exp() <= 16 + 1e-4)).all()
    dt = torch.nn.functional.softplus(gdn.dt_bias)
    assert ((dt > 9e-4) & (dt < 0.11)).all()


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_left_padding_matches_unpadded(conv, backend):
    gdn = layer(use_short_conv=conv, backend=backend)
    x = torch.randn(2, 23, 32)
    pad = 8  # row 1 holds 15 tokens after 8 of padding
    padded = x.clone()
    padded[1, :pad] = torch.randn(pad, 32) * 100  # garbage in the padding must not leak
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        y, _ = gdn(padded, tcal_keep=mask.float())
        y0, _ = gdn(x[:1])
        y1, _ = gdn(padded[1:, pad:])
        unmasked, _ = gdn(padded)
    assert_close(y[0], y0[0], 1e-5, f"{backend} conv={conv} unpadded row")
    assert_close(y[1, pad:], y1[0], 1e-5, f"{backend} conv={conv} left-padded row")
    # the comparison can fail: without the mask the garbage does leak into the real tokens
    assert (unmasked[1, pad:] - y1[0]).abs().max() > 1e-2


def test_short_conv_identity_init_is_a_no_op():
    torch.manual_seed(0)
    with_conv = GatedDeltaNet(GDNShape(hidden_size=32, num_heads=2, head_dim=8, use_short_conv=True), 0)
    without = GatedDeltaNet(GDNShape(hidden_size=32, num_heads=2, head_dim=8), 0)
    without.load_state_dict({k: v for k, v in with_conv.state_dict().items() if "conv1d" not in k})
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        assert_close(with_conv(x)[0], without(x)[0], 1.3e-6, "identity short conv vs none")


def test_gates_formula():
    gdn = layer()
    x = torch.randn(1, 5, 32)
    g, beta = gdn.gates(x)
    expect_g = -gdn.A_log.exp() * torch.nn.functional.softplus(gdn.a_proj(x) + gdn.dt_bias)
    torch.testing.assert_close(g, expect_g)
    torch.testing.assert_close(beta, torch.sigmoid(gdn.b_proj(x)))
    assert (g <= 0).all()


def test_short_conv_state_continues_the_sequence():
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4)
    x = torch.randn(2, 11, 6)
    with torch.no_grad():
        full, _ = conv(x)
        a, state = conv(x[:, :7])
        b, _ = conv(x[:, 7:], prefix=state)
    assert state.shape == (2, 6, 3)
    assert_close(torch.cat([a, b], 1), full, 1e-6, "conv split with state vs whole")


def test_norms():
    x = torch.randn(3, 5, 8) * 4
    torch.testing.assert_close(l2norm(x).norm(dim=-1), torch.ones(3, 5), rtol=0, atol=1e-5)
    norm = HeadRMSNorm(8)
    y = norm(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3, 5), rtol=0, atol=1e-4)
    g = torch.randn(3, 5, 8)
    torch.testing.assert_close(norm(x, g), y * torch.nn.functional.silu(g))
    torch.testing.assert_close(torch.nn.functional.softplus(inverse_softplus(torch.tensor([1e-3, 0.5, 20.0]))),
                               torch.tensor([1e-3, 0.5, 20.0]), rtol=1e-5, atol=1e-7)


def test_conv_step_continues_the_sequence_in_place():
    from tcal.modules.conv import conv_step

    torch.manual_seed(3)
    conv = ShortConvolution(6, 4)
    x = torch.randn(2, 9, 6)
    with torch.no_grad():
        full, _ = conv(x)
        _, state = conv(x[:, :8])
        buf = state.clone()
        y = conv_step(x[:, 8], buf, conv.weight[:, 0, :])
    assert_close(y, full[:, 8], 1e-6, "conv step")
    assert_close(buf, x[:, 6:9].transpose(1, 2), 0, "window after the step")


def test_causal_conv_equals_short_convolution_with_its_window():
    from tcal.modules.conv import causal_conv

    torch.manual_seed(4)
    conv = ShortConvolution(6, 4)
    x = torch.randn(2, 9, 6)
    with torch.no_grad():
        full, want_window = conv(x)
        _, window = conv(x[:, :2])
        y, new_window = causal_conv(x[:, 2:], window, conv.weight[:, 0, :])
    assert_close(y, full[:, 2:], 1e-6, "causal conv after a 2-token prefix")
    assert_close(new_window, want_window, 0, "window after the call")


@pytest.mark.parametrize("conv,qk_norm,gate", [(False, False, True), (True, True, False), (True, False, True)])
@pytest.mark.parametrize("packed", [False, True])
def test_decode_step_equals_forward_on_one_token(conv, qk_norm, gate, packed):
    gdn = layer(use_short_conv=conv, qk_norm=qk_norm, output_gate=gate, qkv_bias=True)
    with torch.no_grad():
        for p in (gdn.a_proj.weight, gdn.b_proj.weight, gdn.b_proj.bias, gdn.q_proj.bias):
            p.normal_(0, 0.5)
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        o_pre, state, conv_state = gdn.recurrent(x[:, :6], output_final_state=True)
        full = gdn(x)[0][:, 6:]
        state_buf = state.clone()
        conv_buf = conv_state.clone() if conv else None
        ptr = state_buf.data_ptr()
        got = gdn.decode_step(x[:, 6:], conv_buf, state_buf, gdn.packed_weights() if packed else None)
        _, want_state, want_conv = gdn.recurrent(x, output_final_state=True)
    assert_close(got, full, 1e-5, "decode step vs forward")
    assert state_buf.data_ptr() == ptr
    assert_close(state_buf, want_state, 1e-5, "state written in place")
    if conv:
        assert_close(conv_buf, want_conv, 1e-6, "conv window written in place")


@pytest.mark.parametrize("conv,qk_norm,gate", [(False, False, True), (True, True, False), (True, False, True)])
@pytest.mark.parametrize("split", [2, 9])  # a second prompt chunk shorter and longer than the conv window
def test_packed_prefill_continues_forward_with_padding(conv, qk_norm, gate, split):
    """prefill_packed on a left-padded prompt, in two calls carrying the conv window and the state, equals
    one eager forward: outputs, the final state and the window, all written in place."""
    gdn = layer(use_short_conv=conv, qk_norm=qk_norm, output_gate=gate, qkv_bias=True)
    with torch.no_grad():
        for p in (gdn.a_proj.weight, gdn.b_proj.weight, gdn.b_proj.bias, gdn.q_proj.bias):
            p.normal_(0, 0.5)
    x = torch.randn(2, 14, 32)
    keep = torch.ones(2, 14)
    keep[1, :3] = 0  # row 1 is left-padded by 3
    first = 14 - split
    with torch.no_grad():
        o, want_state, want_conv = gdn.recurrent(x, keep, output_final_state=True)
        want = gdn.mix(x, o)
        state = torch.zeros_like(want_state)
        window = torch.zeros(2, 3 * 16, gdn.shape.conv_size - 1) if conv else None
        ptrs = state.data_ptr(), window.data_ptr() if conv else None
        packed = gdn.packed_weights()
        got = torch.cat([gdn.prefill_packed(x[:, a:b], window, state, packed, keep[:, a:b])
                         for a, b in ((0, first), (first, 14))], 1)
    assert_close(got, want, 1e-5, "packed prefill vs forward")
    assert_close(state, want_state, 1e-5, "state")
    assert (state.data_ptr(), window.data_ptr() if conv else None) == ptrs
    if conv:
        assert_close(window, want_conv, 1e-6, "conv window")
