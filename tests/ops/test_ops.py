"""Chunked PyTorch gated delta rule vs the fp32 token-loop reference."""
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

from tcal.ops import (
    chunk_gated_delta_rule_torch,
    chunk_scan_gated_delta_rule_torch,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)


def inputs(B, T, H, K, V, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = -F.softplus(torch.randn(B, T, H, generator=g)) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, K, V, generator=g)
    xs = [q, k, v, gate, beta, h0]
    if requires_grad:
        xs = [x.clone().requires_grad_() for x in xs]
    return xs


def test_naive_matches_definition_one_step():
    # S_1 = exp(g) (I - b k k^T) S_0 + b k v^T ; o = S_1^T q * scale
    q, k, v, g, b, h0 = inputs(1, 1, 1, 4, 3)
    o, s = naive_recurrent_gated_delta_rule(q, k, v, g, b, scale=0.5, initial_state=h0, output_final_state=True)
    kk, vv, qq = k[0, 0, 0], v[0, 0, 0], q[0, 0, 0]
    S = g[0, 0, 0].exp() * (torch.eye(4) - b[0, 0, 0] * torch.outer(kk, kk)) @ h0[0, 0] + b[0, 0, 0] * torch.outer(kk, vv)
    assert torch.allclose(s[0, 0], S, atol=1e-6)
    assert torch.allclose(o[0, 0, 0], S.T @ (qq * 0.5), atol=1e-6)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 257])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunk_forward_and_state(T, chunk):
    q, k, v, g, b, h0 = inputs(2, T, 3, 16, 8, seed=T)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True)
    o, s = chunk_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True, chunk_size=chunk)
    assert_close(o, o_ref, 1e-5, f"T={T} chunk={chunk} output")
    assert_close(s, s_ref, 1e-5, f"T={T} chunk={chunk} state")


@pytest.mark.parametrize("T", [1, 63, 64, 65, 257])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule_torch, chunk_scan_gated_delta_rule_torch], ids=["loop", "scan"])
def test_chunk_gradients(T, chunk, fn):
    ref = inputs(1, T, 2, 8, 8, seed=100 + T, requires_grad=True)
    tst = inputs(1, T, 2, 8, 8, seed=100 + T, requires_grad=True)
    w = torch.randn(1, T, 2, 8, generator=torch.Generator().manual_seed(7))
    ws = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(8))
    o, s = naive_recurrent_gated_delta_rule(*ref[:5], initial_state=ref[5], output_final_state=True)
    ((o * w).sum() + (s * ws).sum()).backward()
    o, s = fn(*tst[:5], initial_state=tst[5], output_final_state=True, chunk_size=chunk)
    ((o * w).sum() + (s * ws).sum()).backward()
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], tst, ref):
        assert_close(a.grad, b.grad, 1e-4, f"{fn.__name__} T={T} chunk={chunk} grad {name}")


@pytest.mark.parametrize("T", [1, 63, 64, 65, 257, 1100])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("with_state", [True, False])
def test_scan_forward_and_state(T, chunk, with_state):
    """The parallel scan over chunks (N = 1 .. 69 chunks: 0 .. 7 doubling rounds, N not a power of two)."""
    q, k, v, g, b, h0 = inputs(2, T, 3, 16, 8, seed=T)
    h0 = h0 if with_state else None
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True)
    o, s = chunk_scan_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                             chunk_size=chunk)
    assert_close(o, o_ref, 1e-5, f"scan T={T} chunk={chunk} output")
    assert_close(s, s_ref, 1e-5, f"scan T={T} chunk={chunk} state")


def ran_backends(monkeypatch) -> list:
    """Record which PyTorch path each gated_delta_rule call dispatches to."""
    from tcal.ops import dispatch

    ran = []
    for kind, name in (("naive", "naive_recurrent_gated_delta_rule"), ("chunk", "chunk_gated_delta_rule_torch"),
                       ("scan", "chunk_scan_gated_delta_rule_torch")):
        fn = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _fn=fn, _kind=kind, **kw: ran.append(_kind) or _fn(*a, **kw))
    return ran


