"""MoE routing kernels (ops/moe/routing.py, issue 19): weights and expert ids against the PyTorch
reference (fp32: ids identical, weights within 1e-6; 16-bit: ids identical off near-ties, weights
within the dtype's rounding); ties to the lower id on exactly representable inputs; the sorted pair
list and block experts against a brute-force build, exactly (N = 1, odd N, idle experts, all tokens
on the same experts, N S not a multiple of block_m, 0-2 shared chunks); outputs written in full
into poisoned buffers; the reference against naive.route_ref; bad arguments."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, ON_GPU
from helpers import randn
from fuselm.ops.moe import route_ref, routing
from fuselm.ops.moe.routing import Routing, max_pairs, place_kernel, route, route_pairs_ref, sort_pairs_ref

# Matrix kernel: bf16 only on the GPU (the interpreter's bf16 tl.dot is wrong, triton 11584).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
GARBAGE = 777  # prefilled into the int outputs: an unwritten entry shows


def router(E, H, dtype, scale=1.0):
    """[E + 1, H]: the router's E rows and the shared gate's row."""
    return randn(E + 1, H, dtype=dtype, scale=scale * H ** -0.5)


def poisoned_routing(N, S, E_total, block_m):
    p_max = max_pairs(N, S, E_total, block_m)
    ints = {"dtype": torch.int32, "device": DEVICE}
    return Routing(torch.full((N, S), float("nan"), device=DEVICE), torch.full((N, S), GARBAGE, **ints),
                   torch.full((p_max,), GARBAGE, **ints), torch.full((p_max // block_m,), GARBAGE, **ints), 0, 0, 0)


def expected_pairs(experts, E_total, block_m):
    """Brute force: per expert ascending, its pair ids ascending, padded with N S to block_m."""
    flat = experts.reshape(-1).tolist()
    sentinel = len(flat)
    pairs, blocks = [], []
    for e in range(E_total):
        mine = [p for p, x in enumerate(flat) if x == e]
        if mine:
            padded = -(-len(mine) // block_m) * block_m
            pairs += mine + [sentinel] * (padded - len(mine))
            blocks += [e] * (padded // block_m)
    p_max = max_pairs(experts.shape[0], experts.shape[1], E_total, block_m)
    assert len(pairs) <= p_max
    return pairs + [sentinel] * (p_max - len(pairs)), blocks + [-1] * (p_max // block_m - len(blocks))


def assert_pairs(r: Routing, E_total):
    pairs, blocks = expected_pairs(r.experts.cpu(), E_total, r.block_m)
    assert r.sorted_pairs.tolist() == pairs, "sorted_pairs"
    assert r.block_experts.tolist() == blocks, "block_experts"


def tie_free_tokens(x, w, top_k, dtype):
    """Tokens whose exact (fp64) top k + 1 logits are more than two roundings apart (each rounding
    moves a logit by at most eps / 2 of its size): no rounding to ``dtype`` can reorder or tie them."""
    E = w.shape[0] - 1
    logits = (x.double() @ w[:E].double().T).cpu()
    top = logits.sort(dim=-1, descending=True).values[:, :min(top_k + 1, E)]
    gap = (top[:, :-1] - top[:, 1:]).min(dim=-1).values if top.shape[1] > 1 else torch.full((len(x),), 1e9)
    return gap > 2 * torch.finfo(dtype).eps * top.abs().max(dim=-1).values.clamp(min=1)


# 16-bit weights against the reference: the same rounded value but where a sum order moves one
# across a rounding boundary (one ulp); on the GPU cuBLAS and tl.dot may also round a logit one
# ulp apart, which moves a weight by up to |logit| ulps.
ULPS = 4 if ON_GPU else 1


def assert_ulps(out, ref, dtype, ulps=ULPS):
    finfo = torch.finfo(dtype)
    ulp = torch.maximum(ref.abs() * finfo.eps, torch.tensor(finfo.smallest_normal * finfo.eps, device=ref.device))
    worst = ((out - ref).abs() / ulp).max().item() if ref.numel() else 0.0
    assert worst <= ulps, f"weights: {worst:.1f} ulps from the reference"


CASES = [  # N, H, E, top_k, num_shared, block_m
    (1, 40, 7, 3, 1, 16),
    (13, 40, 7, 3, 1, 16),
    (13, 33, 7, 3, 0, 16),
    (13, 33, 7, 3, 2, 16),
    (37, 70, 20, 4, 2, 32),
    (5, 16, 1, 1, 1, 16),
    (19, 64, 40, 8, 1, 64),
    (40, 24, 16, 4, 1, 16),  # E a power of two: the routing kernel's unmasked logits load, past 16 tokens
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, H, E, top_k, num_shared, block_m", CASES)
def test_route_matches_reference(N, H, E, top_k, num_shared, block_m, dtype):
    x, w = randn(N, H, dtype=dtype), router(E, H, dtype, scale=2.0)
    # 16-bit: redraw until enough tokens are tie-free (bf16's 8-bit mantissa leaves ~10% of the
    # tokens tie-free at E 40, k 8: an eighth of them is asked for there, half in fp16)
    need = (N + 1) // 2 if dtype == torch.float16 else max(1, N // 8)
    for _ in range(20 if dtype != torch.float32 else 0):
        if tie_free_tokens(x, w, top_k, dtype).sum() >= need:
            break
        x = randn(N, H, dtype=dtype)
    S, E_total = top_k + num_shared, E + num_shared
    r = route(x, w, top_k, num_shared, block_m, out=poisoned_routing(N, S, E_total, block_m))
    assert (r.top_k, r.num_shared, r.block_m) == (top_k, num_shared, block_m)
    assert not r.weights.isnan().any(), "an element of weights was not written"
    ref = route_pairs_ref(x, w, top_k, num_shared, block_m)
    if dtype == torch.float32:
        assert torch.equal(r.experts, ref.experts)
        assert (r.weights - ref.weights).abs().max() <= 1e-6
    else:
        ok = tie_free_tokens(x, w, top_k, dtype)
        assert ok.sum() >= need, "too few tie-free tokens to test"
        assert torch.equal(r.experts[ok], ref.experts[ok])
        assert torch.equal(r.experts[:, top_k:], ref.experts[:, top_k:])
        assert_ulps(r.weights[ok], ref.weights[ok], dtype)
        assert torch.equal(r.weights[:, :top_k], r.weights[:, :top_k].to(dtype).float()), "routed weights not rounded"
        # The shared scale is an fp32 sigmoid of the rounded logit: fp32-close where both round
        # the logit alike (always in the interpreter; cuBLAS and tl.dot may differ by an ulp).
        if ON_GPU:
            assert_ulps(r.weights[:, top_k:], ref.weights[:, top_k:], dtype)
        elif num_shared:
            assert (r.weights[:, top_k:] - ref.weights[:, top_k:]).abs().max() <= 1e-6
    # Each routed weight row sums to 1 up to the rounding; shared slots hold one scale per token.
    assert ((r.weights[:, :top_k].sum(-1) - 1).abs() <= top_k * torch.finfo(dtype).eps).all()
    if num_shared:
        assert torch.equal(r.weights[:, top_k:], r.weights[:, top_k:top_k + 1].expand(N, num_shared))
    assert_pairs(r, E_total)  # the kernel's list from the kernel's ids, exactly
    if torch.equal(r.experts, ref.experts):
        assert torch.equal(r.sorted_pairs, ref.sorted_pairs) and torch.equal(r.block_experts, ref.block_experts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_logits_and_ties_go_to_the_lower_id(dtype):
    """Small integer tokens and quarter-integer router weights: every logit is exact in each dtype,
    so both sides see the same logits, with many exact ties: ids identical, ties to the lower id."""
    N, H, E, top_k = 29, 24, 9, 3
    x = torch.randint(-2, 3, (N, H)).to(DEVICE, dtype)
    w = (torch.randint(-1, 2, (E + 1, H)) * 0.25).to(DEVICE, dtype)
    r = route(x, w, top_k, 1, 16, out=poisoned_routing(N, top_k + 1, E + 1, 16))
    ref = route_pairs_ref(x, w, top_k, 1, 16)
    logits = (x.double() @ w[:E].double().T).cpu()
    top = logits.sort(dim=-1, descending=True).values[:, :top_k + 1]
    assert (top[:, 1:] == top[:, :-1]).any(dim=-1).sum() >= N // 4, "too few ties to test"
    assert torch.equal(r.experts, ref.experts)
    for n in range(N):  # ties: lower id first
        for j in range(top_k - 1):
            a, b = ref.experts[n, j].item(), ref.experts[n, j + 1].item()
            assert logits[n, a] > logits[n, b] or a < b
    if dtype == torch.float32:
        assert (r.weights - ref.weights).abs().max() <= 1e-6
    else:
        assert_ulps(r.weights, ref.weights, dtype)
    assert torch.equal(r.sorted_pairs, ref.sorted_pairs) and torch.equal(r.block_experts, ref.block_experts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_on_the_same_experts_and_idle_experts(dtype):
    """Router rows favour experts 5 then 2; every other logit is 0 (a tie: the third choice is 0);
    experts 1, 3, 4 and 6 get nothing. Layout written out by hand."""
    N, H, E, top_k = 13, 20, 7, 3
    w = torch.zeros(E + 1, H)
    w[5], w[2], w[E] = 1.0, 0.5, 0.1
    w = w.to(DEVICE, dtype)
    x = (torch.rand(N, H) + 0.1).to(DEVICE, dtype)  # positive: expert 5 first, then 2
    r = route(x, w, top_k, 1, 16, out=poisoned_routing(N, 4, 8, 16))
    assert r.experts.tolist() == [[5, 2, 0, 7]] * N
    pairs = []
    for slot in (2, 1, 0, 3):  # experts 0, 2, 5, 7: 13 pairs each, padded to 16
        pairs += [n * 4 + slot for n in range(N)] + [4 * N] * 3
    p_max = max_pairs(N, 4, 8, 16)
    assert p_max == 176
    assert r.sorted_pairs.tolist() == pairs + [4 * N] * (p_max - len(pairs))
    assert r.block_experts.tolist() == [0, 2, 5, 7] + [-1] * 7
    ref = route_pairs_ref(x, w, top_k, 1, 16)
    assert torch.equal(r.experts, ref.experts) and torch.equal(r.sorted_pairs, ref.sorted_pairs)
    if dtype == torch.float32:
        assert (r.weights - ref.weights).abs().max() <= 1e-6
    else:
        assert_ulps(r.weights, ref.weights, dtype)
    assert (r.weights[:, 2] > 0).all()


def chunk_counts(experts, top_k, E):
    """The routing kernel's counts [chunks, E_PAD]: each chunk's routed pairs per expert."""
    N, chunk = experts.shape[0], routing.route_chunk(experts.shape[0])
    counts = torch.zeros(routing.counts_shape(N, E), dtype=torch.int32)
    for c in range(counts.shape[0]):
        counts[c, :E] = torch.bincount(experts[c * chunk:(c + 1) * chunk, :top_k].reshape(-1).long(), minlength=E)
    return counts.to(DEVICE)


@pytest.mark.parametrize("N, top_k, E, num_shared, block_m, hot", [
    (1, 1, 3, 0, 16, None),
    (7, 5, 12, 1, 16, None),  # 42 pairs: not a multiple of block_m
    (61, 9, 7, 2, 16, None),  # 9 slots on 7 experts: a token's slots repeat ids (as a NaN row's do)
    (40, 3, 300, 1, 32, None),  # 512 padded ids: wide hits, narrow pair blocks
    (53, 4, 6, 1, 64, 3),  # every routed pair on expert 3; the others idle
    (9, 2, 40, 1, 128, None),  # most experts idle, block_m larger than all pairs
    (300, 8, 256, 1, 64, None),  # Qwen3.5-MoE's 256 experts + 1 shared: 19 chunks
])
def test_place_kernel_against_a_brute_force_build(N, top_k, E, num_shared, block_m, hot):
    if hot is None:
        routed = torch.randint(0, E, (N, top_k), dtype=torch.int32)
        routed[routed % 4 == 1] = 0  # a crowded expert 0 beside idle ones
    else:
        routed = torch.full((N, top_k), hot, dtype=torch.int32)
    shared = torch.arange(E, E + num_shared, dtype=torch.int32).expand(N, num_shared)
    experts = torch.cat([routed, shared], dim=1).contiguous().to(DEVICE)
    E_total = E + num_shared
    p_max = max_pairs(N, top_k + num_shared, E_total, block_m)
    sorted_pairs = torch.full((p_max,), GARBAGE, dtype=torch.int32, device=DEVICE)
    block_experts = torch.full((p_max // block_m,), GARBAGE, dtype=torch.int32, device=DEVICE)
    if routing.use_triton(experts):
        place_kernel(experts, chunk_counts(experts, top_k, E), E, top_k, num_shared, block_m, sorted_pairs,
                     block_experts)
    else:
        sorted_pairs, block_experts = sort_pairs_ref(experts, E_total, block_m)
    pairs, blocks = expected_pairs(experts.cpu(), E_total, block_m)
    assert sorted_pairs.tolist() == pairs
    assert block_experts.tolist() == blocks
    ref_pairs, ref_blocks = sort_pairs_ref(experts, E_total, block_m)
    assert ref_pairs.tolist() == pairs and ref_blocks.tolist() == blocks


def test_route_chunks_grow_past_the_most_programs(monkeypatch):
    """Past ROUTE_MAX_CHUNKS chunks of ROUTE_CHUNK tokens the chunks double (here: at most 2 chunks,
    so 300 tokens take 256-token chunks, many steps a program), and the routing is the same."""
    most = routing.ROUTE_CHUNK * routing.ROUTE_MAX_CHUNKS
    assert routing.route_chunk(most) == routing.ROUTE_CHUNK and routing.route_chunk(most + 1) == 2 * routing.ROUTE_CHUNK
    monkeypatch.setattr(routing, "ROUTE_MAX_CHUNKS", 2)
    assert routing.route_chunk(300) == 256
    test_place_kernel_against_a_brute_force_build(300, 8, 256, 1, 64, None)
    x, w = randn(300, 32), router(40, 32, torch.float32)
    r, ref = route(x, w, 8, 1, 16), route_pairs_ref(x, w, 8, 1, 16)
    for f in ("experts", "sorted_pairs", "block_experts"):
        assert torch.equal(getattr(r, f), getattr(ref, f)), f


@pytest.mark.parametrize("N", [5, 40])  # one program sorting; routing with counts, then the placement
def test_rows_past_the_gate_are_ignored(N):
    """router_with_gate with extra rows (``pad_router_rows``'s alignment, here garbage) and
    num_experts = E: the routing of the unpadded weight."""
    H, E, top_k = 24, 13, 3
    x, w = randn(N, H), router(E, H, torch.float32)
    padded = routing.pad_router_rows(w)
    assert padded.shape == (16, H) and torch.equal(padded[:E + 1], w)
    padded[E + 1:] = 1e3  # ignored rows: their logits would win every top-k
    r = route(x, padded, top_k, 1, 16, num_experts=E, out=poisoned_routing(N, top_k + 1, E + 1, 16))
    ref = route_pairs_ref(x, w, top_k, 1, 16)
    for f in ("experts", "sorted_pairs", "block_experts"):
        assert torch.equal(getattr(r, f), getattr(ref, f)), f
    torch.testing.assert_close(r.weights, ref.weights, rtol=1e-6, atol=0)


def test_reference_agrees_with_naive_route_ref_and_the_gate():
    N, H, E, top_k = 17, 48, 11, 4
    x, w = randn(N, H), router(E, H, torch.float32)
    ref = route_pairs_ref(x, w, top_k, 2, 16)
    weights, experts = route_ref(x, w[:E], top_k)  # no ties in fp32 random logits
    # one GEMM for the router and the gate row: the same logits up to the GEMM's summation order
    assert torch.equal(ref.experts[:, :top_k].long(), experts)
    torch.testing.assert_close(ref.weights[:, :top_k], weights, rtol=1e-6, atol=0)
    scale = torch.sigmoid(F.linear(x, w[E:]))
    torch.testing.assert_close(ref.weights[:, top_k:], scale.expand(N, 2), rtol=1e-6, atol=0)
    assert ref.experts[:, top_k:].tolist() == [[E, E + 1]] * N


def test_fixed_size_outputs_and_the_pytorch_fallback(monkeypatch):
    """Output sizes follow the shapes only; without Triton (plain CPU) route runs the reference
    into the same buffers; N = 0 gives empty outputs."""
    x, w = randn(6, 32), router(5, 32, torch.float32)
    a = route(x, w, 2, 1, 16)
    b = route(x * -3, w, 2, 1, 16)
    fields = ("weights", "experts", "sorted_pairs", "block_experts")
    assert all(getattr(a, f).shape == getattr(b, f).shape for f in fields)
    assert a.sorted_pairs.shape == (max_pairs(6, 3, 6, 16),)
    assert a.block_experts.shape == (a.sorted_pairs.numel() // 16,)
    monkeypatch.setattr(routing, "use_triton", lambda t: False)
    fallback = route(x, w, 2, 1, 16, out=poisoned_routing(6, 3, 6, 16))
    ref = route_pairs_ref(x, w, 2, 1, 16)
    for f in fields:
        assert torch.equal(getattr(fallback, f), getattr(ref, f)), f
    empty = route(x[:0], w, 2, 1, 16)
    assert empty.weights.shape == (0, 3) and empty.sorted_pairs.numel() == 0 and empty.block_experts.numel() == 0


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    from fuselm.runtime import capture_graph

    N, H, E, top_k = 24, 128, 64, 8
    w = router(E, H, torch.bfloat16)
    static = randn(N, H, dtype=torch.bfloat16)
    graph, out = capture_graph(lambda: route(static, w, top_k, 1, 64))
    fresh = randn(N, H, dtype=torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    direct = route(fresh, w, top_k, 1, 64)
    for f in ("weights", "experts", "sorted_pairs", "block_experts"):
        assert torch.equal(getattr(out, f), getattr(direct, f)), f
    assert_pairs(out, E + 1)


@pytest.mark.parametrize("call, match", [
    (lambda x, w: route(x, w, 0, 1, 16), "top_k"),
    (lambda x, w: route(x, w, 8, 1, 16), "top_k"),
    (lambda x, w: route(x, w, True, 1, 16), "top_k"),
    (lambda x, w: route(x, w, 2, -1, 16), "num_shared"),
    (lambda x, w: route(x, w, 2, 1.0, 16), "num_shared"),
    (lambda x, w: route(x, w, 2, 1, 8), "block_m"),
    (lambda x, w: route(x, w, 2, 1, 48), "block_m"),
    (lambda x, w: route(x[None], w, 2, 1, 16), "x"),
    (lambda x, w: route(x, w[:, :10], 2, 1, 16), "router_with_gate"),
    (lambda x, w: route(x, w[:1], 1, 1, 16), "router_with_gate"),
    (lambda x, w: route(x, w.half(), 2, 1, 16), "router_with_gate"),
    (lambda x, w: route(x, torch.zeros(514, 20, device=DEVICE), 2, 1, 16), "router_with_gate"),
    (lambda x, w: route(x, w, 2, 1, 16, num_experts=w.shape[0]), "num_experts"),
    (lambda x, w: route(x, w, 2, 1, 16, num_experts=0), "num_experts"),
    (lambda x, w: route(x, torch.zeros(8, 20, device="meta"), 2, 1, 16), "one device"),
    (lambda x, w: route(x, w, 2, 1, 16, out=poisoned_routing(5, 2, 8, 16)), "out.weights"),
    (lambda x, w: route(x, w, 2, 1, 16, out=poisoned_routing(5, 3, 9, 32)), "out.sorted_pairs"),
])
def test_bad_arguments_name_the_argument(call, match):
    x, w = randn(5, 20), router(7, 20, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_bad_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="x"):
        route(torch.zeros(3, 8, dtype=torch.int64, device=DEVICE), torch.zeros(4, 8, device=DEVICE), 1, 1, 16)


@pytest.mark.parametrize("few_pairs", [routing.FEW_PAIRS, 0])  # pairwise sort; one-hot sort in the program
@pytest.mark.parametrize("N, E, top_k, block_m", [(1, 7, 3, 16), (16, 7, 3, 64), (16, 40, 8, 16), (17, 7, 3, 16)])
def test_decode_routes_in_one_launch(N, E, top_k, block_m, few_pairs, monkeypatch):
    """Up to 16 tokens the routing kernel sorts the pairs itself (one launch: by pairwise
    comparisons up to FEW_PAIRS pairs, by one-hot counts past that); past 16 tokens the placement
    is a second launch. Same result every way (16 x 9 pairs: the 35B-A3B decode's 256-pair tile)."""
    sorts = []
    launch = routing.place_kernel
    monkeypatch.setattr(routing, "place_kernel", lambda *args: sorts.append(1) or launch(*args))
    monkeypatch.setattr(routing, "FEW_PAIRS", few_pairs)
    x = torch.randn(N, 40, generator=torch.Generator().manual_seed(N)).to(DEVICE)
    w = torch.randn(E + 1, 40, generator=torch.Generator().manual_seed(99)).to(DEVICE) * 0.2
    got = route(x, w, top_k, 1, block_m)
    assert len(sorts) == (N > 16)
    expected = route_pairs_ref(x, w, top_k, 1, block_m)
    assert torch.equal(got.experts, expected.experts)
    assert torch.equal(got.sorted_pairs, expected.sorted_pairs)
    assert torch.equal(got.block_experts, expected.block_experts)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on NaN rows
@pytest.mark.parametrize("N, few_pairs", [(16, routing.FEW_PAIRS), (16, 0), (40, routing.FEW_PAIRS)])
def test_nan_tokens_crowd_one_expert_and_the_list_stays_valid(N, few_pairs, monkeypatch):
    """A NaN token matches no probability: each of its k slots gets expert E - 1 (kept in range).
    With 12 such tokens of 16 that expert holds 36 pairs, three 16-row blocks, the one way a decode
    batch puts more than block_m pairs on one expert; the list is still the exact sort of the ids
    (past 16 tokens too, where the placement ranks a token's repeated id slot by slot)."""
    monkeypatch.setattr(routing, "FEW_PAIRS", few_pairs)
    H, E, top_k = 24, 7, 3
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5))
    x[4:] = float("nan")
    x = x.to(DEVICE)
    w = torch.randn(E + 1, H, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    r = route(x, w, top_k, 1, 16, out=poisoned_routing(N, top_k + 1, E + 1, 16))
    assert r.experts[4:, :top_k].eq(E - 1).all()
    assert_pairs(r, E + 1)
