"""Swap-FFN reference against its definition (the README, models/swap_ffn.py), on tiny configs."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from fuselm import SwapFFN, SwapFFNConfig, SwapFFNState
from fuselm.models.swap_ffn import IDENTITY_STREAM_MAP, move_to_front, pack_lanes, unpack_lanes
from fuselm.testing import assert_close, rel_err

TINY = SwapFFNConfig(d_model=16, d_ff=24, n_cores=6, n_events=3, k_ffn=2, d_router=8, d_core_embed=4,
                     collapse_k=3, collapse_r=5)


def tiny(**overrides) -> SwapFFN:
    torch.manual_seed(0)
    cfg = SwapFFNConfig(**{**TINY.__dict__, **overrides})
    return SwapFFN(cfg, device=DEVICE, dtype=torch.float32)


def test_state_dict_names_are_the_spec():
    names = set(tiny().state_dict())
    assert names == {
        "core_embed.weight", "core_scale.weight", "core_scale.bias", "core_shift.weight", "core_shift.bias",
        "core_alpha.weight", "core_alpha.bias", "router_norm.weight", "router_w", "router_swap_w", "router_swap_b",
        "bank_w", "bank_b", "norm.weight", "w1.weight", "w3.weight", "w2.weight", "collapse_basis", "collapse_decoder",
    }


def test_initial_state():
    state = tiny().init_state(3)
    assert state.ram.shape == (3, 6, 4, 16) and state.ram.dtype == torch.float32 and not state.ram.any()
    assert state.stream_map.shape == (3, 6) and state.stream_map.dtype == torch.uint8
    assert torch.all(state.stream_map == IDENTITY_STREAM_MAP)
    assert torch.equal(unpack_lanes(state.stream_map[0, 0]), torch.arange(4, device=DEVICE))


def test_lanes_pack_and_move_to_front():
    perms = torch.tensor(list(itertools.permutations(range(4))), device=DEVICE)
    assert torch.equal(unpack_lanes(pack_lanes(perms)), perms)
    lanes = torch.tensor([[2, 0, 3, 1]] * 4, device=DEVICE)
    moved = move_to_front(lanes, torch.arange(4, device=DEVICE))
    assert moved.tolist() == [[2, 0, 3, 1], [0, 2, 3, 1], [3, 2, 0, 1], [1, 2, 0, 3]]


def test_stream_map_stays_a_permutation_and_both_decisions_occur():
    module = tiny()
    x = torch.randn(2, 5, 16, device=DEVICE) * 3
    _, state = module(x)
    lanes = unpack_lanes(state.stream_map)
    assert torch.equal(lanes.sort(-1).values, torch.arange(4, device=DEVICE).expand_as(lanes))
    assert (state.stream_map != IDENTITY_STREAM_MAP).any(), "no core ever swapped: the test would be vacuous"
    assert (state.ram == 0).all(-1).any(), "every bank was written: no core ever kept its activation"


def test_multi_token_equals_token_by_token():
    module = tiny()
    x = torch.randn(2, 4, 16, device=DEVICE)
    y_all, state_all = module(x)
    state = None
    for t in range(4):
        y_t, state = module(x[:, t], state)
        torch.testing.assert_close(y_t, y_all[:, t], rtol=0, atol=0)
    assert torch.equal(state.ram, state_all.ram) and torch.equal(state.stream_map, state_all.stream_map)


def test_state_untouched_unless_inplace():
    module = tiny()
    x = torch.randn(1, 2, 16, device=DEVICE)
    state = module.init_state(1)
    _, new_state = module(x, state)
    assert not state.ram.any() and torch.all(state.stream_map == IDENTITY_STREAM_MAP)
    returned = module(x, state, inplace=True)[1]
    assert returned is state
    assert torch.equal(state.ram, new_state.ram) and torch.equal(state.stream_map, new_state.stream_map)


@pytest.mark.parametrize("ffn_residual", [False, True])
def test_ffn_residual(ffn_residual):
    """With w2 = 0 the FFN output is 0: x is replaced by 0 (no residual) or kept (residual)."""
    module = tiny(ffn_residual=ffn_residual, n_events=1)
    with torch.no_grad():
        module.w2.weight.zero_()
    x_tok = torch.randn(2, 16, device=DEVICE)
    y, _ = module(x_tok)
    if ffn_residual:
        assert not torch.allclose(y, x_tok)
    else:
        torch.testing.assert_close(y, x_tok, rtol=0, atol=0)  # x = 0 after the FFN: delta = silu(0) = 0


@pytest.mark.parametrize("collapse_silu", [True, False])
def test_collapse(collapse_silu):
    module = tiny(collapse_silu=collapse_silu)
    x_tok, x = torch.randn(2, 16, device=DEVICE), torch.randn(2, 6, 16, device=DEVICE)
    _, _, core_alpha = module.core_params()
    code = torch.zeros(2, 5, device=DEVICE)
    for c in range(6):  # the spec's einsums, written as loops
        for k in range(3):
            code += core_alpha[c, k] * (module.collapse_basis[k] @ x[:, c].T).T
    code = F.silu(code) if collapse_silu else code
    torch.testing.assert_close(module.collapse(x_tok, x, core_alpha), x_tok + code @ module.collapse_decoder.T)


def test_gradients_flow_through_the_values():
    module = tiny()
    y, _ = module(torch.randn(2, 3, 16, device=DEVICE))
    y.square().sum().backward()
    params = dict(module.named_parameters())
    for name in ("w1.weight", "w3.weight", "w2.weight", "collapse_basis", "core_embed.weight", "norm.weight"):
        assert params[name].grad.abs().sum() > 0, name
    for name in ("router_w", "router_swap_w", "bank_w"):  # they only feed the hard decisions
        assert params[name].grad is None, name


@pytest.mark.parametrize("change, error, match", [
    (lambda m, x, s: m(x[..., :8], s), ValueError, "x: last dim 8"),
    (lambda m, x, s: m(x.double(), s), TypeError, "x: dtype"),
    (lambda m, x, s: m(x[0, 0], s), ValueError, "x: expected"),
    (lambda m, x, s: m(x, SwapFFNState(s.ram[:, :3], s.stream_map)), ValueError, "state.ram: expected shape"),
    (lambda m, x, s: m(x, SwapFFNState(s.ram.half(), s.stream_map)), TypeError, "state.ram: expected dtype"),
    (lambda m, x, s: m(x, SwapFFNState(s.ram, s.stream_map.long())), TypeError, "state.stream_map: expected dtype"),
    (lambda m, x, s: m(x, SwapFFNState(s.ram.to("meta"), s.stream_map)), ValueError, "state.ram: on meta"),
    (lambda m, x, s: m(x, SwapFFNState(s.ram, torch.zeros_like(s.stream_map))), ValueError, "not a permutation"),
    (lambda m, x, s: m(x, (s.ram, s.stream_map)), TypeError, "state: expected a SwapFFNState"),
    (lambda m, x, s: m(x, s, impl="triton"), ValueError, "impl"),
])
def test_bad_input_leaves_state_intact(change, error, match):
    module = tiny()
    state = module.init_state(2)
    module(torch.randn(2, 2, 16, device=DEVICE), state, inplace=True)  # a non-trivial state
    before = state.clone()
    with pytest.raises(error, match=match):
        change(module, torch.randn(2, 3, 16, device=DEVICE), state)
    assert torch.equal(state.ram, before.ram) and torch.equal(state.stream_map, before.stream_map)


# ----------------------------------------------------------------------------- fused path
FUSED_CFG = dict(d_model=32, d_ff=48, n_cores=20, n_events=3, d_router=16, collapse_k=3, collapse_r=5)


@pytest.mark.parametrize("ffn_residual", [False, True])
def test_fused_matches_reference_in_fp32(ffn_residual):
    """Full-precision dots: the fused path takes exactly the reference's decisions."""
    module = tiny(**FUSED_CFG, ffn_residual=ffn_residual)
    x = torch.randn(2, 4, 32, device=DEVICE) * 2
    y_ref, state_ref = module(x, impl="reference")
    y_fused, state_fused = module(x, impl="fused")
    assert (state_ref.stream_map != IDENTITY_STREAM_MAP).float().mean() > 0.3, "too few swaps to test"
    assert torch.equal(state_fused.stream_map, state_ref.stream_map), "different swap/bank decisions"
    assert ((state_fused.ram == 0) == (state_ref.ram == 0)).all(), "different banks written"
    assert_close(y_fused, y_ref, 1e-4, "y")
    assert_close(state_fused.ram, state_ref.ram, 1e-4, "ram")


