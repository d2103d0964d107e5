"""Bad input gets a clear error naming the argument, before any kernel runs."""

import pytest
import torch

from conftest import DEVICE
from fuselm import Activation, add_rms_norm, rms_norm, silu_mul
from fuselm.ops.rms_norm import add_rms_norm_forward
from fuselm.ops.silu_mul import silu_mul_backward, silu_mul_forward


def t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


@pytest.mark.parametrize("call, error, match", [
    (lambda: silu_mul(t(2, 8), t(2, 9)), ValueError, "up: shape"),
    (lambda: silu_mul(t(2, 8), t(2, 8, dtype=torch.float16)), TypeError, "up: dtype"),
    (lambda: silu_mul(t(2, 8, dtype=torch.int32), t(2, 8, dtype=torch.int32)), TypeError, "gate: dtype int32"),
    (lambda: silu_mul(t(2, 8, dtype=torch.float64), t(2, 8, dtype=torch.float64)), TypeError, "gate: dtype float64"),
    (lambda: silu_mul([1.0], t(1)), TypeError, "gate: expected a torch.Tensor"),
    (lambda: silu_mul(t(2, 8), t(2, 8), "relu"), ValueError, "activation"),
    (lambda: silu_mul(t(2, 8), t(2, 8), "swiglu_limit"), ValueError, "needs a limit"),
    (lambda: Activation.swiglu_limit(-1.0), ValueError, "limit"),
    (lambda: Activation.swiglu_oai(limit=float("inf")), ValueError, "limit"),
    (lambda: Activation.swiglu_oai(alpha=0.0), ValueError, "alpha"),
    (lambda: silu_mul_forward(t(2, 8), t(2, 8), out=t(2, 7)), ValueError, "out: shape"),
    (lambda: silu_mul_forward(t(2, 8), t(2, 8), out=t(8, 2).t()), ValueError, "out: must be contiguous"),
    (lambda: silu_mul_forward(t(2, 8), t(2, 8), geometry="diagonal"), ValueError, "geometry"),
    (lambda: silu_mul_backward(t(2, 7), t(2, 8), t(2, 8)), ValueError, "grad: shape"),
    (lambda: rms_norm(t(2, 8), t(9)), ValueError, "weight: shape"),
    (lambda: rms_norm(t(2, 8), t(2, 8)), ValueError, "weight: shape"),
    (lambda: rms_norm(t(2, 8, dtype=torch.int64), t(8)), TypeError, "x: dtype int64"),
    (lambda: rms_norm(t(2, 8), t(8, dtype=torch.float64)), TypeError, "weight: dtype float64"),
    (lambda: rms_norm(t(2, 8), t(8), eps=-1.0), ValueError, "eps"),
    (lambda: rms_norm(t(2, 8), t(8), eps=float("nan")), ValueError, "eps"),
    (lambda: rms_norm(t(2, 8), t(8), offset="one"), TypeError, "offset"),
    (lambda: rms_norm(t(()), t(1)), ValueError, "x: must have at least one dimension"),
    (lambda: rms_norm(t(1, 70000), t(70000)), ValueError, "x: last dim 70000"),
    (lambda: add_rms_norm(t(2, 8), t(3, 8), t(8)), ValueError, "residual: shape"),
    (lambda: add_rms_norm(t(2, 8), t(2, 8, dtype=torch.float16), t(8)), TypeError, "residual: dtype"),
    (lambda: add_rms_norm_forward(t(2, 8), t(2, 8), t(8), residual_out=t(2, 8, dtype=torch.float16)), TypeError, "residual_out"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_tensors_on_different_devices():
    meta = torch.empty(2, 8, device="meta")
    with pytest.raises(ValueError, match="one device: gate on .*up on meta"):
        silu_mul(t(2, 8), meta)
    with pytest.raises(ValueError, match="one device"):
        rms_norm(t(2, 8), torch.empty(8, device="meta"))


def test_failed_call_leaves_out_buffer_untouched():
    out = torch.full((2, 8), 7.0, device=DEVICE)
    with pytest.raises(ValueError):
        silu_mul_forward(t(2, 8), t(2, 9), out=out)
    assert torch.all(out == 7.0)


def test_non_contiguous_inputs_are_handled():
    x = t(16, 6).t()  # [6, 16] with column stride 6
    weight = t(16)
    torch.testing.assert_close(rms_norm(x, weight), rms_norm(x.contiguous(), weight), rtol=0, atol=0)
    g = t(4, 3, 10)[:, 1]  # strided rows of a 3-D tensor
    torch.testing.assert_close(silu_mul(g, g), silu_mul(g.contiguous(), g.contiguous()), rtol=0, atol=0)