@pytest.mark.parametrize("backend", ["naive", "chunk", "scan"])
def test_each_backend_is_the_one_asked_for(backend, monkeypatch):
    ran = ran_backends(monkeypatch)
    q, k, v, g, b, h0 = inputs(1, 70, 2, 8, 8)
    gated_delta_rule(q, k, v, g, b, initial_state=h0, backend=backend, chunk_size=32)
    assert ran == [backend]


def test_scan_is_the_backend_asked_for_and_stays_finite_under_strong_decay(monkeypatch):
    q, k, v, g, b, h0 = inputs(1, 300, 2, 8, 8)
    g = torch.full_like(g, -20.0)  # every chunk's state transition nearly zero: products of them underflow
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True)
    ran = ran_backends(monkeypatch)
    o, s = gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True, backend="scan", chunk_size=32)
    assert ran == ["scan"]
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close(o, o_ref, 1e-5, "scan output, log decay -20")


def test_strong_decay_is_stable():
    # log decay of -20 per token: exp(G) underflows within a chunk; no NaN/Inf, still matches.
    q, k, v, g, b, h0 = inputs(1, 100, 2, 8, 8)
    g = torch.full_like(g, -20.0)
    o_ref, _ = naive_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h0)
    o, _ = chunk_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0)
    assert torch.isfinite(o).all()
    assert_close(o, o_ref, 1e-5, "output, log decay -20")


def test_zero_beta_zero_g_positions_leave_state_untouched():
    # The padding contract the layer relies on.
    q, k, v, g, b, h0 = inputs(1, 70, 2, 8, 8)
    g[:, :30] = 0
    b[:, :30] = 0
    _, s_full = chunk_gated_delta_rule_torch(q, k, v, g, b, initial_state=h0, output_final_state=True)
    _, s_tail = chunk_gated_delta_rule_torch(q[:, 30:], k[:, 30:], v[:, 30:], g[:, 30:], b[:, 30:],
                                             initial_state=h0, output_final_state=True)
    assert_close(s_full, s_tail, 1e-5, "state after zero-beta zero-g prefix")


def test_dispatch_backends_agree_and_dtype_roundtrip():
    q, k, v, g, b, h0 = inputs(2, 40, 2, 8, 8)
    o1, s1 = gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True, backend="naive")
    o2, s2 = gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True, backend="chunk")
    assert_close(o2, o1, 1e-5, "chunk vs naive output")
    assert_close(s2, s1, 1e-5, "chunk vs naive state")
    o3, _ = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, b, backend="chunk")
    assert o3.dtype == torch.bfloat16
    assert s1.dtype == torch.float32


def test_unknown_backend_and_fla_on_cpu_are_clear_errors():
    from tcal.utils.errors import TcalError

    q, k, v, g, b, _ = inputs(1, 4, 1, 4, 4)
    with pytest.raises(TcalError, match="unknown GDN backend"):
        gated_delta_rule(q, k, v, g, b, backend="bogus")
    with pytest.raises(TcalError, match="needs CUDA"):
        gated_delta_rule(q, k, v, g, b, backend="fla")


def test_torch_only_keeps_auto_off_fla_with_and_without_gradients(monkeypatch):
    import tcal.ops as ops
    import tcal.ops.dispatch as dispatch

    # a stand-in fla on a stand-in GPU: only which backend "auto" picks is asked here
    monkeypatch.setattr(dispatch, "_fla_ops", lambda: (object(), object()))
    monkeypatch.setattr(dispatch, "fla_backward_ok", lambda: True)
    monkeypatch.delenv("TCAL_GDN_BACKEND", raising=False)
    cuda = torch.device("cuda")
    assert dispatch.resolve_backend("auto", cuda, 512) == "fla"
    with ops.torch_only(True):
        assert dispatch.resolve_backend("auto", cuda, 512) == "chunk"
        assert dispatch.resolve_backend("auto", cuda, 512, needs_grad=True) == "chunk"
        assert dispatch.resolve_backend("auto", cuda, 1) == "naive"
        assert dispatch.resolve_backend("fla", cuda, 512) == "fla"  # asked for by name: still given
        with ops.torch_only(False):
            assert dispatch.resolve_backend("auto", cuda, 512) == "fla"
        assert dispatch.resolve_backend("auto", cuda, 512) == "chunk"
    assert dispatch.resolve_backend("auto", cuda, 512) == "fla"


