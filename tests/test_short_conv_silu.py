"""short_conv_silu (the Gated DeltaNet short convolution for training): forward and gradients
against float64 PyTorch (``short_conv_silu_ref`` under autograd), odd shapes (several time and
channel blocks, partial ones, T < K), a strided input, bad input."""

import pytest
import torch

from conftest import DEVICE
from helpers import randn
from fuselm.ops.causal_conv1d import short_conv_silu, short_conv_silu_ref
from fuselm.testing import assert_close

TOL_OUT = {torch.float32: 1e-5, torch.float16: 2e-3}
TOL_GRAD = {torch.float32: 1e-5, torch.float16: 2e-3}


def exact(x, weight, dy):
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight)]
    y = short_conv_silu_ref(*leaves)
    y.backward(dy.double())
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B, T, C, K", [(2, 70, 200, 4), (1, 3, 40, 4), (3, 65, 130, 3)])
def test_forward_and_grads_vs_float64(dtype, B, T, C, K):
    x = randn(B, T, C, dtype=dtype)
    weight = randn(C, K, dtype=dtype, scale=0.5)
    dy = randn(B, T, C, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight)]
    y = short_conv_silu(*leaves)
    y.backward(dy)
    want, (dx_want, dw_want) = exact(x, weight, dy)
    assert y.dtype == dtype and y.shape == (B, T, C) and y.is_contiguous()
    assert_close(y, want, TOL_OUT[dtype], "y")
    assert_close(leaves[0].grad, dx_want, TOL_GRAD[dtype], "dx")
    assert_close(leaves[1].grad, dw_want, TOL_GRAD[dtype], "dw")


def test_strided_input_and_hf_weight_shape():
    """x as the conv slice of a wider projection (token stride > C), weight [C, 1, K] as HF's."""
    wide = randn(2, 33, 300)
    x = wide[..., 50:250]
    weight = randn(200, 1, 4, scale=0.5)
    dy = randn(2, 33, 200)
    xl, wl = wide.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    y = short_conv_silu(xl[..., 50:250], wl)
    y.backward(dy)
    want, (dx_want, dw_want) = exact(x, weight.squeeze(1), dy)
    assert_close(y, want, 1e-5, "y")
    assert_close(xl.grad[..., 50:250], dx_want, 1e-5, "dx")
    assert torch.all(xl.grad[..., :50] == 0) and torch.all(xl.grad[..., 250:] == 0)
    assert wl.grad.shape == (200, 1, 4)
    assert_close(wl.grad.squeeze(1), dw_want, 1e-5, "dw")


def test_no_grad_equals_grad_forward():
    x, weight = randn(2, 40, 64), randn(64, 4)
    with torch.no_grad():
        plain = short_conv_silu(x, weight)
    assert torch.equal(plain, short_conv_silu(x.clone().requires_grad_(True), weight).detach())


@pytest.mark.parametrize("call, error, match", [
    (lambda: short_conv_silu(randn(2, 5, 8).transpose(1, 2), randn(5, 4)), ValueError, "x: expected"),
    (lambda: short_conv_silu(randn(2, 5), randn(5, 4)), ValueError, "x: expected"),
    (lambda: short_conv_silu(randn(2, 5, 8), randn(7, 4)), ValueError, "weight: expected"),
    (lambda: short_conv_silu(randn(2, 5, 8), randn(8, 4, dtype=torch.float16)), TypeError, "weight: dtype"),
    (lambda: short_conv_silu(randn(2, 5, 8).to(torch.int32), randn(8, 4)), TypeError, "x"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_device_mismatch():
    with pytest.raises(ValueError, match="one device"):
        short_conv_silu(randn(1, 4, 8), torch.zeros(8, 4, device="meta"))


def test_empty():
    x = randn(2, 0, 8).requires_grad_(True)
    y = short_conv_silu(x, randn(8, 4))
    assert y.shape == (2, 0, 8) and y.device.type == DEVICE.split(":")[0]


def test_compile_fullgraph_and_opcheck():
    from conftest import ON_GPU

    x, weight = randn(2, 19, 48), randn(48, 4, scale=0.5)
    torch.library.opcheck(torch.ops.fuselm.short_conv_silu, (x.clone().requires_grad_(True), weight))

    def f(x, weight):
        return short_conv_silu(x, weight).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    a = [t.clone().requires_grad_(True) for t in (x, weight)]
    b = [t.clone().requires_grad_(True) for t in (x, weight)]
    torch.testing.assert_close(compiled(*a), f(*b))
    compiled(*a).backward()
    f(*b).backward()
    for u, v in zip(a, b):
        torch.testing.assert_close(u.grad, v.grad)
