"""The MoE decode path (ops/moe/decode.py, issue 19): ``router_logits``, and ``pair_gate_up`` and
``down_combine`` routing from the logits themselves, against their references (the routing
contract, the grouped path's products), every activation, fp32 and fp16 (bf16 on the GPU), odd
shapes, several tiles, poisoned outputs; ties to the lower expert id; ``SwiGLUMoE`` on the decode
path equal to the grouped path; programmatic dependent launch against plain launches (GPU); bad
input; the CPU fallback."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from helpers import randn
from fuselm import Activation, runtime
from fuselm.ops.moe import SwiGLUMoE, op
from fuselm.ops.moe.decode import (PairGemvConfig, down_combine, down_combine_ref, pair_gate_up, pair_gate_up_ref,
                                   router_logits, routing_ref)
from fuselm.ops.moe.routing import route_pairs_ref
from fuselm.testing import assert_close, poisoned_like
from test_moe import hf_block, tokens
from test_moe_grouped_gemm import (ACT_IDS, ACTIVATIONS, DTYPES, E_TOTAL, F_, H, N, SHARED, TOP_K, assert_matches,
                                   expert_weights)

S = TOP_K + SHARED
E = E_TOTAL - SHARED  # routed experts
R = E + 1 + 3  # router rows: the router's, the shared gate's, padding
# Several feature tiles and a K tail at H = 40, F = 24.
TILES = [None, PairGemvConfig(4, 32, 2, 1), PairGemvConfig(16, 32, 2, 1)]
TILE_IDS = ["default", "4x32", "16x32"]


def random_logits(dtype, n=N):
    return randn(n, R, dtype=dtype)


@pytest.mark.parametrize("config", [None, PairGemvConfig(1, 16, 1, 1), PairGemvConfig(8, 64, 4, 1)],
                         ids=["default", "1x16", "8x64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_router_logits_match_linear(dtype, config):
    x, w = randn(N, H, dtype=dtype), randn(R, H, dtype=dtype)
    logits = router_logits(x, w, config=config, out=poisoned_like(torch.empty(N, R, dtype=dtype, device=DEVICE)))
    ref = F.linear(x.double(), w.double())  # fp32 sums in another order, one rounding
    assert logits.shape == (N, R) and logits.dtype == dtype
    assert_close(logits, ref, {torch.float32: 1e-6}.get(dtype, 4e-3))


def test_routing_reference_matches_the_grouped_paths():
    """routing_ref (top-k on exp(l - max)) and route_pairs_ref (on the probabilities) agree."""
    x, w = randn(N, H), randn(R, H)
    experts, weights = routing_ref(F.linear(x, w), TOP_K, E, SHARED)
    grouped = route_pairs_ref(x, w, TOP_K, SHARED, 16, E)
    assert torch.equal(experts, grouped.experts)
    assert_close(weights, grouped.weights, 1e-6)


@pytest.mark.parametrize("config", TILES, ids=TILE_IDS)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_gate_up_matches_reference(dtype, act, config):
    x = randn(N, H, dtype=dtype) * 3  # large enough that the clamps at 0.5 / 0.6 bite
    w13, _ = expert_weights(dtype)
    logits = random_logits(dtype)
    h = pair_gate_up(x, w13, logits, TOP_K, act, num_experts=E, config=config,
                     out=poisoned_like(torch.empty(N * S, F_, dtype=dtype, device=DEVICE)))
    assert h.shape == (N * S, F_) and h.dtype == dtype
    assert_matches(h, pair_gate_up_ref(x, w13, logits, TOP_K, act, num_experts=E), dtype, "h")


@pytest.mark.parametrize("out_dtype", [torch.float32, None])
@pytest.mark.parametrize("config", [None, PairGemvConfig(16, 0, 4, 1), PairGemvConfig(1, 0, 2, 1)],
                         ids=["default", "16", "1"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_down_combine_matches_reference(dtype, config, out_dtype):
    out_dtype = out_dtype or dtype
    h = randn(N * S, F_, dtype=dtype)
    _, w2 = expert_weights(dtype)
    logits = random_logits(dtype)
    out = down_combine(h, w2, logits, TOP_K, out_dtype, num_experts=E, config=config,
                       out=poisoned_like(torch.empty(N, H, dtype=out_dtype, device=DEVICE)))
    ref = down_combine_ref(h, w2, logits, TOP_K, out_dtype, num_experts=E)
    assert out.shape == (N, H) and out.dtype == out_dtype
    assert not out.isnan().any()
    # y rounded to dtype inside (summation order may move a product one ulp), then one more rounding.
    assert_close(out, ref, {torch.float32: 1e-5, torch.float16: 1e-3}.get(dtype, 8e-3))


@pytest.mark.parametrize("config", [None, PairGemvConfig(16, 8, 4, 1)], ids=["default", "16x8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_writes_the_routing_down_reads(dtype, config):
    """routing_out: gate/up's last routed program of each token writes routing_ref's routing; down
    on it (the loop kernel) equals down routing itself."""
    x, h = randn(N, H, dtype=dtype), randn(N * S, F_, dtype=dtype)
    w13, w2 = expert_weights(dtype)
    logits = random_logits(dtype)
    routing = (torch.full((N, S), -7, dtype=torch.int32, device=DEVICE),
               poisoned_like(torch.empty(N, S, device=DEVICE)))
    pair_gate_up(x, w13, logits, TOP_K, Activation(), num_experts=E, routing_out=routing)
    experts, weights = routing_ref(logits, TOP_K, E, SHARED)
    assert torch.equal(routing[0], experts)
    assert_close(routing[1], weights, 1e-6)
    out = down_combine(h, w2, logits, TOP_K, dtype, num_experts=E, routing=routing, config=config)
    assert_close(out, down_combine(h, w2, logits, TOP_K, dtype, num_experts=E),
                 {torch.float32: 1e-5, torch.float16: 1e-3}.get(dtype, 8e-3))


def test_ties_go_to_the_lower_expert_and_weights_renormalise():
    """Equal logits: the lowest ids, equal weights; the shared slot gets sigmoid(gate logit)."""
    logits = torch.zeros(2, R, device=DEVICE)
    logits[1, 3] = 1.0  # token 1: expert 3 first, then the lowest of the tied rest
    experts, weights = routing_ref(logits, TOP_K, E, SHARED)
    assert experts.tolist() == [[0, 1, E], [3, 0, E]]
    x = randn(2, H)
    w13, w2 = expert_weights(torch.float32)
    act = Activation()
    h = pair_gate_up(x, w13, logits, TOP_K, act, num_experts=E)
    for n in range(2):
        for j, e in enumerate(experts[n].tolist()):
            g, u = F.linear(x[n], w13[e, 0::2]), F.linear(x[n], w13[e, 1::2])
            assert_close(h[n * S + j], F.silu(g) * u, 1e-5)
    out = down_combine(h, w2, logits, TOP_K, torch.float32, num_experts=E)
    expected = sum(weights[:, j, None] * torch.stack([h[n * S + j] @ w2[experts[n, j]].T for n in range(2)])
                   for j in range(S))
    assert_close(out, expected, 1e-5)
    assert weights[0, 0] == weights[0, 1] == 0.5 and weights[0, 2] == 0.5  # sigmoid(0)


def test_down_combine_rounds_each_product_then_sums_in_fp32():
    """fp16: with one routed slot (weight 1) the output is the product rounded to fp16 (the
    product's rounding is not skipped); with two tied slots of weight 0.5 on two copies of that
    expert it is that value again, summed in fp32 (no second rounding between slots)."""
    h = randn(2, F_, dtype=torch.float16)
    _, w2 = expert_weights(torch.float16, e=E)
    w2[1] = w2[3]
    y = (h[:1].float() @ w2[3].float().T).half()
    first = torch.zeros(1, E + 1, dtype=torch.float16, device=DEVICE)
    first[0, 3] = 1.0
    one = down_combine(h[:1], w2, first, 1, torch.float32, num_experts=E)
    assert_close(one, y.float(), 1e-3)
    tied = torch.zeros(1, E + 1, dtype=torch.float16, device=DEVICE)
    tied[0, 1] = tied[0, 3] = 1.0  # experts 1 and 3, weight 0.5 each
    twice = down_combine(torch.cat([h[:1], h[:1]]), w2, tied, 2, torch.float32, num_experts=E)
    assert torch.equal(twice, one)


@pytest.mark.parametrize("n", [1, 2, 3, 16])
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


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 8, 16])
def test_dependent_launches_equal_plain_launches_in_a_graph(n, monkeypatch):
    """Programmatic dependent launch (the router's, gate/up's and down's programs overlapping) in a
    CUDA graph of four blocks in a row, each layer's output the next one's input, replayed on new
    tokens: bit for bit the plain launches' result, eager."""
    blocks = [SwiGLUMoE.from_hf(hf_block(experts=16, top_k=4, hidden=256, ffn=128, shared=128, seed=s,
                                         dtype=torch.bfloat16)) for s in range(4)]

    def layers(x):
        for moe in blocks:
            x = moe(x)
        return x

    static = tokens(n, hidden=256, seed=8, dtype=torch.bfloat16)
    assert runtime.use_pdl(static.device) == (torch.cuda.get_device_capability()[0] >= 9)
    graph, out = runtime.capture_graph(lambda: layers(static))
    static.copy_(tokens(n, hidden=256, seed=9, dtype=torch.bfloat16))
    graph.replay()
    monkeypatch.setattr(runtime, "PDL", False)
    assert torch.equal(out, layers(static))


def _inputs():
    w13, w2 = expert_weights(torch.float32)
    return dict(x=randn(N, H), w13=w13, w2=w2, lg=random_logits(torch.float32), h=randn(N * S, F_),
                router=randn(R, H))


@pytest.mark.parametrize("call, match", [
    (lambda a: router_logits(a["x"], a["router"][:, :-1]), "router_with_gate: expected"),
    (lambda a: router_logits(a["x"], a["router"].half()), "router_with_gate: expected"),
    (lambda a: router_logits(a["x"], a["router"], out=torch.empty(N, R + 1, device=DEVICE)), "out: expected"),
    (lambda a: pair_gate_up(a["x"][:, :30], a["w13"], a["lg"], TOP_K, Activation(), num_experts=E), "w13: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"][:, :-1], a["lg"], TOP_K, Activation(), num_experts=E), "w13: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"].half(), a["lg"], TOP_K, Activation(), num_experts=E), "w13: dtype"),
    (lambda a: pair_gate_up(a["x"].long(), a["w13"], a["lg"], TOP_K, Activation(), num_experts=E), "x: dtype"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"], TOP_K, "silu", num_experts=E), "activation"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"].half(), TOP_K, Activation(), num_experts=E), "logits: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"][:-1], TOP_K, Activation(), num_experts=E), "logits: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"][:, :E], TOP_K, Activation(), num_experts=E), "logits: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"], E + 1, Activation(), num_experts=E), "top_k"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"], 0, Activation(), num_experts=E), "top_k"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"], TOP_K, Activation(), num_experts=E_TOTAL + 1), "num_experts"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"], TOP_K, Activation(), num_experts=E,
                            out=torch.empty(N * S, F_ + 1, device=DEVICE)), "out: expected"),
    (lambda a: down_combine(a["h"], a["w2"][:, :, :-1], a["lg"], TOP_K, torch.float32, num_experts=E), "w2: expected"),
    (lambda a: down_combine(a["h"], a["w2"].half(), a["lg"], TOP_K, torch.float32, num_experts=E), "w2: dtype"),
    (lambda a: down_combine(a["h"][:-1], a["w2"], a["lg"], TOP_K, torch.float32, num_experts=E), "h: expected"),
    (lambda a: down_combine(a["h"], a["w2"], a["lg"][:, :E], TOP_K, torch.float32, num_experts=E), "logits: expected"),
    (lambda a: down_combine(a["h"], a["w2"], a["lg"], TOP_K, torch.int8, num_experts=E), "out_dtype"),
    (lambda a: down_combine(a["h"], a["w2"], a["lg"], TOP_K, torch.float32, num_experts=E,
                            routing=(torch.zeros(N, S, dtype=torch.int64), torch.zeros(N, S))), "routing: expected"),
    (lambda a: pair_gate_up(a["x"], a["w13"], a["lg"], TOP_K, Activation(), num_experts=E,
                            routing_out=torch.zeros(N, S)), "routing_out: expected"),
    (lambda a: down_combine(a["h"], a["w2"], a["lg"], TOP_K, torch.float32, num_experts=E,
                            out=torch.empty(N, H, dtype=torch.float16, device=DEVICE)), "out: expected"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_inputs())


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    import fuselm.ops.moe.decode as decode

    monkeypatch.setattr(decode, "use_triton", lambda t: False)
    a = {k: v.cpu() for k, v in _inputs().items()}
    assert torch.equal(router_logits(a["x"], a["router"]), F.linear(a["x"], a["router"]))
    act = Activation.swiglu_oai(0.6, 1.702)
    h = pair_gate_up(a["x"], a["w13"], a["lg"], TOP_K, act, num_experts=E)
    assert torch.equal(h, pair_gate_up_ref(a["x"], a["w13"], a["lg"], TOP_K, act, num_experts=E))
    out = down_combine(h, a["w2"], a["lg"], TOP_K, torch.float16, num_experts=E)
    assert torch.equal(out, down_combine_ref(h, a["w2"], a["lg"], TOP_K, torch.float16, num_experts=E))
    routing = (torch.empty(N, S, dtype=torch.int32), torch.empty(N, S))
    pair_gate_up(a["x"], a["w13"], a["lg"], TOP_K, act, num_experts=E, routing_out=routing)
    assert all(torch.equal(got, ref) for got, ref in zip(routing, routing_ref(a["lg"], TOP_K, E, SHARED)))
    assert torch.equal(down_combine(h, a["w2"], a["lg"], TOP_K, torch.float16, num_experts=E, routing=routing), out)
