"""fla Triton kernels vs the fp32 reference (GPU only; skipped without CUDA + flash-linear-attention)."""
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, tiny_teacher

from tcal.ops import fla_available, fla_backward_ok, gated_delta_rule, naive_recurrent_gated_delta_rule

pytestmark = pytest.mark.skipif(not fla_available(), reason="needs CUDA and flash-linear-attention")


def make(B, T, H, K, V, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device="cuda", generator=g).to(dtype)
    gate = (-F.softplus(torch.randn(B, T, H, device="cuda", generator=g)) * 0.5).float()
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(dtype)
    h0 = torch.randn(B, H, K, V, device="cuda", generator=g)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, h0)]


# Tolerances: fp32 inputs go through tf32 matmuls inside the kernels (~1e-3); bf16 operands ~1e-2.
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("T", [1, 63, 65, 257, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_chunk_forward_and_state(T, dtype):
    xs = [x.detach() for x in make(2, T, 4, 64, 64, dtype, seed=T)]
    o, s = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, backend="fla")
    o_r, s_r = naive_recurrent_gated_delta_rule(*[x.float() for x in xs[:5]], initial_state=xs[5],
                                                output_final_state=True)
    assert_close(o, o_r, TOL[dtype], f"fla chunk fwd T={T} {dtype} output")
    assert_close(s, s_r, TOL[dtype], f"fla chunk fwd T={T} {dtype} state")


@pytest.mark.skipif(fla_available() and not fla_backward_ok(), reason="fla refuses its gated backward here (#640)")
@pytest.mark.parametrize("T", [63, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_chunk_forward_state_grads(T, dtype):
    fla_in = make(2, T, 4, 64, 64, dtype, seed=T)
    ref_in = [x.detach().float().clone().requires_grad_() for x in fla_in]
    w = torch.randn(2, T, 4, 64, device="cuda")
    ws = torch.randn(2, 4, 64, 64, device="cuda")
    o, s = gated_delta_rule(*fla_in[:5], initial_state=fla_in[5], output_final_state=True, backend="fla")
    ((o.float() * w).sum() + (s * ws).sum()).backward()
    o_r, s_r = naive_recurrent_gated_delta_rule(*ref_in[:5], initial_state=ref_in[5], output_final_state=True)
    ((o_r * w).sum() + (s_r * ws).sum()).backward()
    pairs = {"o": (o, o_r), "state": (s, s_r)}
    pairs.update({f"d{n}": (a.grad, b.grad) for n, a, b in zip(["q", "k", "v", "g", "beta", "h0"], fla_in, ref_in)})
    for name, (a, b) in pairs.items():
        assert_close(a, b, TOL[dtype], f"fla chunk T={T} {dtype} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_fused_recurrent_decode_step(dtype):
    xs = make(3, 1, 4, 64, 64, dtype, seed=5)
    with torch.no_grad():
        o, s = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, backend="fla")
        o_r, s_r = naive_recurrent_gated_delta_rule(*[x.float() for x in xs[:5]], initial_state=xs[5],
                                                    output_final_state=True)
    assert_close(o, o_r, TOL[dtype], f"fla decode step {dtype} output")
    assert_close(s, s_r, TOL[dtype], f"fla decode step {dtype} state")


def test_fla_own_naive_is_an_outside_oracle():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as fla_naive

    q, k, v, g, b, h0 = (x.detach() for x in make(1, 77, 2, 32, 32, torch.float32, seed=3))
    o, s = naive_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True)
    o2, s2 = fla_naive(q, k, v, beta=b, g=g, initial_state=h0, output_final_state=True)
    assert_close(o, o2, 1e-4, "tcal naive vs fla naive output")
    assert_close(s, s2, 1e-4, "tcal naive vs fla naive state")


def test_hybrid_on_cuda_fla_matches_chunk_and_decodes():
    import tcal
    from tcal.utils import compat

    teacher = tiny_teacher("qwen2").cuda()
    a = tcal.convert(teacher, keep=[0, 2], init="copy", backend="auto")
    b = tcal.convert(teacher, keep=[0, 2], init="copy", backend="chunk")
    x = torch.randint(0, 97, (2, 150), device="cuda")
    with torch.no_grad():
        la, lb = a(x).logits, b(x).logits
        assert_close(la, lb, 1e-3, "fla vs chunk logits")
        out = a(x[:, :100], use_cache=True)
        cache = getattr(out, compat.CACHE_KWARG)
        steps = [out.logits]
        for t in range(100, 150):
            out = a(x[:, t:t + 1], use_cache=True, **{compat.CACHE_KWARG: cache})
            steps.append(out.logits)
        assert_close(torch.cat(steps, 1), la, 1e-3, "fla prefill + decode vs full logits")
        gen = a.generate(x[:1, :10], attention_mask=torch.ones_like(x[:1, :10]), max_new_tokens=20, do_sample=False)
    assert gen.shape == (1, 30)


def test_auto_backend_trains_on_cuda():
    # Under grad, auto picks fla where its backward is trusted, else the chunked PyTorch path.
    xs = make(1, 130, 2, 32, 32, torch.float32, seed=11)
    o, s = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
    (o.sum() + s.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in xs)


@pytest.mark.parametrize("T", [63, 257])
def test_chunked_torch_on_cuda_matches_loop_with_grads(T):
    # The path that trains on GPUs where fla's backward is refused: chunked PyTorch, on CUDA.
    c_in = make(2, T, 4, 64, 64, torch.float32, seed=T + 1)
    r_in = [x.detach().clone().requires_grad_() for x in c_in]
    w = torch.randn(2, T, 4, 64, device="cuda")
    o, s = gated_delta_rule(*c_in[:5], initial_state=c_in[5], output_final_state=True, backend="chunk")
    ((o * w).sum() + s.sum()).backward()
    o_r, s_r = naive_recurrent_gated_delta_rule(*r_in[:5], initial_state=r_in[5], output_final_state=True)
    ((o_r * w).sum() + s_r.sum()).backward()
    pairs = {"o": (o, o_r), "state": (s, s_r)}
    pairs.update({f"d{n}": (a.grad, b.grad) for n, a, b in zip(["q", "k", "v", "g", "beta", "h0"], c_in, r_in)})
    for name, (a, b) in pairs.items():
        assert_close(a, b, 5e-3, f"torch chunk on cuda T={T} {name}")  # tf32 matmuls on CUDA