def test_decoder_steps_match_forward():
    from fuselm import SwapFFNDecoder

    module = tiny(**FUSED_CFG)
    x = torch.randn(2, 3, 32, device=DEVICE)
    y_ref, state_ref = module(x, impl="reference")
    decoder = SwapFFNDecoder(module, batch=2)
    for t in range(3):
        assert_close(decoder.step(x[:, t]), y_ref[:, t], 1e-4, f"token {t}")
    assert torch.equal(decoder.state.stream_map, state_ref.stream_map)
    with pytest.raises(ValueError, match="x_tok"):
        decoder.step(x[:1, 0])


def test_fused_needs_16_byte_rows():
    """d_ff = 26 fp32 floats is not a whole number of 16-byte units: a clear error for "fused",
    the reference for "auto"."""
    module = tiny(d_ff=26)
    x = torch.randn(1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="d_ff: the fused path needs multiples of 4"):
        module(x, impl="fused")
    if DEVICE == "cuda":
        with torch.no_grad():
            assert_close(module(x)[0], module(x, impl="reference")[0], 0.0, "auto")


def test_fused_needs_cuda_or_the_interpreter(monkeypatch):
    import fuselm.models.swap_ffn as swap_ffn

    monkeypatch.setattr(swap_ffn, "use_triton", lambda t: False)
    module = tiny()
    with pytest.raises(ValueError, match="impl='fused' needs CUDA"):
        module(torch.randn(1, 16, device=DEVICE), impl="fused")


