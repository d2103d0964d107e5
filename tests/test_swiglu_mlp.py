import pytest
import torch
from torch import nn

from conftest import DEVICE, ON_GPU
from helpers import randn
from fuselm import Activation, SwiGLUMLP, gemm_swiglu, interleave_gate_up, swiglu_mlp, deinterleave_gate_up
from fuselm.ops.common.activation import gate_factor_ref, up_factor_ref
from fuselm.ops.swiglu_mlp import gemm_swiglu_forward, gemm_swiglu_ref, swiglu_mlp_forward, swiglu_mlp_ref
from fuselm.testing import assert_close, poisoned_like
from fuselm.runtime import use_triton

ACTIVATIONS = [Activation(), Activation.swiglu_limit(1.5), Activation.swiglu_oai(limit=1.5, alpha=1.702)]
ACT_IDS = ["silu", "limit", "oai"]
# Matrix kernels: bf16 only on the GPU (the interpreter's bf16 tl.dot is wrong, triton 11584).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
# Against the contract (same roundings, fp32 sums in another order): only elements whose G or U
# lies at a rounding boundary may differ, by one ulp; tight enough that a missing rounding of G/U
# fails (unrounded G/U: 4e-4 fp16, 3.8e-3 bf16; rounded: 3e-5 fp16, interpreter).
CONTRACT_TOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-3}
D, F = 100, 72  # neither a multiple of the tiles


def weights(dtype, d=D, f=F):
    w13 = interleave_gate_up(randn(f, d, dtype=dtype, scale=d ** -0.5), randn(f, d, dtype=dtype, scale=d ** -0.5))
    return w13, randn(d, f, dtype=dtype, scale=f ** -0.5)


def exact_h(x, w13, act, dtype):
    """float64 act(G) * U with G, U = x @ w_gate.T, x @ w_up.T rounded to ``dtype`` first, as the
    contract (and HF's gate_proj / up_proj) rounds them; straight-through, so autograd's gradients
    pass the rounding unchanged while a clamp's mask sees the rounded values."""
    x = x.double()
    g, u = x @ w13[0::2].double().T, x @ w13[1::2].double().T
    g = g + (g.to(dtype).double() - g).detach()
    u = u + (u.to(dtype).double() - u).detach()
    return gate_factor_ref(g, act) * up_factor_ref(u, act)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 32, 33, 128, 1000])  # decode tiles 16 / 32, then the GEMM
