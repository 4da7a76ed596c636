"""The GatedDeltaNet layer: names, padding, conv/cache behaviour."""
import pytest
import torch

from tcal.gdn import GatedDeltaNet, GDNShape


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
    lengths = [23, 15]
    padded = x.clone()
    padded[1, :8] = torch.randn(8, 32) * 100  # garbage in the padding must not leak
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[1, :8] = 0
    with torch.no_grad():
        y, _ = gdn(padded, tcal_keep=mask.float())
        y0, _ = gdn(x[:1])
        y1, _ = gdn(padded[1:, 8:])
    torch.testing.assert_close(y[0], y0[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[1, 8:], y1[0], rtol=1e-5, atol=1e-5)
    assert lengths


def test_short_conv_identity_init_is_a_no_op():
    torch.manual_seed(0)
    with_conv = GatedDeltaNet(GDNShape(hidden_size=32, num_heads=2, head_dim=8, use_short_conv=True), 0)
    without = GatedDeltaNet(GDNShape(hidden_size=32, num_heads=2, head_dim=8), 0)
    without.load_state_dict({k: v for k, v in with_conv.state_dict().items() if "conv1d" not in k})
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(with_conv(x)[0], without(x)[0])


def test_gates_formula():
    gdn = layer()
    x = torch.randn(1, 5, 32)
    g, beta = gdn.gates(x)
    expect_g = -gdn.A_log.exp() * torch.nn.functional.softplus(gdn.a_proj(x) + gdn.dt_bias)
    torch.testing.assert_close(g, expect_g)
    torch.testing.assert_close(beta, torch.sigmoid(gdn.b_proj(x)))
    assert (g <= 0).all()
