"""SwiGLUMoE (the Qwen3.5-MoE sparse block on the routing and grouped-GEMM kernels, in the
interpreter on a CPU) against HF transformers' Qwen3_5MoeSparseMoeBlock on the same tensors: fp32
within 1e-5 (a shared expert wider than the routed ones, split in chunks), bf16 (GPU) within the
one-rounding contract; routing as HF's; experts with no token, all tokens on the same experts, odd
token counts; a clamped activation against an expert-by-expert loop (these two on both of the
block's paths: the decode path and the grouped GEMMs); bad input."""

import pytest
import torch

from conftest import DEVICE
from fuselm import Activation
from fuselm.ops.moe import SwiGLUMoE, op, route_ref
from fuselm.ops.silu_mul import silu_mul_ref

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock  # noqa: E402


def hf_block(experts=8, top_k=2, hidden=32, ffn=16, shared=24, seed=0, dtype=torch.float32):
    config = Qwen3_5MoeTextConfig(hidden_size=hidden, moe_intermediate_size=ffn, shared_expert_intermediate_size=shared,
                                  num_experts=experts, num_experts_per_tok=top_k)
    torch.manual_seed(seed)
    block = Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return block.to(DEVICE, dtype).eval()


def tokens(n, hidden=32, seed=1, dtype=torch.float32):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("n", [1, 7, 33])
def test_matches_hf_in_fp32(n):
    block = hf_block()
    x = tokens(n)
    with torch.no_grad():
        expected = block(x[None])[0]
    out = SwiGLUMoE.from_hf(block)(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max().clamp(min=1)
    _, experts = route_ref(x, block.gate.weight, 2)
    _, _, hf_experts = block.gate(x)
    assert torch.equal(experts, hf_experts)


def test_row_tile_grows_with_pairs_an_expert():
    """16-row blocks up to 16 pairs an expert on average, 64 up to 384, 128 past (long prefills)."""
    assert op.routing_block_m(16 * 9, 9) == 16 and op.routing_block_m(16 * 9 + 1, 9) == 64
    assert op.routing_block_m(384 * 9, 9) == 64 and op.routing_block_m(384 * 9 + 1, 9) == 128


@pytest.mark.parametrize("large", [False, True], ids=["bm64", "bm128"])
def test_grouped_path_row_tiles_match_hf(large, monkeypatch):
    """The grouped GEMMs on 64- and 128-row blocks (thresholds lowered so that 40 tokens take them)."""
    monkeypatch.setattr(op, "PAIR_PATH_TOKENS", 0)
    monkeypatch.setattr(op, "SMALL_PAIRS_PER_EXPERT", 0)
    monkeypatch.setattr(op, "LARGE_PAIRS_PER_EXPERT", 0 if large else 10**6)
    block = hf_block(seed=3)
    x = tokens(40)
    with torch.no_grad():
        expected = block(x[None])[0]
    out = SwiGLUMoE.from_hf(block)(x)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max().clamp(min=1)


# The block's two paths: the decode path up to op.PAIR_PATH_TOKENS tokens (these tests' token
# counts), the grouped GEMMs past it (forced here by PAIR_PATH_TOKENS = 0).
@pytest.fixture(params=["decode", "grouped"])
def path(request, monkeypatch):
    if request.param == "grouped":
        monkeypatch.setattr(op, "PAIR_PATH_TOKENS", 0)
    return request.param


def test_all_tokens_on_the_same_experts_and_idle_experts(path):
    """A router that sends every token to experts 5 and 2 (the other six get nothing)."""
    block = hf_block(seed=2)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[5] = 1.0
        block.gate.weight[2] = 0.5
    x = tokens(9).abs() + 0.1  # positive rows: expert 5 first, then 2, for every token
    _, experts = route_ref(x, block.gate.weight, 2)
    assert experts.tolist() == [[5, 2]] * 9
    with torch.no_grad():
        expected = block(x[None])[0]
    assert (SwiGLUMoE.from_hf(block)(x) - expected).abs().max() <= 1e-5 * expected.abs().max().clamp(min=1)


@pytest.mark.gpu  # the interpreter's bf16 tl.dot is wrong (triton 11584)
def test_bf16_rounds_once():
    """bf16: against the fp32 block on the same (bf16-valued) tensors, within what one rounding of
    the output and the products' roundings allow; HF's bf16 block rounds after every expert's add."""
    block = hf_block(seed=3, dtype=torch.bfloat16)
    x = tokens(16, seed=4, dtype=torch.bfloat16)
    out = SwiGLUMoE.from_hf(block)(x).float()
    exact = SwiGLUMoE.from_hf(hf_block(seed=3, dtype=torch.bfloat16).float())(x.float())
    assert torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0) > 0.9995


def test_clamped_activation_against_an_expert_by_expert_loop(path):
    block = hf_block(seed=5)
    x = tokens(11, seed=6) * 4  # large enough that the clamp at 0.5 bites
    act = Activation.swiglu_limit(0.5)
    moe = SwiGLUMoE.from_hf(block, activation=act)
    weights, experts = route_ref(x, block.gate.weight, 2)
    gate_up, down, shared = block.experts.gate_up_proj, block.experts.down_proj, block.shared_expert
    F_ = down.shape[2]
    expected = torch.zeros_like(x, dtype=torch.float64)
    with torch.no_grad():
        for t in range(x.shape[0]):
            for j in range(2):
                e = experts[t, j]
                h = silu_mul_ref(x[t] @ gate_up[e, :F_].T, x[t] @ gate_up[e, F_:].T, act)
                expected[t] += weights[t, j].double() * (h @ down[e].T).double()
            h = silu_mul_ref(x[t] @ shared.gate_proj.weight.T, x[t] @ shared.up_proj.weight.T, act)
            gate = torch.sigmoid(x[t] @ block.shared_expert_gate.weight[0])
            expected[t] += gate.double() * (h @ shared.down_proj.weight.T).double()
    out = moe(x)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    with torch.no_grad():
        assert (out - block(x[None])[0]).abs().max() > 1e-3  # the clamp changed the result


def test_bad_input_names_the_argument():
    block = hf_block()
    moe = SwiGLUMoE.from_hf(block)
    shared = block.shared_expert
    hf = [block.gate.weight, 2, block.experts.gate_up_proj, block.experts.down_proj, shared.gate_proj.weight,
          shared.up_proj.weight, shared.down_proj.weight, block.shared_expert_gate.weight]

    def build(index, value):
        return SwiGLUMoE(*(value if i == index else t for i, t in enumerate(hf)))

    with pytest.raises(ValueError, match="top_k"):
        build(1, 9)
    with pytest.raises(ValueError, match="down"):
        build(3, hf[3][:, :, :8])
    with pytest.raises(ValueError, match="shared_expert_gate"):
        build(7, hf[7][:, :5])
    with pytest.raises(ValueError, match="activation"):
        SwiGLUMoE.from_hf(block, activation="gelu")
    with pytest.raises(TypeError, match="block"):
        SwiGLUMoE.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="x: expected"):
        moe(tokens(3, hidden=31))
    with pytest.raises(ValueError, match="x: expected"):
        moe(tokens(3).double())


@pytest.mark.gpu
def test_block_replays_in_a_cuda_graph():
    """No host sync and fixed shapes whatever the routing: a captured block, replayed on new
    tokens (another routing), gives the eager call's result bit for bit (deterministic kernels)."""
    moe = SwiGLUMoE.from_hf(hf_block(seed=7, dtype=torch.bfloat16))
    static = tokens(5, seed=8, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static)
    static.copy_(tokens(5, seed=9, dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, moe(static))
