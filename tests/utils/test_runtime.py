"""tf32_matmul on the CPU: bf16 products where oneDNN has them, the previous setting back afterwards."""
import pytest
import torch

from tcal.utils.runtime import cpu_bf16_products, fit_matmul_kind, tf32_matmul


def _mm():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 384, generator=g)
    return a, b, a.double() @ b.double()


def test_off_and_non_cpu_devices_leave_fp32_products_exact():
    a, b, ref = _mm()
    before = torch.backends.mkldnn.matmul.fp32_precision
    with tf32_matmul("cpu", on=False):
        out = a @ b
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-6  # fp32 rounding only


@pytest.mark.skipif(not cpu_bf16_products(), reason="this CPU has no bf16 unit oneDNN uses (AMX / AVX-512 BF16)")
def test_cpu_bf16_products_are_bf16_close_and_restored():
    a, b, ref = _mm()
    before = torch.backends.mkldnn.matmul.fp32_precision
    with tf32_matmul("cpu"):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        out = a @ b
        grad_ok = torch.nn.functional.linear(a, b.t())
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert out.dtype == torch.float32
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    # bf16 operands (8-bit mantissa, relative rounding 2^-9 each) with fp32 sums: about 3e-3 over random data;
    # far above fp32's 1e-7, so the products did change precision, far below anything a fit would notice
    assert 1e-5 < rel < 1e-2, rel
    assert ((grad_ok.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_an_error_inside_restores_the_setting():
    before = torch.backends.mkldnn.matmul.fp32_precision
    with pytest.raises(ValueError):
        with tf32_matmul("cpu"):
            raise ValueError("inside")
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_the_device_default_is_tf32_on_cuda_and_fp32_on_a_cpu():
    assert fit_matmul_kind("cuda", None) == "tf32" and fit_matmul_kind("cpu", None) == "fp32"
    assert fit_matmul_kind("cpu", True) == fit_matmul_kind("cpu") and fit_matmul_kind("cuda", False) == "fp32"
    assert fit_matmul_kind("cuda") == "tf32" and fit_matmul_kind("cuda", on=False) == "fp32"
    assert fit_matmul_kind("cpu") == ("bf16" if cpu_bf16_products() else "fp32")
    assert fit_matmul_kind("cpu", on=False) == "fp32"
