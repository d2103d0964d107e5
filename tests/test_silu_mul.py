import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from helpers import ELEMENTWISE_DTYPES, TOL_VS_CONTRACT, TOL_VS_EXACT, randn
from fuselm import Activation, SiLUMul, silu_mul
from fuselm.ops.common.activation import gate_factor_ref, up_factor_ref
from fuselm.ops.silu_mul import silu_mul_backward, silu_mul_backward_ref, silu_mul_forward, silu_mul_ref
from fuselm.testing import assert_close, poisoned_like

ACTIVATIONS = [Activation(), Activation.swiglu_limit(2.5), Activation.swiglu_oai(limit=2.0, alpha=1.702)]
ACT_IDS = ["silu", "limit", "oai"]
SHAPES = [(1, 7), (3, 1000), (17, 1029), (2, 3, 257)]


def exact(gate, up, act):
    """The function in float64, no intermediate rounding; differentiable."""
    return gate_factor_ref(gate.double(), act) * up_factor_ref(up.double(), act)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype, act):
    gate, up = randn(*shape, dtype=dtype, scale=3), randn(*shape, dtype=dtype, scale=3)
    out = silu_mul_forward(gate, up, act, out=poisoned_like(gate))
    assert not out.isnan().any(), "an output element was not written"
    assert_close(out, exact(gate, up, act), TOL_VS_EXACT[dtype])
    assert_close(out, silu_mul_ref(gate, up, act), TOL_VS_CONTRACT[dtype])


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_backward_matches_autograd(shape, dtype, act):
    gate, up, grad = (randn(*shape, dtype=dtype, scale=3) for _ in range(3))
    g = gate.clone().requires_grad_(True)
    u = up.clone().requires_grad_(True)
    silu_mul(g, u, act).backward(grad)
    g64 = gate.double().requires_grad_(True)
    u64 = up.double().requires_grad_(True)
    exact(g64, u64, act).backward(grad.double())
    assert_close(g.grad, g64.grad, TOL_VS_EXACT[dtype], "d_gate")
    assert_close(u.grad, u64.grad, TOL_VS_EXACT[dtype], "d_up")
    d_gate_ref, d_up_ref = silu_mul_backward_ref(grad, gate, up, act)
    assert_close(g.grad, d_gate_ref, TOL_VS_CONTRACT[dtype], "d_gate")
    assert_close(u.grad, d_up_ref, TOL_VS_CONTRACT[dtype], "d_up")


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("n_rows, n_cols", [(4, 11009), (3, 14337), (2, 1024), (5, 3)])
def test_geometries_are_bit_identical(n_rows, n_cols, dtype):
    """Row and column-tiled geometries differ only in launch shape: outputs and grads match exactly,
    also when the width is not a multiple of the tile (ragged last tile)."""
    act = Activation.swiglu_oai(limit=3.0)
    gate, up, grad = (randn(n_rows, n_cols, dtype=dtype, scale=3) for _ in range(3))
    results = {}
    for geometry in ("row", "tiled"):
        y = silu_mul_forward(gate, up, act, out=poisoned_like(gate), geometry=geometry)
        results[geometry] = (y, *silu_mul_backward(grad, gate, up, act, geometry=geometry))
    for name, a, b in zip(("out", "d_gate", "d_up"), results["row"], results["tiled"]):
        assert not a.isnan().any(), name
        assert torch.equal(a, b), f"{name}: row and tiled geometries differ"


def test_strided_halves_of_a_projection_need_no_copy():
    h = randn(5, 2 * 300, dtype=torch.float16, scale=2)
    gate, up = h[:, :300], h[:, 300:]
    assert not gate.is_contiguous()
    out = silu_mul(gate, up)
    assert torch.equal(out, silu_mul(gate.contiguous(), up.contiguous()))
    h_t = randn(300, 5, dtype=torch.float32).t()  # column stride != 1: copied, still right
    assert_close(silu_mul(h_t, h_t), exact(h_t, h_t, Activation()), 1e-6)


def test_nan_and_inf_propagate_like_the_reference():
    gate = randn(2, 64, dtype=torch.float32)
    up = randn(2, 64, dtype=torch.float32)
    gate[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    up[1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for act in ACTIVATIONS:
        assert_close(silu_mul(gate, up, act), silu_mul_ref(gate, up, act), 1e-6)


def test_clamp_passes_gradient_inside_and_at_the_limit_only():
    act = Activation.swiglu_limit(1.0)
    gate = torch.tensor([[0.5, 1.0, 1.5, -3.0]], device=DEVICE)
    up = torch.tensor([[0.5, 1.0, -1.0, -1.5]], device=DEVICE)
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    silu_mul(g, u, act).sum().backward()
    assert g.grad[0, 2] == 0 and g.grad[0, 0] != 0 and g.grad[0, 1] != 0
    assert u.grad[0, 3] == 0 and u.grad[0, 2] != 0 and u.grad[0, 1] != 0


def test_module_and_zero_size():
    module = SiLUMul(Activation.swiglu_limit(3.0))
    gate, up = randn(4, 33), randn(4, 33)
    assert torch.equal(module(gate, up), silu_mul(gate, up, Activation.swiglu_limit(3.0)))
    empty = torch.empty(0, 33, device=DEVICE)
    assert silu_mul(empty, empty).shape == (0, 33)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_rounds_like_hugging_face(dtype):
    """HF LlamaMLP computes act_fn(gate) * up in the model dtype; ours differs by exp ulps at most."""
    gate, up = randn(64, 4096, dtype=dtype, scale=3), randn(64, 4096, dtype=dtype, scale=3)
    ours, hf = silu_mul(gate, up), F.silu(gate) * up
    assert (ours != hf).float().mean().item() < 0.01
    assert_close(ours, hf, 4e-3)


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape", [(8192, 14336), (8192, 18944), (4096, 4096)])
def test_large_shapes_bf16(shape):
    gate, up, grad = (randn(*shape, dtype=torch.bfloat16, scale=3) for _ in range(3))
    assert_close(silu_mul_forward(gate, up, out=poisoned_like(gate)), silu_mul_ref(gate, up), TOL_VS_CONTRACT[torch.bfloat16])
    for got, ref in zip(silu_mul_backward(grad, gate, up), silu_mul_backward_ref(grad, gate, up)):
        assert_close(got, ref, TOL_VS_CONTRACT[torch.bfloat16])


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the reference (documented fallback)."""
    import fuselm.ops.silu_mul.op as op

    monkeypatch.setattr(op, "use_triton", lambda t: False)
    gate, up = torch.randn(3, 50), torch.randn(3, 50)
    assert torch.equal(silu_mul(gate, up), silu_mul_ref(gate, up))



def test_geometry_choice_per_architecture(monkeypatch):
    import fuselm.ops.silu_mul.kernels as kernels

    cuda = torch.device("cuda", 0)
    for major, n_cols, expected in [(9, 14336, "row"), (9, 4096, "row"), (10, 14336, "tiled"), (10, 4096, "row"),
                                    (9, 70000, "tiled"), (8, 18944, "row")]:
        kernels.choose_geometry.cache_clear()
        monkeypatch.setattr(kernels, "arch_major", lambda device, major=major: major)
        assert kernels.choose_geometry(n_cols, cuda) == kernels.GEOMETRIES[expected](n_cols), (major, n_cols)
    kernels.choose_geometry.cache_clear()
