"""The MoE decode path (ops/moe/decode.py, issue 19): ``pair_gate_up`` and ``down_combine`` against
their references (the grouped path's contract), every activation, fp32 and fp16 (bf16 on the
GPU), odd shapes, several tiles, poisoned outputs; the routing
without its sort; ``SwiGLUMoE`` on the decode path equal to the grouped path; bad input; the CPU
fallback."""

import pytest
import torch

from conftest import DEVICE
from helpers import randn
from fuselm import Activation
from fuselm.ops.moe import SwiGLUMoE, op
from fuselm.ops.moe.decode import (PairGemvConfig, down_combine, down_combine_ref, pair_gate_up,
                                   pair_gate_up_ref)
from fuselm.ops.moe.routing import route
from fuselm.testing import assert_close, poisoned_like
from test_moe import hf_block, tokens
from test_moe_grouped_gemm import (ACT_IDS, ACTIVATIONS, DTYPES, E_TOTAL, F_, H, N, SHARED, TOP_K, assert_matches,
                                   expert_weights, random_experts)

S = TOP_K + SHARED
# Several feature tiles and a K tail at H = 40, F = 24.
TILES = [None, PairGemvConfig(4, 32, 2, 1), PairGemvConfig(16, 32, 2, 1)]
TILE_IDS = ["default", "4x32", "16x32"]


@pytest.mark.parametrize("config", TILES, ids=TILE_IDS)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_gate_up_matches_reference(dtype, act, config):
    x = randn(N, H, dtype=dtype) * 3  # large enough that the clamps at 0.5 / 0.6 bite
    w13, _ = expert_weights(dtype)
    experts = random_experts()
    h = pair_gate_up(x, w13, experts, act, config=config,
                     out=poisoned_like(torch.empty(N * S, F_, dtype=dtype, device=DEVICE)))
    assert h.shape == (N * S, F_) and h.dtype == dtype
    assert_matches(h, pair_gate_up_ref(x, w13, experts, act), dtype, "h")


