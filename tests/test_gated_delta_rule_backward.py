"""Backward of chunk_gated_delta_rule: the PyTorch chunk-wise reference (float64, exact) and the
Triton kernels (interpreter on CPU) against torch.autograd through the token recurrence in float64."""

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule_ref
from fuselm.ops.gated_delta_rule.chunk_backward_naive import (
    chunk_gated_delta_rule_backward_ref, recurrent_gated_delta_rule_autograd,
)
from fuselm.testing import rel_err

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}  # rel_err of each gradient


def inputs(B, T, H, HV, K, V, N=None, with_state=True, decay="mixed", l2=True):
    """fp32 q, k, v, g, beta, initial_state (or None); q, k scaled down without the l2 norm."""
    q, k = (torch.randn(B, T, H, K) * (1.0 if l2 else 0.3) for _ in range(2))
    v = torch.randn(B, T, HV, V)
    g = {"mixed": -torch.rand(B, T, HV) * 2, "strong": -10 + torch.rand(B, T, HV) * 0.5}[decay]
    beta = torch.rand(B, T, HV)
    h0 = torch.randn(B if N is None else N, HV, K, V) if with_state else None
    return [q, k, v, g, beta, h0]


def reference_grads(args, do, dht, **kw):
    """(o, final, grads of the six inputs) by torch.autograd through the recurrence in float64."""
    leaves = [None if t is None else t.double().requires_grad_(True) for t in args]
    o, ht = recurrent_gated_delta_rule_autograd(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    loss = (o * do).sum() + ((ht * dht).sum() if dht is not None else 0.0)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return o, ht, [None if t is None else next(grads) for t in leaves]


def kernel_grads(args, do, dht, dtype=torch.float32, gate_dtype=torch.float32, **kw):
    """(o, final, grads) of chunk_gated_delta_rule on DEVICE: q, k, v in ``dtype``, g and beta in
    ``gate_dtype``, the state fp32; loss = <o, do> + <final, dht>."""
    dtypes = (dtype,) * 3 + (gate_dtype,) * 2 + (torch.float32,)
    leaves = [None if t is None else t.to(DEVICE, d).detach().requires_grad_(True) for t, d in zip(args, dtypes)]
    o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=dht is not None, **kw)
    loss = (o.double() * do.to(DEVICE)).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht.to(DEVICE)).sum()
    loss.backward()
    return o, ht, [None if t is None else t.grad for t in leaves]


def assert_grads(got, ref, tol):
    for name, a, b in zip(NAMES, got, ref):
        if b is None:
            continue
        assert a is not None and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------- the PyTorch reference
