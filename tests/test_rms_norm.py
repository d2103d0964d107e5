import pytest
import torch

from conftest import DEVICE
from helpers import ELEMENTWISE_DTYPES, TOL_VS_CONTRACT, TOL_VS_EXACT, randn
from fuselm import RMSNorm, add_rms_norm, rms_norm
from fuselm.ops.rms_norm import add_rms_norm_forward, add_rms_norm_ref, rms_norm_forward, rms_norm_ref
from fuselm.testing import assert_close, poisoned_like

SHAPES = [(1, 64), (3, 1000), (17, 257), (2, 5, 96)]
OFFSETS = [0.0, 1.0]


def exact(x, weight, eps, offset):
    """RMSNorm in float64 with no intermediate rounding; differentiable."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_forward(shape, dtype, offset):
    x = randn(*shape, dtype=dtype, scale=2)
    weight = randn(shape[-1], dtype=dtype) * 0.5 + (1 - offset)
    out = rms_norm_forward(x, weight, 1e-6, offset, out=poisoned_like(x))
    assert not out.isnan().any(), "an output element was not written"
    assert_close(out, exact(x, weight, 1e-6, offset), TOL_VS_EXACT[dtype])
    assert_close(out, rms_norm_ref(x, weight, 1e-6, offset), TOL_VS_CONTRACT[dtype])


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_forward(shape, dtype, offset):
    x, residual = randn(*shape, dtype=dtype, scale=2), randn(*shape, dtype=dtype, scale=2)
    weight = randn(shape[-1], dtype=dtype) * 0.5 + (1 - offset)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = add_rms_norm_forward(
        x, residual, weight, 1e-5, offset, out=poisoned_like(x), residual_out=poisoned_like(x)
    )
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"
    ref_normed, ref_residual = add_rms_norm_ref(x, residual, weight, 1e-5, offset)
    assert_close(new_residual, ref_residual, TOL_VS_CONTRACT[dtype], "new_residual")
    assert_close(normed, ref_normed, TOL_VS_CONTRACT[dtype], "normed")
    s_exact = x.double() + residual.double()
    assert_close(new_residual, s_exact, TOL_VS_EXACT[dtype], "new_residual")
    assert_close(normed, exact(s_exact, weight, 1e-5, offset), TOL_VS_EXACT[dtype], "normed")


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_rms_norm_backward(shape, dtype, offset):
    x, grad = randn(*shape, dtype=dtype, scale=2), randn(*shape, dtype=dtype)
    weight = randn(shape[-1], dtype=dtype) * 0.5 + (1 - offset)
    xg, wg = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    rms_norm(xg, wg, 1e-6, offset).backward(grad)
    x64, w64 = x.double().requires_grad_(True), weight.double().requires_grad_(True)
    exact(x64, w64, 1e-6, offset).backward(grad.double())
    assert_close(xg.grad, x64.grad, TOL_VS_EXACT[dtype], "dx")
    assert_close(wg.grad, w64.grad, TOL_VS_EXACT[dtype], "dweight")


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_add_rms_norm_backward(dtype, offset):
    shape = (13, 300)
    x, residual = randn(*shape, dtype=dtype, scale=2), randn(*shape, dtype=dtype, scale=2)
    grad_normed, grad_residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    weight = randn(shape[-1], dtype=dtype) * 0.5 + (1 - offset)
    leaves = [t.clone().requires_grad_(True) for t in (x, residual, weight)]
    normed, new_residual = add_rms_norm(*leaves, 1e-6, offset)
    torch.autograd.backward((normed, new_residual), (grad_normed, grad_residual))
    leaves64 = [t.double().requires_grad_(True) for t in (x, residual, weight)]
    s = leaves64[0] + leaves64[1]
    torch.autograd.backward((exact(s, leaves64[2], 1e-6, offset), s), (grad_normed.double(), grad_residual.double()))
    for name, got, want in zip(("dx", "dresidual", "dweight"), leaves, leaves64):
        assert_close(got.grad, want.grad, TOL_VS_EXACT[dtype], name)


def test_weight_in_fp32_with_half_input():
    x = randn(4, 128, dtype=torch.float16)
    weight = randn(128, dtype=torch.float32)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float16
    assert_close(out, rms_norm_ref(x, weight, 1e-6), TOL_VS_CONTRACT[torch.float16])


def test_module_plain_and_fused():
    norm = RMSNorm(96, eps=1e-6, zero_centered=True, device=DEVICE)
    assert torch.all(norm.weight == 0) and norm.offset == 1.0
    x, residual = randn(3, 96), randn(3, 96)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6, 1.0))
    normed, new_residual = norm(x, residual)
    assert torch.equal(normed, rms_norm(x + residual, norm.weight, 1e-6, 1.0))
    assert torch.equal(new_residual, x + residual)


def test_zero_size_and_large_values():
    empty = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert rms_norm(empty, weight).shape == (0, 64)
    normed, new_residual = add_rms_norm(empty, empty, weight)
    assert normed.shape == new_residual.shape == (0, 64)
    x = randn(2, 64, dtype=torch.float16, scale=1e4)  # x^2 overflows fp16, not the fp32 sum
    assert x.isfinite().all() and (x.float() ** 2).max() > 65504
    assert_close(rms_norm(x, weight.half()), exact(x, weight, 1e-6, 0.0), TOL_VS_EXACT[torch.float16])


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("n_rows", [1, 8192])
def test_large_shapes_bf16(n_rows, offset):
    x, residual = randn(n_rows, 4096, dtype=torch.bfloat16), randn(n_rows, 4096, dtype=torch.bfloat16)
    weight = randn(4096, dtype=torch.bfloat16)
    assert_close(rms_norm(x, weight, 1e-6, offset), rms_norm_ref(x, weight, 1e-6, offset), TOL_VS_CONTRACT[torch.bfloat16])
    for got, ref in zip(add_rms_norm(x, residual, weight, 1e-6, offset), add_rms_norm_ref(x, residual, weight, 1e-6, offset)):
        assert_close(got, ref, TOL_VS_CONTRACT[torch.bfloat16])