@pytest.mark.parametrize("blocks", [None, (8, 16)])
def test_router_agreement_is_total_in_fp32(blocks, monkeypatch):
    """Also with row and dot steps smaller than d_model (the kernel's D loops)."""
    import fuselm.ops.swap_ffn.kernels as kernels

    if blocks:
        monkeypatch.setattr(kernels, "ROUTER_BLOCK_ROW", blocks[0])
        monkeypatch.setattr(kernels, "ROUTER_BLOCK_K", blocks[1])
    module = tiny(**FUSED_CFG)
    state = module.init_state(2)
    _, state = module(torch.randn(2, 2, 32, device=DEVICE), state, impl="reference")
    assert module.router_agreement(torch.randn(2, 32, device=DEVICE), state.ram, state.stream_map) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_core_x_rounds_as_the_reference(dtype):
    """x [B*C, D] = x_tok[:, None] * core_scale + core_shift with the product and the sum each rounded,
    from token rows with a row stride; every element of the poisoned output written. (bf16 on the
    GPU only: the interpreter truncates fp32 -> bf16 instead of rounding to nearest.)"""
    from fuselm.ops.swap_ffn.kernels import core_x

    B, C, D = 3, 5, 40
    x_tok = torch.randn(B, 2, D + 8, device=DEVICE, dtype=dtype)[:, 1, 4:4 + D]
    scale = torch.randn(C, D, device=DEVICE, dtype=dtype)
    shift = torch.randn(C, D, device=DEVICE, dtype=dtype)
    x = torch.full((B * C, D), float("nan"), device=DEVICE, dtype=dtype)
    core_x(x, x_tok, scale, shift)
    ref = (x_tok[:, None, :] * scale + shift).reshape(B * C, D)
    assert_close(x, ref, 1e-6 if dtype == torch.float32 else 0.0, "core_x")  # fp32: an FMA may fuse the two