def test_gemm_swiglu_and_mlp_forward(m, dtype, act):
    x = randn(m, D, dtype=dtype)
    w13, w2 = weights(dtype)
    h = gemm_swiglu_forward(x, w13, act, out=poisoned_like(torch.empty(m, F, dtype=dtype, device=DEVICE)))
    assert not h.isnan().any(), "an element of h was not written"
    assert_close(h, exact_h(x, w13, act, dtype), TOL[dtype], "h")
    assert_close(h, gemm_swiglu_ref(x, w13, act), CONTRACT_TOL[dtype], "h vs contract")
    y = swiglu_mlp_forward(x, w13, w2, act, out=poisoned_like(x))
    assert not y.isnan().any(), "an element of y was not written"
    assert_close(y, exact_h(x, w13, act, dtype) @ w2.double().T, TOL[dtype], "y")


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_in_row_slices_and_the_fused_kernel(monkeypatch, dtype, act):
    """The forward's cuBLAS + SwiGLU-pairs path in slices of CUBLAS_SWIGLU_ROWS rows (lowered here:
    45 rows in 16, 16, 13) gives what one product gives (to the contract: a BLAS may block
    differently by row count); the fused GEMM kernel (the backward's, and the forward the MLP
    work times against it) gives the same results."""
    import fuselm.ops.swiglu_mlp.op as swiglu_op
    from fuselm.ops.swiglu_mlp.kernels import gemm_swiglu_kernel

    x = randn(45, D, dtype=dtype)
    w13, w2 = weights(dtype)
    whole = gemm_swiglu_forward(x, w13, act)
    monkeypatch.setattr(swiglu_op, "CUBLAS_SWIGLU_ROWS", 16)
    h = gemm_swiglu_forward(x, w13, act, out=poisoned_like(torch.empty(45, F, dtype=dtype, device=DEVICE)))
    assert not h.isnan().any(), "an element of h was not written"
    assert_close(h, whole, CONTRACT_TOL[dtype], "row slices vs one product")  # a BLAS may block by M
    assert_close(h, exact_h(x, w13, act, dtype), TOL[dtype], "h")
    assert_close(h, gemm_swiglu_ref(x, w13, act), CONTRACT_TOL[dtype], "h vs contract")
    if use_triton(x):
        fused = gemm_swiglu_kernel(x, w13, act, poisoned_like(h))
        assert not fused.isnan().any(), "an element of the fused kernel's h was not written"
        assert_close(fused, exact_h(x, w13, act, dtype), TOL[dtype], "fused h")
        assert_close(fused, whole, CONTRACT_TOL[dtype], "fused vs cuBLAS + pairs")


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("m", [5, 37])
def test_tma_kernel(m, act):
    """The TMA gate/up GEMM (Hopper's prefill path; here the interpreter, 16-bit, 16 x 16 tiles on
    4 persistent programs): x rows a strided view, M, F and D not multiples of the tiles (the
    descriptors zero-fill and clip), every element of h written, the exact function's values."""
    from fuselm.ops.common.matmul import tma_ok
    from fuselm.ops.swiglu_mlp.kernels import gemm_swiglu_tma_kernel

    if not use_triton(torch.empty(0, device=DEVICE)):
        pytest.skip("a Triton kernel: the interpreter or a GPU")
    dtype, d, f = torch.float16 if DEVICE == "cpu" else torch.bfloat16, 72, 40
    x = randn(m, d + 8, dtype=dtype)[:, :d]  # row stride 80 elements (16-byte aligned)
    w13, _ = weights(dtype, d, f)
    out = poisoned_like(torch.empty(m, f, dtype=dtype, device=DEVICE))
    assert tma_ok(x, w13, out)
    h = gemm_swiglu_tma_kernel(x, w13, act, out)
    assert h is out and not h.isnan().any(), "an element of h was not written"
    assert_close(h, exact_h(x, w13, act, dtype), TOL[dtype], "h")
    assert_close(h, gemm_swiglu_ref(x, w13, act), CONTRACT_TOL[dtype], "h vs contract")


def test_tma_pays_from_1024_rows_or_full_waves():
    """H100 (132 multiprocessors): 512 rows into F 12288 is 384 tiles (91% of a third wave: TMA),
    into F 14336 448 (39% of a fourth: cuBLAS); 256 rows never, 1024 always."""
    from fuselm.ops.swiglu_mlp.op import tma_pays

    assert tma_pays(512, 12288, 132) and not tma_pays(512, 14336, 132)
    assert not tma_pays(256, 12288, 132) and not tma_pays(511, 12288, 132)
    assert tma_pays(1024, 14336, 132) and tma_pays(5000, 100, 132)


def test_tma_ok_rejects_what_descriptors_cannot_address():
    from fuselm.ops.common.matmul import tma_ok

    x = torch.zeros(4, 72, dtype=torch.float16, device=DEVICE)
    assert tma_ok(x)
    assert not tma_ok(x.float())  # the kernel's operands are 16-bit
    assert not tma_ok(x[:, :36].t())  # unit last stride
    assert not tma_ok(torch.zeros(4, 70, dtype=torch.float16, device=DEVICE))  # 140-byte rows
    assert not tma_ok(x.view(-1)[4:].view(4, 71)[:, :70])  # base not 16-byte aligned


