"""SwiGLUMoE (the Qwen3.5-MoE sparse block; today its PyTorch contract, issue 19's kernels to come)
against HF transformers' Qwen3_5MoeSparseMoeBlock on the same tensors: fp32 within 1e-5, bf16
within the one-rounding contract; routing as HF's; experts with no token, all tokens on the same
experts, odd token counts; a clamped activation against an expert-by-expert loop; bad input."""

import pytest
import torch

from conftest import DEVICE
from fuselm import Activation
from fuselm.ops.moe import SwiGLUMoE, route_ref
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


def test_all_tokens_on_the_same_experts_and_idle_experts():
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


def test_bf16_rounds_once():
    """bf16: against the fp32 block on the same (bf16-valued) tensors, within what one rounding of
    the output and the products' roundings allow; HF's bf16 block rounds after every expert's add."""
    block = hf_block(seed=3, dtype=torch.bfloat16)
    x = tokens(16, seed=4, dtype=torch.bfloat16)
    out = SwiGLUMoE.from_hf(block)(x).float()
    exact = SwiGLUMoE.from_hf(hf_block(seed=3, dtype=torch.bfloat16).float())(x.float())
    assert torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0) > 0.9995


def test_clamped_activation_against_an_expert_by_expert_loop():
    block = hf_block(seed=5)
    x = tokens(11, seed=6) * 4  # large enough that the clamp at 0.5 bites
    act = Activation.swiglu_limit(0.5)
    moe = SwiGLUMoE.from_hf(block, activation=act)
    weights, experts = route_ref(x, moe.router, 2)
    F_ = moe.down.shape[2]
    expected = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(2):
            e = experts[t, j]
            h = silu_mul_ref(x[t] @ moe.gate_up[e, :F_].T, x[t] @ moe.gate_up[e, F_:].T, act)
            expected[t] += weights[t, j].double() * (h @ moe.down[e].T).double()
        shared = silu_mul_ref(x[t] @ moe.shared_gate.T, x[t] @ moe.shared_up.T, act) @ moe.shared_down.T
        expected[t] += torch.sigmoid(x[t] @ moe.shared_expert_gate[0]).double() * shared.double()
    out = moe(x)
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    with torch.no_grad():
        assert (out - block(x[None])[0]).abs().max() > 1e-3  # the clamp changed the result


def test_bad_input_names_the_argument():
    block = hf_block()
    moe = SwiGLUMoE.from_hf(block)
    with pytest.raises(ValueError, match="top_k"):
        SwiGLUMoE(moe.router, 9, moe.gate_up, moe.down, moe.shared_gate, moe.shared_up, moe.shared_down,
                  moe.shared_expert_gate)
    with pytest.raises(ValueError, match="down"):
        SwiGLUMoE(moe.router, 2, moe.gate_up, moe.down[:, :, :8], moe.shared_gate, moe.shared_up, moe.shared_down,
                  moe.shared_expert_gate)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        SwiGLUMoE(moe.router, 2, moe.gate_up, moe.down, moe.shared_gate, moe.shared_up, moe.shared_down,
                  moe.shared_expert_gate[:, :5])
    with pytest.raises(ValueError, match="activation"):
        SwiGLUMoE.from_hf(block, activation="gelu")
    with pytest.raises(TypeError, match="block"):
        SwiGLUMoE.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="x: expected"):
        moe(tokens(3, hidden=31))
    with pytest.raises(ValueError, match="x: expected"):
        moe(tokens(3).double())