@pytest.mark.parametrize("out_dtype", [torch.float32, None])
@pytest.mark.parametrize("config", [None, PairGemvConfig(16, 8, 4, 1)], ids=["default", "16x8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_down_combine_matches_reference(dtype, config, out_dtype):
    out_dtype = out_dtype or dtype
    experts = random_experts()
    h = randn(N * S, F_, dtype=dtype)
    _, w2 = expert_weights(dtype)
    weights = torch.rand(N, S, device=DEVICE)
    out = down_combine(h, w2, experts, weights, out_dtype, config=config,
                       out=poisoned_like(torch.empty(N, H, dtype=out_dtype, device=DEVICE)))
    ref = down_combine_ref(h, w2, experts, weights, out_dtype)
    assert out.shape == (N, H) and out.dtype == out_dtype
    assert not out.isnan().any()
    # y rounded to dtype inside (summation order may move a product one ulp), then one more rounding.
    assert_close(out, ref, {torch.float32: 1e-5, torch.float16: 1e-3}.get(dtype, 8e-3))


def test_down_combine_rounds_each_product_then_sums_in_fp32():
    """fp16: with one slot of weight 1 the output is the product rounded to fp16 (the product's
    rounding is not skipped); with weight 0.5 twice on the same expert it is that value again,
    summed in fp32 (no second rounding between slots)."""
    h = randn(2, F_, dtype=torch.float16)
    _, w2 = expert_weights(torch.float16)
    y = (h[:1].float() @ w2[3].float().T).half()
    one = down_combine(h[:1], w2, torch.tensor([[3]], dtype=torch.int32, device=DEVICE),
                       torch.ones(1, 1, device=DEVICE), torch.float32)
    assert_close(one, y.float(), 1e-3)
    twice = down_combine(torch.cat([h[:1], h[:1]]), w2, torch.tensor([[3, 3]], dtype=torch.int32, device=DEVICE),
                         torch.full((1, 2), 0.5, device=DEVICE), torch.float32)
    assert torch.equal(twice, one)


def test_route_without_sort_gives_the_same_weights_and_experts():
    x = randn(5, H)
    router = randn(E_TOTAL + 1, H)
    full = route(x, router, TOP_K, SHARED, 16)
    bare = route(x, router, TOP_K, SHARED, 16, sort=False)
    assert bare.sorted_pairs is None and bare.block_experts is None
    assert torch.equal(bare.weights, full.weights) and torch.equal(bare.experts, full.experts)
    with pytest.raises(ValueError, match="sort"):
        route(x, router, TOP_K, SHARED, 16, sort=1)


@pytest.mark.parametrize("n", [1, 5, 16])
def test_block_on_the_decode_path_equals_the_grouped_path(n, monkeypatch):
    """``SwiGLUMoE`` up to PAIR_PATH_TOKENS tokens takes the decode path; forced onto the grouped
    path (PAIR_PATH_TOKENS = 0) it gives the same result (fp32: summation order only)."""
    assert n <= op.PAIR_PATH_TOKENS
    moe = SwiGLUMoE.from_hf(hf_block(), Activation.swiglu_limit(0.8))  # a shared expert of 2 chunks
    x = tokens(n)
    decode = moe(x)
    monkeypatch.setattr(op, "PAIR_PATH_TOKENS", 0)
    grouped = moe(x)
    assert (decode - grouped).abs().max() <= 1e-5 * grouped.abs().max().clamp(min=1)


def _inputs():
    experts = random_experts()
    w13, w2 = expert_weights(torch.float32)
    return dict(x=randn(N, H), w13=w13, w2=w2, e=experts, h=randn(N * S, F_),
                weights=torch.rand(N, S, device=DEVICE))


@pytest.mark.parametrize("call, match", [
    (lambda a: pair_gate_up(a["x"][:, :30], a["w13"], a["e"], Activation()), "w13: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"][:, :-1], a["e"], Activation()), "w13: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"].half(), a["e"], Activation()), "w13: dtype"),
    (lambda a: pair_gate_up(a["x"].long(), a["w13"], a["e"], Activation()), "x: dtype"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["e"], "silu"), "activation"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["e"].long(), Activation()), "experts: dtype"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["e"][:-1], Activation()), "experts: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["e"], Activation(),
                            out=torch.empty(N * S, F_ + 1, device=DEVICE)), "out: expected"),
    (lambda a: down_combine(a["h"], a["w2"][:, :, :-1], a["e"], a["weights"], torch.float32), "w2: expected"),
    (lambda a: down_combine(a["h"], a["w2"].half(), a["e"], a["weights"], torch.float32), "w2: dtype"),
    (lambda a: down_combine(a["h"][:-1], a["w2"], a["e"], a["weights"], torch.float32), "h: expected"),
    (lambda a: down_combine(a["h"], a["w2"], a["e"], a["weights"].half(), torch.float32), "weights: dtype"),
    (lambda a: down_combine(a["h"], a["w2"], a["e"], a["weights"][:, :-1], torch.float32), "weights: expected"),
    (lambda a: down_combine(a["h"], a["w2"], a["e"], a["weights"], torch.int8), "out_dtype"),
    (lambda a: down_combine(a["h"], a["w2"], a["e"], a["weights"], torch.float32,
                            out=torch.empty(N, H, dtype=torch.float16, device=DEVICE)), "out: expected"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_inputs())


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    import fuselm.ops.moe.decode as decode

    monkeypatch.setattr(decode, "use_triton", lambda t: False)
    a = {k: v.cpu() for k, v in _inputs().items()}
    act = Activation.swiglu_oai(0.6, 1.702)
    h = pair_gate_up(a["x"], a["w13"], a["e"], act)
    assert torch.equal(h, pair_gate_up_ref(a["x"], a["w13"], a["e"], act))
    out = down_combine(h, a["w2"], a["e"], a["weights"], torch.float16)
    assert torch.equal(out, down_combine_ref(h, a["w2"], a["e"], a["weights"], torch.float16))