@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 40])
def test_gradients_match_autograd_of_the_reference(m, dtype, act):
    x = randn(2, m, D, dtype=dtype)  # 3-D input: leading dims flatten
    w13, w2 = weights(dtype)
    dy = randn(2, m, D, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2)]
    swiglu_mlp(*leaves, act).backward(dy)
    exact = [t.double().requires_grad_(True) for t in (x, w13, w2)]
    (exact_h(exact[0], exact[1], act, dtype) @ exact[2].T).backward(dy.double())
    for name, got, want in zip(("dx", "dw13", "dw2"), leaves, exact):
        assert_close(got.grad, want.grad, TOL[dtype] * 2, name)
    # gemm_swiglu alone
    dh = randn(2, m, F, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w13)]
    gemm_swiglu(*leaves, act).backward(dh)
    exact = [t.double().requires_grad_(True) for t in (x, w13)]
    exact_h(*exact, act, dtype).backward(dh.double())
    for name, got, want in zip(("dx", "dw13"), leaves, exact):
        assert_close(got.grad, want.grad, TOL[dtype] * 2, name)


def test_pack_unpack_and_hf_loading():
    w_gate, w_up = randn(F, D), randn(F, D)
    w13 = interleave_gate_up(w_gate, w_up)
    assert w13.shape == (2 * F, D) and w13.is_contiguous()
    assert torch.equal(w13[0::2], w_gate) and torch.equal(w13[1::2], w_up)
    assert all(torch.equal(a, b) for a, b in zip(deinterleave_gate_up(w13), (w_gate, w_up)))
    merged = torch.cat([w_gate, w_up])  # vLLM's gate_up_proj layout
    assert torch.equal(interleave_gate_up(*merged.chunk(2)), w13)

    class HFMLP(nn.Module):  # the Llama/Qwen MLP layout
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(D, F, bias=False, device=DEVICE)
            self.up_proj = nn.Linear(D, F, bias=False, device=DEVICE)
            self.down_proj = nn.Linear(F, D, bias=False, device=DEVICE)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    hf = HFMLP()
    ours = SwiGLUMLP.from_hf(hf)
    x = randn(5, D)
    with torch.no_grad():
        assert_close(ours(x), hf(x), 1e-5)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w13, w2: gemm_swiglu(x, w13[:-1]), ValueError, r"w13: expected the \[2F, D\] interleaved"),
    (lambda x, w13, w2: gemm_swiglu(x, w13.view(2, F, D)), ValueError, r"w13: expected the \[2F, D\] interleaved"),
    (lambda x, w13, w2: gemm_swiglu(x[:, :50], w13), ValueError, "w13: in-features 100"),
    (lambda x, w13, w2: gemm_swiglu(x.half(), w13), TypeError, "w13: dtype"),
    (lambda x, w13, w2: gemm_swiglu(x, w13.t().contiguous().t()), ValueError, "w13: rows"),
    (lambda x, w13, w2: swiglu_mlp(x, w13, w2.T), ValueError, r"w2: expected the down weight \[D, F\]"),
    (lambda x, w13, w2: swiglu_mlp(x, w13, w2.half()), TypeError, "w2: dtype"),
    (lambda x, w13, w2: swiglu_mlp(x.long(), w13, w2), TypeError, "x: dtype int64"),
    (lambda x, w13, w2: swiglu_mlp(x, w13, w2, "gelu"), ValueError, "activation"),
    (lambda x, w13, w2: swiglu_mlp(x, w13, torch.empty(D, F, device="meta")), ValueError, "one device"),
    (lambda x, w13, w2: gemm_swiglu_forward(x, w13, out=torch.empty(3, F + 1, device=DEVICE)), ValueError, "out: shape"),
    (lambda x, w13, w2: interleave_gate_up(w13[0::2], w13[1::2, :5]), ValueError, "w_gate, w_up"),
])
def test_bad_input(call, error, match):
    w13, w2 = weights(torch.float32)
    with pytest.raises(error, match=match):
        call(randn(3, D), w13, w2)


def test_zero_rows():
    w13, w2 = weights(torch.float32)
    x = torch.empty(0, D, device=DEVICE)
    assert gemm_swiglu(x, w13).shape == (0, F)
    assert swiglu_mlp(x, w13, w2).shape == (0, D)


