"""GDNStack: G layers run as one give each layer's own forward, and each layer's own gradients."""
import pytest
import torch
from helpers import assert_close

from tcal.modules.gdn import GatedDeltaNet
from tcal.modules.gdn_shape import GDNShape
from tcal.modules.gdn_stack import GDNStack
from tcal.utils.errors import TcalError


def layers(n=3, **over):
    """``n`` layers of one shape with different, non-trivial weights in every parameter."""
    torch.manual_seed(0)
    shape = GDNShape(hidden_size=32, num_heads=2, head_dim=8, **over)
    out = []
    for i in range(n):
        gdn = GatedDeltaNet(shape, layer_idx=i)
        with torch.no_grad():
            for name, p in gdn.named_parameters():
                if "conv1d" in name or "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.3)
        out.append(gdn)
    return out


SHAPES = [dict(), dict(use_short_conv=True), dict(qk_norm=True), dict(qkv_bias=True, o_bias=True),
          dict(output_gate=False), dict(use_short_conv=True, qk_norm=True, qkv_bias=True, backend="naive")]


@pytest.mark.parametrize("over", SHAPES, ids=lambda o: ",".join(o) or "default")
def test_stack_forward_and_gradients_equal_each_layer(over):
    gdns = layers(**over)
    stack = GDNStack(gdns)
    x = torch.randn(len(gdns), 2, 70, 32)  # 70 tokens: two chunks, the second partial
    y = stack(x)
    y.pow(2).sum().backward()
    for i, gdn in enumerate(gdns):
        ref, _ = gdn(x[i])
        assert_close(y[i], ref, 2e-6, f"layer {i} output")
        ref.pow(2).sum().backward()
        for name, p in gdn.named_parameters():
            assert_close(stack.param(name).grad[i], p.grad, 2e-5, f"layer {i} grad {name}")


def test_write_back_puts_each_slice_into_its_layer():
    gdns = layers()
    stack = GDNStack(gdns)
    with torch.no_grad():
        stack.param("q_proj.weight")[1].fill_(0.5)
        stack.param("A_log")[2].fill_(-1.0)
    assert not torch.equal(gdns[1].q_proj.weight, torch.full_like(gdns[1].q_proj.weight, 0.5))
    stack.write_back()
    assert torch.equal(gdns[1].q_proj.weight, torch.full_like(gdns[1].q_proj.weight, 0.5))
    assert torch.equal(gdns[2].A_log, torch.full_like(gdns[2].A_log, -1.0))
    assert torch.equal(gdns[0].q_proj.weight, stack.param("q_proj.weight")[0])


def test_stack_refuses_mixed_shapes_and_wrong_inputs():
    a = layers(1)[0]
    b = layers(1, use_short_conv=True)[0]
    with pytest.raises(TcalError, match="share one GDNShape"):
        GDNStack([a, b])
    with pytest.raises(TcalError, match="at least one layer"):
        GDNStack([])
    with pytest.raises(TcalError, match="got inputs for 2"):
        GDNStack([a])(torch.randn(2, 1, 4, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stack_on_cuda_with_the_default_backend():
    """fla (where installed) runs the stack's folded batch; each layer alone goes the same way."""
    gdns = [g.cuda() for g in layers(use_short_conv=True)]
    stack = GDNStack(gdns)
    x = torch.randn(len(gdns), 2, 200, 32, device="cuda")
    with torch.no_grad():
        y = stack(x)
        for i, gdn in enumerate(gdns):
            assert_close(y[i], gdn(x[i])[0], 2e-3, f"cuda layer {i} output")