@pytest.mark.parametrize("B, T, H, HV, K, V, cu", [
    (2, 37, 2, 4, 16, 32, None), (1, 130, 2, 2, 32, 16, None), (2, 1, 1, 2, 16, 16, None),
    (1, 130, 2, 4, 16, 16, [0, 37, 38, 130]), (1, 129, 1, 1, 16, 16, [0, 0, 64, 129]),
])
@pytest.mark.parametrize("l2", [False, True])
def test_reference_backward_is_exact(B, T, H, HV, K, V, cu, l2):
    """The chunk-wise backward by hand equals autograd through the token recurrence (float64)."""
    cu = None if cu is None else torch.tensor(cu)
    args = inputs(B, T, H, HV, K, V, N=None if cu is None else len(cu) - 1, l2=l2)
    do = torch.randn(B, T, HV, V, dtype=torch.float64)
    dht = torch.randn(*args[5].shape, dtype=torch.float64)
    kw = dict(scale=0.7, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    _, _, ref = reference_grads(args, do, dht, **kw)
    got = chunk_gated_delta_rule_backward_ref(*(t.double() for t in args[:5]), 0.7, args[5].double(), do, dht,
                                              l2, cu)
    assert_grads(got, ref, 1e-8)


def test_float64_recurrence_is_the_reference_recurrence():
    """The float64 autograd recurrence computes what recurrent_gated_delta_rule_ref does (fp32)."""
    args = inputs(1, 70, 2, 4, 16, 32, N=3)
    cu = torch.tensor([0, 20, 21, 70])
    o, ht = recurrent_gated_delta_rule_autograd(*(t.double() for t in args[:5]), None, args[5].double(), True, True, cu)
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(*args[:5], None, args[5], True, True, cu)
    assert rel_err(o, o_ref) <= 1e-6 and rel_err(ht, ht_ref) <= 1e-6


# ----------------------------------------------------------------------------- the Triton kernels
@pytest.mark.parametrize("T", [1, 37, 130])
def test_kernel_gradients(T):
    """All six gradients, GVA (H=2, HV=4), l2 norm, initial state, and a gradient into the final
    state; T = 37 and 130 end in a partial chunk."""
    args = inputs(2, T, 2, 4, 16, 32)
    do, dht = torch.randn(2, T, 4, 32, dtype=torch.float64), torch.randn(2, 4, 16, 32, dtype=torch.float64)
    kw = dict(use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref, ref = reference_grads(args, do, dht, **kw)
    o, ht, got = kernel_grads(args, do, dht, **kw)
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4
    assert_grads(got, ref, TOL[torch.float32])


@pytest.mark.parametrize("H, HV, K, V, with_state, l2, final, decay", [
    (2, 2, 32, 16, False, False, False, "mixed"),  # no GVA, no state, no l2, o only
    (1, 4, 16, 16, True, False, True, "strong"),   # one key head for four value heads, g near -10
    (2, 4, 32, 32, False, True, True, "mixed"),
])
def test_kernel_gradients_options(H, HV, K, V, with_state, l2, final, decay):
    args = inputs(1, 70, H, HV, K, V, with_state=with_state, decay=decay, l2=l2)
    do = torch.randn(1, 70, HV, V, dtype=torch.float64)
    dht = torch.randn(1, HV, K, V, dtype=torch.float64) if final else None
    kw = dict(scale=0.4, use_qk_l2norm_in_kernel=l2)
    _, _, ref = reference_grads(args, do, dht, **kw)
    _, _, got = kernel_grads(args, do, dht, **kw)
    assert_grads(got, ref, TOL[torch.float32])


def test_kernel_gradients_key_and_value_blocks(monkeypatch):
    """The gradient kernels with several key and value blocks of 16 columns (at the model's
    K = V = 128 they run 64-column blocks): K = 24 and V = 40 end in partial blocks."""
    import fuselm.ops.gated_delta_rule.chunk_backward as chunk_backward

    for name in ("DQKW_BLOCK_K", "WY_BLOCK_K"):
        monkeypatch.setattr(chunk_backward, name, 16)
    for name in ("DQKW_BLOCK_V", "WY_BLOCK_V"):
        monkeypatch.setattr(chunk_backward, name, {dtype: 16 for dtype in getattr(chunk_backward, name)})
    args = inputs(2, 70, 2, 4, 24, 40)
    do, dht = torch.randn(2, 70, 4, 40, dtype=torch.float64), torch.randn(2, 4, 24, 40, dtype=torch.float64)
    _, _, ref = reference_grads(args, do, dht, use_qk_l2norm_in_kernel=True)
    _, _, got = kernel_grads(args, do, dht, use_qk_l2norm_in_kernel=True)
    assert_grads(got, ref, TOL[torch.float32])


@pytest.mark.parametrize("cu", [[0, 37, 38, 130], [0, 64, 64, 130]])
def test_kernel_gradients_varlen(cu):
    """Packed sequences of different lengths (one token; one empty: its state gradient passes
    straight through), each with its own initial and final state."""
    cu = torch.tensor(cu, dtype=torch.int32)
    args = inputs(1, 130, 2, 4, 16, 32, N=3)
    do, dht = torch.randn(1, 130, 4, 32, dtype=torch.float64), torch.randn(3, 4, 16, 32, dtype=torch.float64)
    _, _, ref = reference_grads(args, do, dht, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    _, _, got = kernel_grads(args, do, dht, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.to(DEVICE))
    assert_grads(got, ref, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_kernel_gradients_half_precision(dtype):
    """16-bit q, k, v, g and beta (operands rounded as in the forward), fp32 state; bf16 only on
    a GPU (the interpreter's bf16 tl.dot is wrong)."""
    args = inputs(2, 130, 2, 4, 16, 32)
    args[:5] = [t.to(dtype) for t in args[:5]]
    do, dht = torch.randn(2, 130, 4, 32, dtype=torch.float64), torch.randn(2, 4, 16, 32, dtype=torch.float64)
    _, _, ref = reference_grads(args, do, dht, use_qk_l2norm_in_kernel=True)
    _, _, got = kernel_grads(args, do, dht, dtype, dtype, use_qk_l2norm_in_kernel=True)
    assert all(t.dtype == a.dtype for t, a in zip(got, args))
    assert_grads(got, ref, TOL[dtype])


@pytest.mark.gpu
def test_kernel_gradients_bf16_model_shape():
    """bf16 at a Qwen3.5-like head shape (K = V = 128, GVA), two sequences of 200 tokens."""
    args = inputs(2, 200, 2, 4, 128, 128)
    args[:3] = [t.to(torch.bfloat16) for t in args[:3]]
    do, dht = torch.randn(2, 200, 4, 128, dtype=torch.float64), torch.randn(2, 4, 128, 128, dtype=torch.float64)
    _, _, ref = reference_grads(args, do, dht, use_qk_l2norm_in_kernel=True)
    _, _, got = kernel_grads(args, do, dht, torch.bfloat16, use_qk_l2norm_in_kernel=True)
    assert_grads(got, ref, TOL[torch.bfloat16])


@pytest.mark.skipif(not ON_GPU, reason="the race was the GPU build's (the interpreter runs programs one by one)")
@pytest.mark.parametrize("dtype, B, T, H, HV", [(torch.float16, 3, 1024, 4, 4), (torch.bfloat16, 1, 4096, 16, 32)])
def test_kernel_gradients_are_deterministic(dtype, B, T, H, HV):
    """Two backward passes on the same inputs give bitwise-equal gradients (K = V = 128: kernel
    3a's loop over V, pipelined 3 deep, once wrote dW differently from run to run)."""
    args = [t if t is None else t.to(DEVICE) for t in inputs(B, T, H, HV, 128, 128)]
    args[:3] = [t.to(dtype) for t in args[:3]]
    do, dht = torch.randn(B, T, HV, 128, device=DEVICE, dtype=dtype), torch.randn(B, HV, 128, 128, device=DEVICE)
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_(True) for t in args]
        o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        ((o * do).sum() + (ht * dht).sum()).backward()
        runs.append([t.grad for t in leaves])
    for run in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], run):
            assert torch.equal(a, b), name


def test_kernel_gradients_on_poisoned_buffers(monkeypatch):
    """Every buffer of the forward and the backward (torch.empty / empty_like) starts as NaN: each
    one the kernels read must have been written. Also: only the final state is used, and only
    some inputs require a gradient."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    cu = torch.tensor([0, 37, 38, 100], dtype=torch.int32)
    args = inputs(1, 100, 2, 4, 16, 32, N=3)
    dht = torch.randn(3, 4, 16, 32, dtype=torch.float64)
    _, _, ref = reference_grads(args, torch.zeros(1, 100, 4, 32, dtype=torch.float64), dht,
                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    leaves = [t.to(DEVICE).requires_grad_(i in (1, 3, 5)) for i, t in enumerate(args)]
    _, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu.to(DEVICE))
    (ht.double() * dht.to(DEVICE)).sum().backward()
    assert leaves[0].grad is None and leaves[2].grad is None
    assert_grads([t.grad for t in leaves], [r if i in (1, 3, 5) else None for i, r in enumerate(ref)], 1e-3)


def test_no_grad_forward_unchanged():
    """Without autograd the forward runs as before; with it, the same o and final state."""
    args = [t.to(DEVICE) for t in inputs(2, 37, 2, 4, 16, 32)]
    kw = dict(initial_state=args[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        o0, ht0 = chunk_gated_delta_rule(*(t.requires_grad_(True) for t in args[:5]), **kw)
    assert not o0.requires_grad
    o1, ht1 = chunk_gated_delta_rule(*args[:5], **kw)
    assert o1.requires_grad and ht1.requires_grad
    assert torch.equal(o0, o1.detach()) and torch.equal(ht0, ht1.detach())
    o_ref, ht_ref = recurrent_gated_delta_rule_ref(*(t.detach() for t in args[:5]), **kw)
    assert rel_err(o0, o_ref) <= 1e-4 and rel_err(ht0, ht_ref) <= 1e-4


def test_cpu_without_interpreter_differentiates_the_reference(monkeypatch):
    """No Triton (CPU, no interpreter): autograd goes through the PyTorch reference."""
    import fuselm.ops.gated_delta_rule.chunk as chunk

    monkeypatch.setattr(chunk, "use_triton", lambda t: False)
    args = inputs(1, 70, 2, 4, 16, 16)
    do, dht = torch.randn(1, 70, 4, 16, dtype=torch.float64), torch.randn(1, 4, 16, 16, dtype=torch.float64)
    _, _, ref = reference_grads(args, do, dht, use_qk_l2norm_in_kernel=True)
    leaves = [t.clone().requires_grad_(True) for t in args]
    o, ht = chunk.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    assert_grads([t.grad for t in leaves], ref, 1e-3)


# ----------------------------------------------------------------------------- flash-linear-attention's options
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_fla_options_forward_and_gradients(dtype, neg_eigval):
    """FLA's use_gate_in_kernel (A_log, dt_bias), use_beta_sigmoid_in_kernel, allow_neg_eigval,
    state_v_first and a 16-bit initial state, as a drop-in for fla's chunk_gated_delta_rule:
    outputs, final state and the gradients of the raw inputs against autograd through the float64
    token recurrence fed the same math (g = -exp(A_log) softplus(g_raw + dt_bias), beta = (2)
    sigmoid(logits), states transposed to [V, K])."""
    B, T, H, HV, K, V = 2, 37, 1, 2, 16, 32
    q, k, v, _, _, _ = inputs(B, T, H, HV, K, V, with_state=False)
    g_raw, logits = torch.randn(B, T, HV), torch.randn(B, T, HV) * 2
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    h0_vk = torch.randn(B, HV, V, K).to(dtype)  # [V, K] layout, 16-bit when dtype is
    do, dht_vk = torch.randn(B, T, HV, V, dtype=torch.float64), torch.randn(B, HV, V, K, dtype=torch.float64)
    factor = 2.0 if neg_eigval else 1.0

    raw = [q, k, v, g_raw, logits, A_log, dt_bias, h0_vk]
    ref_leaves = [t.double().requires_grad_(True) for t in raw]
    rq, rk, rv, rg, rb, rA, rd, rh = ref_leaves
    g = -rA.exp() * torch.nn.functional.softplus(rg + rd)
    o_ref, ht_ref = recurrent_gated_delta_rule_autograd(rq, rk, rv, g, factor * rb.sigmoid(), scale=0.5,
                                                        initial_state=rh.transpose(-1, -2), output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    ((o_ref * do).sum() + (ht_ref.transpose(-1, -2) * dht_vk).sum()).backward()

    dtypes = (dtype,) * 3 + (torch.float32,) * 4 + (dtype,)
    leaves = [t.to(DEVICE, d).detach().requires_grad_(True) for t, d in zip(raw, dtypes)]
    o, ht = chunk_gated_delta_rule(*leaves[:5], 0.5, leaves[7], True, use_qk_l2norm_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval, state_v_first=True,
                                   use_gate_in_kernel=True, A_log=leaves[5], dt_bias=leaves[6], chunk_size=32)
    assert ht.shape == (B, HV, V, K) and ht.dtype == torch.float32
    ((o.double() * do.to(DEVICE)).sum() + (ht.double() * dht_vk.to(DEVICE)).sum()).backward()
    tol = TOL[dtype]
    assert rel_err(o.double().cpu(), o_ref.detach()) <= tol and rel_err(ht.double().cpu(), ht_ref.detach().transpose(-1, -2)) <= tol
    for name, got, want in zip(("q", "k", "v", "g", "beta logits", "A_log", "dt_bias", "h0"), leaves, ref_leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        err = rel_err(got.grad.double().cpu(), want.grad)
        assert err <= 2 * tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval: requires use_beta_sigmoid_in_kernel"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log: required"),
    (dict(A_log=torch.zeros(2)), ValueError, "A_log, dt_bias: only used with use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, r"A_log: expected \[HV\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(5)), ValueError, r"dt_bias: expected \[HV\]"),
    (dict(chunk_size=128), ValueError, "chunk_size: expected one of"),
    (dict(cp_context=object()), NotImplementedError, "cp_context"),
    (dict(head_first=True), TypeError, "head_first"),
])
def test_fla_options_bad_input(kwargs, error, match):
    q, k, v, g, beta, _ = inputs(1, 5, 1, 2, 16, 16, with_state=False)
    kwargs = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule(*(t.to(DEVICE) for t in (q, k, v, g, beta)), **kwargs)