def test_opcheck_and_compile():
    w13, w2 = weights(torch.float32)
    x = randn(5, D)
    torch.library.opcheck(torch.ops.fuselm.gemm_swiglu, (x.requires_grad_(True), w13, "silu", float("inf"), 1.0))
    torch.library.opcheck(torch.ops.fuselm.swiglu_mlp, (x, w13, w2.requires_grad_(True), "swiglu_limit", 2.0, 1.0))
    compiled = torch.compile(swiglu_mlp, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    torch.testing.assert_close(compiled(x, w13, w2), swiglu_mlp(x, w13, w2))


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    import fuselm.ops.swiglu_mlp.op as op

    monkeypatch.setattr(op, "use_triton", lambda t: False)
    w13 = interleave_gate_up(torch.randn(F, D), torch.randn(F, D))
    w2 = torch.randn(D, F)
    x = torch.randn(4, D)
    assert torch.equal(swiglu_mlp(x, w13, w2), swiglu_mlp_ref(x, w13, w2))


# ----------------------------------------------------------------------------- GPU: real shapes
@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("m", [1, 4, 16, 32, 1024])
def test_llama8b_mlp_bf16(m):
    d, f = 4096, 14336
    w13, w2 = weights(torch.bfloat16, d, f)
    x = randn(m, d, dtype=torch.bfloat16)
    h = gemm_swiglu_forward(x, w13, out=poisoned_like(torch.empty(m, f, dtype=torch.bfloat16, device=DEVICE)))
    assert_close(h, exact_h(x, w13, Activation(), torch.bfloat16), 1e-2, "h")
    y = swiglu_mlp_forward(x, w13, w2, out=poisoned_like(x))
    assert_close(y, exact_h(x, w13, Activation(), torch.bfloat16) @ w2.double().T, 1e-2, "y")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1024, 3000])
def test_prefill_forward_takes_the_tma_kernel_on_hopper(m):
    """At M >= TMA_MIN_ROWS on sm_90 the forward is one TMA launch (no cuBLAS product), in a CUDA
    graph too, within the contract of the cuBLAS + pairs path (9B-like width, 16-bit)."""
    import fuselm.ops.swiglu_mlp.op as swiglu_op

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA path is Hopper's")
    d, f = 4096, 1536
    w13, _ = weights(torch.bfloat16, d, f)
    x = randn(m, d, dtype=torch.bfloat16)
    h = poisoned_like(torch.empty(m, f, dtype=torch.bfloat16, device=DEVICE))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gemm_swiglu_forward(x, w13, out=h)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_gemm_swiglu_tma_kernel"], kernels
    assert not h.isnan().any()
    assert_close(h, exact_h(x, w13, Activation(), torch.bfloat16), 1e-2, "h")
    cublas = swiglu_op.swiglu_pairs_forward_kernel(torch.mm(x, w13.T), torch.empty_like(h), Activation())
    assert_close(h, cublas, CONTRACT_TOL[torch.bfloat16], "TMA vs cuBLAS + pairs")
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(h)
    with torch.cuda.graph(graph):
        gemm_swiglu_forward(x, w13, out=out)
    x.copy_(randn(m, d, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, gemm_swiglu_forward(x, w13), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 32])
def test_decode_mlp_is_two_launches_and_graph_capturable(m):
    w13, w2 = weights(torch.bfloat16, 512, 1376)
    x = randn(m, 512, dtype=torch.bfloat16)
    swiglu_mlp(x, w13, w2)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        swiglu_mlp(x, w13, w2)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 2, kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = swiglu_mlp(x, w13, w2)
    x.copy_(randn(m, 512, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(y, swiglu_mlp(x, w13, w2), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.large
def test_fused_forward_halves_activation_memory():
    d, f, m = 4096, 14336, 4096
    w13, _ = weights(torch.bfloat16, d, f)
    x = randn(m, d, dtype=torch.bfloat16)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    fused, _ = peak(lambda: gemm_swiglu(x, w13))
    unfused, _ = peak(lambda: (lambda gu: nn.functional.silu(gu[:, :f]) * gu[:, f:])(x @ w13.T))
    assert fused <= 0.5 * unfused + 2**20, (fused, unfused)
