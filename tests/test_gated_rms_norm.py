"""gated_rms_norm (HF's Qwen3_5RMSNormGated): forward against HF's steps in the same dtype (the
reference rounds where HF rounds), gradients against float64 autograd, odd shapes (a partial row
block, D not a power of two), strided rows, poisoned outputs of the kernels, bad input, compile."""

import pytest
import torch

from conftest import DEVICE, ON_GPU
from helpers import TOL_VS_CONTRACT, randn
from fuselm.ops.gated_rms_norm import gated_rms_norm, gated_rms_norm_ref
from fuselm.ops.gated_rms_norm import kernels as gk
from fuselm.testing import assert_close

TOL_GRAD = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def inputs(shape, dtype, weight_dtype=None):
    x, gate = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, scale=2.0)
    weight = (1.0 + 0.3 * torch.randn(shape[-1])).to(DEVICE, weight_dtype or dtype)
    return x, gate, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(37, 128), (2, 5, 3, 96), (1, 100)])
def test_forward_is_hf_and_gradients_match_float64(dtype, shape):
    x, gate, weight = inputs(shape, dtype)
    dy = randn(*shape, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, gate, weight)]
    y = gated_rms_norm(*leaves, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, gated_rms_norm_ref(x, gate, weight, 1e-6), TOL_VS_CONTRACT[dtype], "y vs HF's steps")
    y.backward(dy)
    exact = [t.detach().double().requires_grad_(True) for t in (x, gate, weight)]
    gated_rms_norm_ref(*exact, 1e-6).backward(dy.double())
    for name, got, want in zip(("dx", "dgate", "dweight"), (t.grad for t in leaves), (t.grad for t in exact)):
        assert got.dtype == dtype
        assert_close(got, want, TOL_GRAD[dtype], name)


def test_fp32_weight_with_16bit_rows_is_not_rounded_between():
    """HF promotes weight * n to fp32 when the weight is fp32: no rounding of h."""
    x, gate, weight = inputs((9, 64), torch.float16, weight_dtype=torch.float32)
    assert_close(gated_rms_norm(x, gate, weight), gated_rms_norm_ref(x, gate, weight), TOL_VS_CONTRACT[torch.float16])


def test_strided_rows_and_poisoned_outputs(monkeypatch):
    """x and gate as column slices of wider tensors; the kernels' outputs allocated NaN-filled."""
    real_empty = torch.empty
    monkeypatch.setattr(gk.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    wide = randn(21, 300)
    x, gate = wide[:, :128], wide[:, 150:278]
    weight = randn(128)
    leaves = [x.clone().requires_grad_(True), gate.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    y = gated_rms_norm(wide[:, :128], wide[:, 150:278], weight)
    assert_close(y, gated_rms_norm_ref(x, gate, weight), 1e-6)
    gated_rms_norm(*leaves).sum().backward()
    exact = [t.detach().double().requires_grad_(True) for t in (x, gate, weight)]
    gated_rms_norm_ref(*exact).sum().backward()
    for got, want in zip(leaves, exact):
        assert_close(got.grad, want.grad, 1e-5)


@pytest.mark.parametrize("call, error, match", [
    (lambda: gated_rms_norm(randn(4, 8), randn(4, 7), randn(8)), ValueError, "gate: expected"),
    (lambda: gated_rms_norm(randn(4, 8), randn(4, 8, dtype=torch.float16), randn(8)), ValueError, "gate: expected"),
    (lambda: gated_rms_norm(randn(4, 8), randn(4, 8), randn(7)), ValueError, "weight: expected"),
    (lambda: gated_rms_norm(randn(4, 8), randn(4, 8), randn(8), eps=-1.0), ValueError, "eps"),
    (lambda: gated_rms_norm(randn(4, 8), randn(4, 8), randn(8), eps=float("nan")), ValueError, "eps"),
    (lambda: gated_rms_norm(randn(4, 8).double(), randn(4, 8).double(), randn(8)), TypeError, "x"),
    (lambda: gated_rms_norm(randn(4, 8), randn(4, 8), torch.zeros(8, device="meta")), ValueError, "one device"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_no_rows():
    x = randn(0, 16).requires_grad_(True)
    y = gated_rms_norm(x, randn(0, 16), randn(16))
    assert y.shape == (0, 16)


def test_compile_fullgraph_and_opcheck():
    x, gate, weight = inputs((7, 32), torch.float32)
    torch.library.opcheck(torch.ops.fuselm.gated_rms_norm, (x.requires_grad_(True), gate, weight, 1e-6))

    def f(x, gate, weight):
        return gated_rms_norm(x, gate, weight).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    a = [t.detach().clone().requires_grad_(True) for t in (x, gate, weight)]
    b = [t.detach().clone().requires_grad_(True) for t in (x, gate, weight)]
    torch.testing.assert_close(compiled(*a), f(*b))
    compiled(*a).backward()
    f(*b).backward()
    for u, v in zip(a, b):
        torch.testing.assert_close(u.grad, v.grad)
