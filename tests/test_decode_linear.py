"""decode_linear: the weight-streaming GEMV with a fused prologue (Triton interpreter on a CPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEVICE, ON_GPU
from helpers import TOL_VS_CONTRACT, randn
from fuselm.models.qwen35.layers import GatedAttention, GatedDeltaNet
from fuselm.models.qwen35.presets import tiny_config
from fuselm.ops.decode_linear import (
    DecodeLinearConfig, DecodeVectorConfig, decode_linear, decode_linear_config, decode_linear_ref,
    decode_vector_config, gated_rms_norm_ref, linear_prologue, prologue_ref, sigmoid_gate_ref,
)
from fuselm.ops.rms_norm import rms_norm, rms_norm_ref
from fuselm.testing import assert_close, poisoned_like

# Matrix kernel: bf16 only on the GPU (the interpreter's bf16 tl.dot is wrong, triton 11584).
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}
N = 100  # not a multiple of BLOCK_N
# (prologue, K, head_dim); K is not a multiple of the interpreter's BLOCK_K (64)
CASES = [(None, 200, None), ("sigmoid_gate", 200, None), ("gated_rms_norm", 96, 32), ("gated_rms_norm", 96, 16)]
CASE_IDS = ["plain", "sigmoid_gate", "gated_rms_norm_hd32", "gated_rms_norm_hd16"]


def make_inputs(m, k, dtype, prologue, head_dim, lead=(), n=N):
    """x and gate as strided row views of one wider projection (as ``proj.split(...)`` gives)."""
    proj = randn(*lead, m, 2 * k + 8, dtype=dtype)
    x, gate, _ = proj.split([k, k, 8], dim=-1)
    weight = randn(n, k, dtype=dtype, scale=k ** -0.5)
    norm_weight = (randn(head_dim) * 0.3 + 1.0).to(dtype) if head_dim else None
    kwargs = dict(prologue=prologue, gate=gate if prologue else None, norm_weight=norm_weight, head_dim=head_dim)
    return x, weight, kwargs


def exact(x, weight, kwargs):
    """The exact function: the reference in float64 (every rounding a no-op)."""
    f64 = {key: v.double() if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
    return decode_linear_ref(x.double(), weight.double(), **f64)


def contract(x, weight, kwargs):
    return decode_linear_ref(x, weight, **kwargs)


def ulp_flips(a, b):
    """(largest difference in units of the last place, count of differing entries) of two 16-bit
    tensors; +0 and -0 count as equal (the kernel's accumulator adds to +0)."""
    same = a == b
    ulps = torch.where(same, 0, (a.view(torch.int16).int() - b.view(torch.int16).int()).abs())
    return ulps.max().item(), (~same).sum().item()


# ----------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])  # token tile 16, then 32
def test_matches_exact_and_contract(m, dtype, case):
    prologue, k, head_dim = case
    x, weight, kwargs = make_inputs(m, k, dtype, prologue, head_dim)
    assert x.stride(0) != k and (kwargs["gate"] is None or kwargs["gate"].stride(0) != k)  # strided rows
    out = poisoned_like(torch.empty(m, N, dtype=dtype, device=DEVICE))
    y = decode_linear(x, weight, out=out, **kwargs)
    assert y is out
    assert not y.isnan().any(), "an element of out was not written"
    assert_close(y, exact(x, weight, kwargs), TOL[dtype], "y")
    assert_close(y, contract(x, weight, kwargs), TOL_VS_CONTRACT[dtype], "y vs contract")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_leading_dims_and_vector(case):
    prologue, k, head_dim = case
    x, weight, kwargs = make_inputs(3, k, torch.float32, prologue, head_dim, lead=(2,))  # [2, 3, K]: M = 6
    y = decode_linear(x, weight, **kwargs)
    assert y.shape == (2, 3, N)
    assert_close(y, exact(x, weight, kwargs), TOL[torch.float32], "y [2, 3, N]")
    one = {key: v[0, 0] if isinstance(v, torch.Tensor) and v.dim() == 3 else v for key, v in kwargs.items()}
    y1 = decode_linear(x[0, 0], weight, **one)  # x [K] -> y [N]
    assert y1.shape == (N,)
    assert_close(y1, exact(x[0, 0], weight, one), TOL[torch.float32], "y [N]")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_more_than_32_rows_runs_the_prologue_then_the_matmul(dtype, case):
    prologue, k, head_dim = case
    x, weight, kwargs = make_inputs(33, k, dtype, prologue, head_dim)
    y = decode_linear(x, weight, out=poisoned_like(torch.empty(33, N, dtype=dtype, device=DEVICE)), **kwargs)
    assert not y.isnan().any()
    assert_close(y, exact(x, weight, kwargs), TOL[dtype], "y (M = 33)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, config", [
    (24, None),                                   # not a power of two: prologue in PyTorch, plain kernel
    (32, DecodeLinearConfig(16, 16, 4, 1)),       # BLOCK_K < head_dim: unfused as well
    (32, DecodeLinearConfig(32, 32, 4, 1)),       # one head per K tile, fused
    (16, DecodeLinearConfig(64, 128, 2, 2)),      # one K tile (96 < 128), 2 programs, fused
], ids=["hd24", "hd32-bk16-unfused", "hd32-bk32", "hd16-bk128"])
def test_gated_rms_norm_head_dims_and_config_override(dtype, head_dim, config):
    x, weight, kwargs = make_inputs(5, 96, dtype, "gated_rms_norm", head_dim)
    y = decode_linear(x, weight, config=config, out=poisoned_like(torch.empty(5, N, dtype=dtype, device=DEVICE)), **kwargs)
    assert not y.isnan().any()
    assert_close(y, exact(x, weight, kwargs), TOL[dtype], "y")
    assert_close(y, contract(x, weight, kwargs), TOL_VS_CONTRACT[dtype], "y vs contract")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("config", [
    None,                               # the one-token kernel's default
    DecodeVectorConfig(2, 32, 2),       # K = 96 in 3 steps, 200 in 7 (tail)
    DecodeVectorConfig(4, 16, 1),       # K steps of 16: 13 for K = 200 (rolled loop); gated heads unfused
    DecodeVectorConfig(128, 256, 4),    # one program, one K step
    DecodeLinearConfig(16, 64, 4, 1),   # the tensor-core tile at one row
], ids=["default", "rows2-bk32", "rows4-bk16-rolled", "rows128-bk256", "tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp16 at one row: test_matches_exact_and_contract
def test_one_token_paths(dtype, config, case):
    """One row: the CUDA-core vector kernel (no tl.dot, so bf16 runs in the interpreter too) under
    its default and overriding configs, and the tile kernel when a DecodeLinearConfig asks."""
    if dtype == torch.bfloat16 and isinstance(config, DecodeLinearConfig) and not ON_GPU:
        pytest.skip("the interpreter's bf16 tl.dot is wrong (triton 11584)")
    prologue, k, head_dim = case
    x, weight, kwargs = make_inputs(1, k, dtype, prologue, head_dim)
    y = decode_linear(x, weight, config=config, out=poisoned_like(torch.empty(1, N, dtype=dtype, device=DEVICE)),
                      **kwargs)
    assert not y.isnan().any(), "an element of out was not written"
    assert_close(y, exact(x, weight, kwargs), TOL[dtype], "y")
    assert_close(y, contract(x, weight, kwargs), TOL_VS_CONTRACT[dtype], "y vs contract")


@pytest.mark.parametrize("m", [1, 3, 33])  # the vector kernel reads the heads in place; the others copy them
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_in_strided_heads(dtype, m):
    """A gate given as [..., heads, head] with strided heads (Qwen3.5 attention's gate, interleaved
    with the query in one projection) gives what its contiguous copy gives."""
    heads, head = 5, 16
    proj = randn(m, heads, 2, head, dtype=dtype)
    x = randn(m, heads * head, dtype=dtype)
    weight = randn(N, heads * head, dtype=dtype, scale=(heads * head) ** -0.5)
    gate = proj[:, :, 1, :]
    assert gate.stride(1) == 2 * head
    y = decode_linear(x, weight, prologue="sigmoid_gate", gate=gate,
                      out=poisoned_like(torch.empty(m, N, dtype=dtype, device=DEVICE)))
    flat = dict(prologue="sigmoid_gate", gate=gate.reshape(m, -1))
    assert not y.isnan().any()
    assert_close(y, exact(x, weight, flat), TOL[dtype], "y")
    assert_close(y, contract(x, weight, flat), TOL_VS_CONTRACT[dtype], "y vs contract")
    with pytest.raises(ValueError, match="gate"):
        decode_linear(x, weight, prologue="sigmoid_gate", gate=proj[:, :4, 1, :])  # 4 x 16 != K


@pytest.mark.parametrize("config_of", [decode_linear_config, decode_vector_config], ids=["tile", "vector"])
def test_default_config_tiles_whole_heads(config_of):
    for arch in (0, 9):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for head_dim in (16, 64, 128, 256, 512):
                cfg = config_of(arch, dtype, "gated_rms_norm", head_dim)
                assert cfg.block_k % head_dim == 0, (arch, dtype, head_dim, cfg)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's 1 / sqrt(0)
def test_zero_heads_with_zero_eps_stay_finite_in_padding():
    """eps = 0: a zero head gives 0 * inf = NaN in the reference, and the padding rows / K tail
    (also zeros) must not spread NaN into the other outputs."""
    x, weight, kwargs = make_inputs(3, 96, torch.float32, "gated_rms_norm", 32)
    y = decode_linear(x, weight, eps=0.0, **kwargs)
    assert_close(y, exact(x, weight, {**kwargs, "eps": 0.0}), TOL[torch.float32], "y (eps = 0)")
    x = x.clone()
    x[1, :32] = 0.0  # a zero head in row 1: NaN there, as the reference
    y = decode_linear(x, weight, eps=0.0, **kwargs)
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()


def test_empty():
    x, weight, kwargs = make_inputs(0, 96, torch.float32, "gated_rms_norm", 32)
    assert decode_linear(x, weight, **kwargs).shape == (0, N)
    x, weight, kwargs = make_inputs(2, 96, torch.float32, None, None, n=0)
    assert decode_linear(x, weight, **kwargs).shape == (2, 0)


# ----------------------------------------------------------------------------- bit-exactness vs the model
def test_prologues_bit_exact_with_the_model_formulas_fp16():
    """The references reproduce the model's eager formulas bit for bit; the kernel's prologue
    (read back through an identity weight: y = a exactly) equals the model's current code path
    (``fuselm.ops.rms_norm`` kernel, then silu gating) up to rare 1-ulp flips where the two
    kernels sum a head's squares in different orders."""
    dtype = torch.float16
    for head_dim, heads in ((32, 3), (128, 2)):
        k = head_dim * heads
        o, z = randn(16, heads, head_dim, dtype=dtype, scale=3.0), randn(16, heads, head_dim, dtype=dtype, scale=2.0)
        w = randn(head_dim, dtype=dtype)
        model_ref = (rms_norm_ref(o, w, 1e-6, 0.0).float() * F.silu(z.float())).to(dtype).flatten(-2)
        model_op = (rms_norm(o, w, 1e-6, 0.0).float() * F.silu(z.float())).to(dtype).flatten(-2)
        naive = gated_rms_norm_ref(o.flatten(-2), z.flatten(-2), w, 1e-6, head_dim)
        assert torch.equal(naive, model_ref)
        eye = torch.eye(k, dtype=dtype, device=DEVICE)
        fused = decode_linear(o.flatten(-2), eye, prologue="gated_rms_norm", gate=z.flatten(-2), norm_weight=w,
                              eps=1e-6, head_dim=head_dim)
        worst, flips = ulp_flips(fused, model_op)
        assert worst <= 1 and flips <= max(2, fused.numel() // 500), (head_dim, worst, flips)

    x, gate = randn(16, 200, dtype=dtype, scale=2.0), randn(16, 200, dtype=dtype, scale=3.0)
    eager = x * torch.sigmoid(gate)
    assert torch.equal(sigmoid_gate_ref(x, gate), eager)
    fused = decode_linear(x, torch.eye(200, dtype=dtype, device=DEVICE), prologue="sigmoid_gate", gate=gate)
    worst, flips = ulp_flips(fused, eager)
    assert worst <= 1 and flips <= max(2, fused.numel() // 500), (worst, flips)


def _module(cls, dtype):
    module = cls(tiny_config())
    for name, p in module.named_parameters():
        fill = randn(*p.shape, dtype=dtype) * 0.3 + (1.0 if name == "norm" else 0.0)
        setattr(module, name, nn.Parameter(fill.to(dtype), requires_grad=False))
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [(3, 1), (2, 20)])  # decode rows (fused GEMV) / prompt tokens (prologue, then mm)
def test_matches_the_model_output_projections(rows, dtype):
    """The layers' ``output`` (decode_linear with the gate taken from the in-projection) against
    HF's eager code for ``Qwen3_5RMSNormGated`` + out_proj and ``attn * sigmoid(gate)`` + o_proj."""
    dn = _module(GatedDeltaNet, dtype)
    proj = randn(*rows, dn.conv_dim + dn.value_dim + 2 * dn.num_v_heads, dtype=dtype)
    z = proj[..., dn.conv_dim:dn.conv_dim + dn.value_dim].unflatten(-1, (dn.num_v_heads, dn.head_v_dim))
    o = randn(*rows, dn.num_v_heads, dn.head_v_dim, dtype=dtype)
    # HF: weight * rms_norm(o).to(dtype) (Llama rounding), times silu(z) in fp32, one rounding.
    gated = (rms_norm(o, dn.norm, dn.eps, 0.0).float() * F.silu(z.float())).to(dtype).flatten(-2)
    assert_close(dn.output(o.flatten(-2), proj), gated @ dn.out_proj.T, TOL[dtype], "GatedDeltaNet out_proj")
    if dtype == torch.float16:  # identity out_proj: y is the prologue itself, vs the eager code
        dn.out_proj = nn.Parameter(torch.eye(dn.value_dim, dtype=dtype, device=DEVICE), requires_grad=False)
        worst, flips = ulp_flips(dn.output(o.flatten(-2), proj), gated)
        assert worst <= 1 and flips <= 2, (worst, flips)

    at = _module(GatedAttention, dtype)
    proj = randn(*rows, at.q_size + 2 * at.kv_size, dtype=dtype)
    attn = randn(*rows, at.num_heads * at.head_dim, dtype=dtype)
    gate = proj[..., :at.q_size].unflatten(-1, (at.num_heads, 2 * at.head_dim))[..., at.head_dim:].flatten(-2)
    want = (attn * torch.sigmoid(gate)) @ at.o_proj.T
    assert_close(at.output(attn, proj), want, TOL[dtype], "GatedAttention o_proj")


# ----------------------------------------------------------------------------- bad input
def _bad_cases():
    x, w, kw = make_inputs(2, 96, torch.float32, "gated_rms_norm", 32)
    g, nw = kw["gate"], kw["norm_weight"]
    gk = dict(prologue="gated_rms_norm", gate=g, norm_weight=nw, head_dim=32)
    return [
        ("x", TypeError, dict(x=x.double(), weight=w)),
        ("x", TypeError, dict(x=[1.0], weight=w)),
        ("x", ValueError, dict(x=torch.tensor(1.0, device=DEVICE), weight=w)),
        ("x", ValueError, dict(x=x.t().contiguous().t(), weight=w)),
        ("weight", ValueError, dict(x=x, weight=w[0])),
        ("weight", ValueError, dict(x=x, weight=w[:, :64])),
        ("weight", ValueError, dict(x=x, weight=randn(96, N).t())),
        ("weight", TypeError, dict(x=x, weight=w.half())),
        ("prologue", ValueError, dict(x=x, weight=w, prologue="silu", gate=g)),
        ("gate", ValueError, dict(x=x, weight=w, prologue="sigmoid_gate")),
        ("gate", ValueError, dict(x=x, weight=w, gate=g)),
        ("gate", ValueError, dict(x=x, weight=w, prologue="sigmoid_gate", gate=g[:1])),
        ("gate", TypeError, dict(x=x, weight=w, prologue="sigmoid_gate", gate=g.half())),
        ("norm_weight", ValueError, dict(x=x, weight=w, **{**gk, "norm_weight": None})),
        ("norm_weight", ValueError, dict(x=x, weight=w, **{**gk, "norm_weight": nw[:16]})),
        ("norm_weight", TypeError, dict(x=x, weight=w, **{**gk, "norm_weight": nw.half()})),
        ("norm_weight", ValueError, dict(x=x, weight=w, prologue="sigmoid_gate", gate=g, norm_weight=nw)),
        ("head_dim", ValueError, dict(x=x, weight=w, **{**gk, "head_dim": None})),
        ("head_dim", ValueError, dict(x=x, weight=w, **{**gk, "head_dim": 40, "norm_weight": randn(40)})),
        ("head_dim", ValueError, dict(x=x, weight=w, **{**gk, "head_dim": 0})),
        ("head_dim", ValueError, dict(x=x, weight=w, head_dim=32)),
        ("eps", ValueError, dict(x=x, weight=w, **gk, eps=-1.0)),
        ("eps", ValueError, dict(x=x, weight=w, **gk, eps=float("nan"))),
        ("out", ValueError, dict(x=x, weight=w, out=torch.empty(2, N + 1, device=DEVICE))),
        ("out", TypeError, dict(x=x, weight=w, out=torch.empty(2, N, device=DEVICE, dtype=torch.float16))),
        ("out", ValueError, dict(x=x, weight=w, out=torch.empty(N, 2, device=DEVICE).t())),
        ("config", TypeError, dict(x=x, weight=w, config=(16, 64, 4, 1))),
        ("config", ValueError, dict(x=x, weight=w, config=DecodeLinearConfig(24, 64, 4, 1))),
        ("config", ValueError, dict(x=x, weight=w, config=DecodeVectorConfig(3, 64, 4))),
        ("config", ValueError, dict(x=x, weight=w, config=DecodeVectorConfig(2, 64, 4))),  # x has 2 rows
        ("x", ValueError, dict(x=x.clone().requires_grad_(True), weight=w)),
    ] + ([("tensors must be on one device", ValueError, dict(x=x, weight=w.cpu()))] if ON_GPU else [])


@pytest.mark.parametrize("name, error, kwargs", _bad_cases(),
                         ids=[f"{i}-{c[0].split()[0]}" for i, c in enumerate(_bad_cases())])
def test_bad_input(name, error, kwargs):
    x, weight = kwargs.pop("x"), kwargs.pop("weight")
    with pytest.raises(error, match=name):
        decode_linear(x, weight, **kwargs)


@pytest.mark.parametrize("case", CASES[1:] + [("gated_rms_norm", 96, 24)],
                         ids=CASE_IDS[1:] + ["gated_rms_norm_hd24"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 45])  # odd rows: tiles of PROLOGUE_BLOCK_M with a tail
def test_linear_prologue_alone_and_in_place(m, dtype, case):
    """``linear_prologue``: the prologue ``decode_linear`` applies (``prologue_ref`` within the
    contract's rounding; a head_dim that is not a power of two runs the reference itself), into a
    poisoned ``out`` and in place on x (a mixed step gates each half's rows where they lie)."""
    prologue, K, head_dim = case
    x, _, kwargs = make_inputs(m, K, dtype, prologue, head_dim)
    expect = prologue_ref(x, **kwargs)
    out = poisoned_like(torch.empty(m, K, dtype=dtype, device=DEVICE))
    a = linear_prologue(x, out=out, **kwargs)
    assert a is out
    assert_close(a, expect, TOL_VS_CONTRACT[dtype], "a")
    rows = x.clone()
    assert linear_prologue(rows, out=rows, **kwargs) is rows
    assert torch.equal(rows, a)


def test_linear_prologue_gate_in_strided_heads_and_bad_input():
    heads, head = 5, 16
    proj = randn(7, heads, 2, head, dtype=torch.float16)
    x = randn(7, heads * head, dtype=torch.float16)
    a = linear_prologue(x, "sigmoid_gate", proj[:, :, 1, :])
    assert_close(a, sigmoid_gate_ref(x, proj[:, :, 1, :].reshape(7, -1)), TOL_VS_CONTRACT[torch.float16], "a")
    with pytest.raises(ValueError, match="prologue"):
        linear_prologue(x, None, proj[:, :, 1, :])
    with pytest.raises(ValueError, match="out"):
        linear_prologue(x, "sigmoid_gate", proj[:, :, 1, :], out=torch.empty(7, 81, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        linear_prologue(x, "sigmoid_gate", proj[:, :, 1, :], out=torch.empty(80, 7, device=DEVICE).half().t())
    with pytest.raises(ValueError, match="head_dim"):
        linear_prologue(x, "gated_rms_norm", x, norm_weight=randn(16))


def test_fp32_norm_weight_is_accepted():
    x, weight, kwargs = make_inputs(2, 96, torch.float16, "gated_rms_norm", 32)
    kwargs["norm_weight"] = kwargs["norm_weight"].float()
    y = decode_linear(x, weight, **kwargs)
    assert_close(y, contract(x, weight, kwargs), TOL_VS_CONTRACT[torch.float16], "y")


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("m", [1, 3, 16, 24, 32])
def test_bf16_on_gpu(m, case):
    prologue, k, head_dim = case
    x, weight, kwargs = make_inputs(m, k, torch.bfloat16, prologue, head_dim)
    y = decode_linear(x, weight, out=poisoned_like(torch.empty(m, N, dtype=torch.bfloat16, device=DEVICE)), **kwargs)
    assert not y.isnan().any()
    assert_close(y, exact(x, weight, kwargs), TOL[torch.bfloat16], "y")
    assert_close(y, contract(x, weight, kwargs), TOL_VS_CONTRACT[torch.bfloat16], "y vs contract")


@pytest.mark.gpu
@pytest.mark.parametrize("prologue, head_dim", [(None, None), ("sigmoid_gate", None), ("gated_rms_norm", 128)])
@pytest.mark.parametrize("m", [1, 16])
def test_qwen35_9b_shapes_on_gpu(m, prologue, head_dim):
    x, weight, kwargs = make_inputs(m, 4096, torch.bfloat16, prologue, head_dim, n=4096)
    y = decode_linear(x, weight, **kwargs)
    assert_close(y, exact(x, weight, kwargs), TOL[torch.bfloat16], "y")


@pytest.mark.gpu
def test_dependent_launches_equal_plain_launches_in_a_graph(monkeypatch):
    """One token through RMSNorm -> decode_linear (sigmoid gate) -> RMSNorm -> decode_linear
    (gated_rms_norm) x 3 in a CUDA graph: the norm lets each vector kernel begin and load its
    weights before the norm's output exists (programmatic dependent launch); replayed on a new
    token, bit for bit the plain launches' result, eager."""
    from fuselm import runtime
    D, hd = 512, 128
    ws = [randn(D, D, dtype=torch.bfloat16, scale=D ** -0.5) for _ in range(6)]
    norm_w, head_norm = randn(D, dtype=torch.bfloat16), randn(hd, dtype=torch.bfloat16) * 0.3 + 1.0
    gate = randn(1, D, dtype=torch.bfloat16)

    def layers(h):
        for i in range(0, 6, 2):
            h = decode_linear(rms_norm(h, norm_w, 1e-6), ws[i], prologue="sigmoid_gate", gate=gate)
            h = decode_linear(rms_norm(h, norm_w, 1e-6), ws[i + 1], prologue="gated_rms_norm", gate=gate,
                              norm_weight=head_norm, head_dim=hd)
        return h

    static = randn(1, D, dtype=torch.bfloat16)
    assert runtime.use_pdl(static.device) == (torch.cuda.get_device_capability()[0] >= 9)
    graph, out = runtime.capture_graph(lambda: layers(static))
    static.copy_(randn(1, D, dtype=torch.bfloat16))
    graph.replay()
    monkeypatch.setattr(runtime, "PDL", False)
    assert torch.equal(out, layers(static))


@pytest.mark.gpu
def test_cuda_graph_replay_without_allocation():
    x, weight, kwargs = make_inputs(4, 256, torch.bfloat16, "gated_rms_norm", 128, n=512)
    out = torch.empty(4, 512, dtype=torch.bfloat16, device=DEVICE)
    decode_linear(x, weight, out=out, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    decode_linear(x, weight, out=out, **kwargs)
    assert torch.cuda.memory_allocated() == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_linear(x, weight, out=out, **kwargs)
    x.copy_(randn(*x.shape, dtype=torch.bfloat16))
    kwargs["gate"].copy_(randn(*x.shape, dtype=torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    assert_close(out, contract(x, weight, kwargs), TOL_VS_CONTRACT[torch.bfloat16], "replayed y")