def _ffn_step_ref(x, w13, w2, ss, eps, residual):
    """float64 reference of FFNStep with the kernels' rounding points: G, U, SiLU(G), h and x rounded
    to x's dtype; rstd from the given row sums of squares."""
    dt = x.dtype
    rstd = torch.rsqrt(ss.double() / x.shape[1] + eps)[:, None]
    gu = x.double() @ w13.double().T * rstd
    g, u = gu[:, 0::2].to(dt).double(), gu[:, 1::2].to(dt).double()
    h = (F.silu(g).to(dt).double() * u).to(dt)
    f = (h.double() @ w2.double().T).to(dt)
    x_new = (x.double() + f.double()).to(dt) if residual else f
    return h, x_new


GEMM_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("ss_source", ["given", "k_loop", "pass"])
def test_ffn_step(dtype, residual, ss_source):
    """FFNStep on an odd row count, tiles that do not divide D or F and persistent programs walking
    several tiles: h (poisoned before) and the new x against a float64 reference, with rstd from
    given sums of squares, summed in the kernel's K loop, or by a separate pass; twice in a row."""
    from fuselm.ops.swap_ffn import FFNStep
    from fuselm.ops.swap_ffn.kernels import GateUpConfig

    M, D, Fd = 37, 40, 56
    x = torch.randn(M, D, device=DEVICE, dtype=dtype)
    w13 = (torch.randn(2 * Fd, D, device=DEVICE) * D**-0.5).to(dtype)
    w2 = (torch.randn(D, Fd, device=DEVICE) * Fd**-0.5).to(dtype)
    h = torch.full((M, Fd), float("nan"), device=DEVICE, dtype=dtype)
    step = FFNStep(x, w13, h, w2, 1e-6, residual, config=GateUpConfig(16, 16, 16, 2, 4, 1, True))
    step.programs = 3  # fewer programs than tiles
    step.ss_in_loop = ss_source == "k_loop"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for call in range(2):
        ss = x.float().pow(2).sum(1)
        h_ref, x_ref = _ffn_step_ref(x, w13, w2, ss, 1e-6, residual)
        step.step(ss if ss_source == "given" else None)
        assert_close(h, h_ref, tol, f"h, call {call}")
        assert_close(x, x_ref, tol, f"x, call {call}")


@pytest.mark.gpu
@pytest.mark.large
def test_seed_config_bf16_decision_agreement():
    """bf16: the router kernel decides as the reference on the reference's own state (>= 99% of
    decisions; a rounding-boundary logit can flip). Free-running agreement is reported: one
    flip changes a core's whole future, so it decays over tokens."""
    torch.manual_seed(0)
    module = SwapFFN(SwapFFNConfig(), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4, 1024, device="cuda", dtype=torch.bfloat16)
    ref_state = fused_state = None
    for t in range(4):
        if ref_state is not None:
            agreement = module.router_agreement(x[:, t], ref_state.ram, ref_state.stream_map)
            print(f"token {t}: router decisions agreeing {agreement:.4f}")
            assert agreement >= 0.99
        y_ref, ref_state = module(x[:, t], ref_state, impl="reference")
        y_fused, fused_state = module(x[:, t], fused_state, impl="fused")
        free = (ref_state.stream_map == fused_state.stream_map).float().mean().item()
        print(f"token {t}: free-running stream-map agreement {free:.4f}, y rel err {rel_err(y_fused, y_ref):.3e}")