def test_auto_trains_long_sequences_on_a_gpu_through_the_scan(monkeypatch):
    import tcal.ops as ops
    import tcal.ops.dispatch as dispatch

    monkeypatch.delenv("TCAL_GDN_BACKEND", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    long = dispatch.SCAN_MIN_CHUNKS * 64
    for fla, backward in ((None, True), ((object(), object()), False), ((object(), object()), True)):
        monkeypatch.setattr(dispatch, "_fla_ops", lambda fla=fla: fla)
        monkeypatch.setattr(dispatch, "fla_backward_ok", lambda backward=backward: backward)
        fla_trains = fla is not None and backward
        assert dispatch.resolve_backend("auto", cuda, long, needs_grad=True) == ("fla" if fla_trains else "scan")
        assert dispatch.resolve_backend("auto", cuda, long - 64, needs_grad=True) == ("fla" if fla_trains else "chunk")
        # the threshold counts chunks, not tokens
        assert dispatch.resolve_backend("auto", cuda, long // 2, True, chunk_size=32) == ("fla" if fla_trains else "scan")
        with ops.torch_only(True):  # calibration's fits on the PyTorch paths
            assert dispatch.resolve_backend("auto", cuda, long, needs_grad=True) == "scan"
        assert dispatch.resolve_backend("auto", cuda, long) == ("fla" if fla else "chunk")  # inference
        assert dispatch.resolve_backend("auto", cpu, long, needs_grad=True) == "chunk"  # CPU: the loop
        monkeypatch.setenv("TCAL_GDN_BACKEND", "chunk")
        assert dispatch.resolve_backend("auto", cuda, long, needs_grad=True) == "chunk"  # the variable still wins
        monkeypatch.delenv("TCAL_GDN_BACKEND")


def test_compiled_chunk_path_matches_eager_with_grads(monkeypatch, caplog):
    # tcal.ops.compile_training / TCAL_GDN_COMPILE: the torch.compile'd chunked path that trains on GPUs
    # without fla's backward must give the eager path's outputs and gradients.
    import logging

    import tcal.ops as ops
    import tcal.ops.dispatch as dispatch

    monkeypatch.delenv("TCAL_GDN_COMPILE", raising=False)
    monkeypatch.setattr(dispatch, "_COMPILE", dict(dispatch.COMPILE_DEFAULTS))  # a fresh process's state
    torch.manual_seed(0)
    B, T, H, D = 1, 70, 2, 16
    base = [F.normalize(torch.randn(B, T, H, D), dim=-1), F.normalize(torch.randn(B, T, H, D), dim=-1),
            torch.randn(B, T, H, D), -F.softplus(torch.randn(B, T, H)), torch.rand(B, T, H)]
    runs = []
    for on in (False, True):
        xs = [x.clone().requires_grad_() for x in base]
        with caplog.at_level(logging.WARNING, logger="tcal.ops.dispatch"), ops.compile_training(on):
            o, s = ops.gated_delta_rule(*xs, output_final_state=True, backend="chunk", chunk_size=32)
        if on and any("torch.compile of the chunked GDN path failed" in r.getMessage() for r in caplog.records):
            pytest.skip("torch.compile does not work on this machine (see the warning)")
        (o.square().sum() + s.sum()).backward()
        runs.append((o.detach(), s.detach(), [x.grad for x in xs]))
    assert ops.set_compile(False) is False  # compile_training put the previous setting back
    (o0, s0, g0), (o1, s1, g1) = runs
    assert_close(o1, o0, 1e-4, "compiled vs eager output")
    assert_close(s1, s0, 1e-4, "compiled vs eager state")
    for name, a, b in zip(["q", "k", "v", "g", "beta"], g1, g0):
        assert_close(a, b, 1e-4, f"compiled vs eager grad {name}")
