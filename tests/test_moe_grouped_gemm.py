"""The grouped expert GEMMs of the MoE block (ops/moe/grouped_gemm.py, issue 19) against their
plain-PyTorch references, on pair lists built here in plain PyTorch: every activation, fp32 and
fp16 (bf16 on the GPU), odd shapes and tiles, poisoned outputs, an idle expert, every pair on one
expert, h in list order with its sentinel rows unwritten (and those poisoned rows not leaking into
y), unlisted pairs left untouched; the combine bit-exact; gate/up -> down -> combine with the
shared expert as extra expert columns against ``swiglu_moe_ref``; bad input; the CPU fallback."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from helpers import randn
from fuselm import Activation, interleave_gate_up
from fuselm.ops.moe import route_ref, swiglu_moe_ref
from fuselm.ops.moe.grouped_gemm import (GroupedGemmConfig, combine, combine_ref, expert_down, expert_down_ref,
                                         expert_gate_up, expert_gate_up_ref, listed_entries)
from fuselm.ops.moe.routing import max_pairs
from fuselm.testing import assert_close, poisoned_like

ACTIVATIONS = [Activation(), Activation.swiglu_limit(0.5), Activation.swiglu_oai(0.6, 1.702)]
ACT_IDS = ["silu", "limit", "oai"]
# Matrix kernels: bf16 only on the GPU (the interpreter's bf16 tl.dot is wrong, triton 11584).
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
# ||out - ref|| / ||ref|| against the reference with the same roundings: only fp32 summation order
# differs, so 16-bit results differ only where a product sits at a rounding boundary (one ulp);
# a missing rounding of G/U or of the down product is several times larger.
TOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}
# Odd shapes: H, F not multiples of any tile; E_total = 4 routed + 1 shared expert; S = 2 + 1.
H, F_, E_TOTAL, N, TOP_K, SHARED = 40, 24, 5, 7, 2, 1
SMALL_TILES = GroupedGemmConfig(block_n=16, block_k=16, num_warps=4, num_stages=1)  # several N and K tiles


# ----------------------------------------------------------------------------- pair lists (plain PyTorch)
def random_experts(n=N, top_k=TOP_K, routed=E_TOTAL - SHARED, shared=SHARED):
    """[n, top_k + shared] int32: distinct random routed experts per token, then the shared columns."""
    routed_ids = torch.rand(n, routed).argsort(dim=1)[:, :top_k]
    shared_ids = torch.arange(routed, routed + shared).expand(n, shared)
    return torch.cat([routed_ids, shared_ids], dim=1).to(torch.int32).to(DEVICE)


def pair_list(experts, num_experts, block_m, listed=None):
    """(sorted_pairs, block_experts) of the contract: pair ids n * S + j grouped by expert ascending,
    each group padded to a multiple of block_m with the sentinel N * S; -1 for unused blocks.
    ``listed`` [N, S] bool: only those pairs enter the list (default all)."""
    n, s = experts.shape
    flat = experts.reshape(-1).long().cpu()
    ids = torch.arange(n * s)
    if listed is not None:
        keep = listed.reshape(-1).cpu()
        flat, ids = flat[keep], ids[keep]
    p_max = max_pairs(n, s, num_experts, block_m)
    sorted_pairs = torch.full((p_max,), n * s, dtype=torch.int32)
    block_experts = torch.full((p_max // block_m,), -1, dtype=torch.int32)
    start = 0
    for e in range(num_experts):
        group = ids[flat == e]
        sorted_pairs[start:start + len(group)] = group.to(torch.int32)
        blocks = math.ceil(len(group) / block_m)
        block_experts[start // block_m:start // block_m + blocks] = e
        start += blocks * block_m
    assert start <= p_max
    return sorted_pairs.to(DEVICE), block_experts.to(DEVICE)


def expert_weights(dtype, e=E_TOTAL, h=H, f=F_):
    w13 = torch.stack([interleave_gate_up(randn(f, h, dtype=dtype, scale=h ** -0.5),
                                          randn(f, h, dtype=dtype, scale=h ** -0.5)) for _ in range(e)])
    return w13, randn(e, h, f, dtype=dtype, scale=f ** -0.5)


def assert_matches(out, ref, dtype, name):
    """Against the same-rounding reference, in float64: norm-relative (TOL), and elementwise. fp32:
    within 1e-5 of the largest element (summation order only). 16-bit: the order only matters where
    a product sits at a rounding boundary, so each element is within a few ulps of ``dtype``
    relative to itself (a floor of 1% of an ulp of the largest element for values near zero)."""
    assert not out.isnan().any(), f"{name}: an element was not written"
    assert_close(out, ref, TOL[dtype], name)
    o, r = out.double(), ref.double()
    if dtype == torch.float32:
        bound = 1e-5 * r.abs().max()
    else:
        eps = torch.finfo(dtype).eps
        bound = 4 * eps * r.abs() + eps * 1e-2 * r.abs().max()
    assert ((o - r).abs() <= bound).all(), f"{name}: max diff {(o - r).abs().max().item():.3e}"


def listed_rows(sorted_pairs, block_experts, block_m, num_pairs):
    """[P_max] bool: the entries of the pair list that hold a pair (h's written rows)."""
    rows = torch.zeros(sorted_pairs.numel(), dtype=torch.bool, device=DEVICE)
    rows[listed_entries(sorted_pairs, block_experts, block_m, num_pairs)[0]] = True
    return rows


def run_gate_up(x, w13, experts, act, block_m, config=None, listed=None, tma=None):
    """(h, its reference, written rows): h [P_max, F] in list order, poisoned first; the rows of
    sentinel entries and unused blocks are checked to stay unwritten."""
    sorted_pairs, block_experts = pair_list(experts, w13.shape[0], block_m, listed)
    s = experts.shape[1]
    h = expert_gate_up(x, w13, sorted_pairs, block_experts, s, act, block_m, config=config, tma=tma,
                       out=poisoned_like(torch.empty(sorted_pairs.numel(), w13.shape[1] // 2, dtype=x.dtype,
                                                     device=DEVICE)))
    ref = expert_gate_up_ref(x, w13, sorted_pairs, block_experts, s, act, block_m)
    written = listed_rows(sorted_pairs, block_experts, block_m, x.shape[0] * s)
    assert h[~written].isnan().all(), "h: a row of no pair was written"
    return h, ref, written


def run_down(w2, experts, block_m, config=None, h=None, listed=None, tma=None):
    """(y, its reference): y [N S, H] in pair order, poisoned first, from h in list order (random
    if not given)."""
    sorted_pairs, block_experts = pair_list(experts, w2.shape[0], block_m, listed)
    if h is None:
        h = randn(sorted_pairs.numel(), w2.shape[2], dtype=w2.dtype)
    y = expert_down(h, w2, sorted_pairs, block_experts, block_m, experts.numel(), config=config, tma=tma,
                    out=poisoned_like(torch.empty(experts.numel(), w2.shape[1], dtype=h.dtype, device=DEVICE)))
    return y, expert_down_ref(h, w2, sorted_pairs, block_experts, block_m, experts.numel())


# ----------------------------------------------------------------------------- the pair list itself
def test_pair_list_helper_follows_the_contract():
    experts = random_experts()
    sorted_pairs, block_experts = pair_list(experts, E_TOTAL, 16)
    n_s = N * (TOP_K + SHARED)
    assert sorted_pairs.numel() == math.ceil((n_s + E_TOTAL * 15) / 16) * 16
    entries = block_experts.long().repeat_interleave(16)
    real = sorted_pairs < n_s
    assert sorted(sorted_pairs[real].tolist()) == list(range(n_s))  # each pair once
    assert torch.equal(entries[real], experts.reshape(-1).long()[sorted_pairs[real].long()])
    assert (entries[real].diff() >= 0).all()  # grouped by expert, ascending


# ----------------------------------------------------------------------------- gate/up
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m, config", [(16, None), (32, SMALL_TILES)], ids=["bm16", "bm32-small-tiles"])
def test_gate_up_matches_reference(block_m, config, dtype, act):
    x = randn(N, H, dtype=dtype) * 3  # large enough that the clamps at 0.5 / 0.6 bite
    w13, _ = expert_weights(dtype)
    experts = random_experts()
    h, ref, written = run_gate_up(x, w13, experts, act, block_m, config)
    assert h.shape == (pair_list(experts, E_TOTAL, block_m)[0].numel(), F_) and h.dtype == dtype
    assert int(written.sum()) == N * (TOP_K + SHARED)
    assert_matches(h[written], ref[written], dtype, "h")


def test_gate_up_rows_are_entries_and_rounded_as_the_dense_kernel():
    """Row i of h (list order) is SwiGLU(x[p // S] through expert experts[p]) for entry i's pair p,
    with G and U rounded first; fp16."""
    dtype = torch.float16
    x = randn(N, H, dtype=dtype)
    w13, _ = expert_weights(dtype)
    experts = random_experts()
    h, _, _ = run_gate_up(x, w13, experts, Activation(), 16)
    s = experts.shape[1]
    entries, pairs, _ = listed_entries(*pair_list(experts, E_TOTAL, 16), 16, N * s)
    assert sorted(pairs.tolist()) == list(range(N * s))
    for i, p in zip(entries.tolist(), pairs.tolist()):
        e = experts.reshape(-1)[p]
        g, u = (x[p // s].double() @ w13[e, j::2].double().T for j in (0, 1))
        g, u = g.to(dtype).double(), u.to(dtype).double()
        exact = F.silu(g) * u
        assert ((h[i].double() - exact).abs() <= 3 * torch.finfo(dtype).eps * exact.abs() + 1e-6).all(), p


def test_unlisted_pairs_are_left_untouched():
    dtype = torch.float32
    x = randn(N, H, dtype=dtype)
    w13, w2 = expert_weights(dtype)
    experts = random_experts()
    listed = torch.rand(experts.shape) < 0.6
    listed[0, 0] = False  # pair 0 (x's row 0, which sentinel rows read) is not listed
    h, ref, written = run_gate_up(x, w13, experts, Activation(), 16, listed=listed)
    assert int(written.sum()) == int(listed.sum())
    assert_close(h[written], ref[written], TOL[dtype], "h")
    # down: its blocks hold h's NaN sentinel rows, which leak into no listed pair's row of y
    y, y_ref = run_down(w2, experts, 16, h=h, listed=listed)
    rows = listed.reshape(-1).to(DEVICE)
    assert y[~rows].isnan().all() and not y[rows].isnan().any()
    assert_close(y[rows], y_ref[rows], TOL[dtype], "y")


# ----------------------------------------------------------------------------- down
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m, config", [(16, None), (32, SMALL_TILES)], ids=["bm16", "bm32-small-tiles"])
def test_down_matches_reference(block_m, config, dtype):
    experts = random_experts()
    _, w2 = expert_weights(dtype)
    y, ref = run_down(w2, experts, block_m, config)
    assert y.shape == (experts.numel(), H) and y.dtype == dtype  # the product rounded to h's dtype
    assert_matches(y, ref, dtype, "y")


# ----------------------------------------------------------------------------- the persistent TMA kernels
TMA_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]  # 16-bit operands only


@pytest.mark.parametrize("case", ["random", "idle_and_unlisted", "one_expert"])
@pytest.mark.parametrize("act", ACTIVATIONS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", TMA_DTYPES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_tma_kernels_match_reference(block_m, dtype, act, case):
    """Hopper's prefill path (``tma=True``; here the interpreter's 16 x 16 tiles on 4 persistent
    programs, so each program walks several tiles): H and F not multiples of the tiles (the
    descriptor zero-fills the weight past H; x's K tail masked), weight tiles running past an
    expert's rows into the next expert's (never stored), unused blocks at the end skipped, unlisted
    rows untouched, poisoned outputs."""
    x = randn(N, H, dtype=dtype) * 3
    w13, w2 = expert_weights(dtype)
    listed = None
    if case == "idle_and_unlisted":  # routed experts from {0, 2, 3}: expert 1 idle (no blocks)
        routed = torch.stack([torch.tensor([0, 2, 3])[torch.randperm(3)[:TOP_K]] for _ in range(N)])
        experts = torch.cat([routed, torch.full((N, SHARED), E_TOTAL - 1)], dim=1).to(torch.int32).to(DEVICE)
        listed = torch.rand(experts.shape) < 0.7
        listed[0, 0] = False  # row 0, which sentinel rows read, is not listed
    elif case == "one_expert":
        experts = torch.full((N, 1), 3, dtype=torch.int32, device=DEVICE)
    else:
        experts = random_experts()
    h, h_ref, written = run_gate_up(x, w13, experts, act, block_m, listed=listed, tma=True)
    assert_matches(h[written], h_ref[written], dtype, "h")
    y, y_ref = run_down(w2, experts, block_m, h=h, listed=listed, tma=True)
    rows = torch.ones(experts.numel(), dtype=torch.bool) if listed is None else listed.reshape(-1)
    rows = rows.to(DEVICE)
    assert y[~rows].isnan().all()
    assert_matches(y[rows], y_ref[rows], dtype, "y")


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [64, 128])
def test_tma_kernels_match_pointer_kernels_at_prefill_size(block_m):
    """bf16 on the GPU, Hopper's own tiles, 600 tokens over 12 experts (~100 pairs an expert, so
    full and partly padded blocks): the TMA kernels against the reference and the pointer kernels."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernels' own tiles: Hopper")
    dtype, n, h_dim, f = torch.bfloat16, 600, 512, 256
    x = randn(n, h_dim, dtype=dtype)
    w13, w2 = expert_weights(dtype, e=12, h=h_dim, f=f)
    experts = random_experts(n=n, top_k=2, routed=11, shared=1)
    s = experts.shape[1]
    sorted_pairs, block_experts = pair_list(experts, 12, block_m)
    pairs = (sorted_pairs, block_experts)
    rows = listed_rows(*pairs, block_m, n * s)
    h_tma = expert_gate_up(x, w13, *pairs, s, Activation(), block_m, tma=True)
    h_ptr = expert_gate_up(x, w13, *pairs, s, Activation(), block_m, tma=False)
    assert_matches(h_tma[rows], expert_gate_up_ref(x, w13, *pairs, s, Activation(), block_m)[rows], dtype, "h")
    assert_close(h_tma[rows], h_ptr[rows], TOL[dtype], "h: TMA vs pointer kernel")
    y_tma = expert_down(h_tma, w2, *pairs, block_m, n * s, tma=True)
    assert_matches(y_tma, expert_down_ref(h_tma, w2, *pairs, block_m, n * s), dtype, "y")
    assert_close(y_tma, expert_down(h_tma, w2, *pairs, block_m, n * s, tma=False), TOL[dtype],
                 "y: TMA vs pointer kernel")


# ----------------------------------------------------------------------------- combine
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("y_dtype", DTYPES)
@pytest.mark.parametrize("n, s, h", [(7, 3, 40), (5, 1, 1500)])
def test_combine_is_exact(n, s, h, y_dtype, out_dtype):
    y = randn(n * s, h, dtype=y_dtype)
    weights = torch.rand(n, s, device=DEVICE)
    out = combine(y, weights, out_dtype, out=poisoned_like(torch.empty(n, h, dtype=out_dtype, device=DEVICE)))
    assert out.dtype == out_dtype
    assert torch.equal(out, combine_ref(y, weights, out_dtype))  # the same fp32 fmas in the same order
    # One rounding of the fp32 sum: half an ulp, 2^-11 (fp16) / 2^-8 (bf16) relative, at most.
    exact = (y.double().reshape(n, s, h) * weights.double()[:, :, None]).sum(1)
    assert_close(out, exact, {torch.float32: 1e-6, torch.float16: 1e-3}.get(out_dtype, 4e-3))


# ----------------------------------------------------------------------------- routing corner cases
@pytest.mark.parametrize("case", ["idle_expert", "one_expert"])
def test_idle_expert_and_all_pairs_on_one_expert(case):
    dtype = torch.float32
    x = randn(N, H, dtype=dtype)
    w13, w2 = expert_weights(dtype)
    if case == "idle_expert":  # expert 1 gets no pair: its blocks do not exist
        experts = random_experts(routed=3, shared=1)  # routed experts 0..2, shared 3, expert 4 idle...
        experts = torch.where(experts == 1, 4, experts)  # ... and expert 1 idle
        assert not (experts == 1).any() and (experts == 4).any()
    else:  # every pair on expert 3 (one slot per token)
        experts = torch.full((N, 1), 3, dtype=torch.int32, device=DEVICE)
    sorted_pairs, block_experts = pair_list(experts, E_TOTAL, 16)
    assert (block_experts == -1).any()
    h, ref, written = run_gate_up(x, w13, experts, Activation(), 16)
    assert_matches(h[written], ref[written], dtype, "h")
    weights = torch.rand(experts.shape, device=DEVICE)
    y, y_ref = run_down(w2, experts, 16, h=h)
    assert_matches(y, y_ref, dtype, "y")
    assert_close(combine(y, weights, dtype), combine_ref(y_ref, weights, dtype), 1e-6)


# ----------------------------------------------------------------------------- end to end
def moe_weights(experts=6, hidden=H, ffn=F_, shared=2 * F_):
    g = torch.Generator().manual_seed(7)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(DEVICE)

    return dict(router_weight=w(experts, hidden), gate_up=w(experts, 2 * ffn, hidden), down=w(experts, hidden, ffn),
                shared_gate=w(shared, hidden), shared_up=w(shared, hidden), shared_down=w(hidden, shared),
                shared_expert_gate=w(1, hidden))


@pytest.mark.parametrize("act", [Activation(), Activation.swiglu_limit(0.5)], ids=["silu", "limit"])
@pytest.mark.parametrize("n", [7, 33])
def test_end_to_end_matches_swiglu_moe_ref(n, act):
    """gate/up -> down -> combine, routing from route_ref plus the shared expert (F_s = 2F) as two
    chunk experts with weight sigmoid(gate logit), equals swiglu_moe_ref in fp32 within 1e-5."""
    top_k, block_m = 2, 16
    m = moe_weights()
    x = randn(n, H) * 2
    E, ffn = m["gate_up"].shape[0], m["down"].shape[2]
    chunks = m["shared_gate"].shape[0] // ffn
    # experts: the routed ones (HF's [gate rows; up rows] interleaved), then the shared expert's chunks
    shared_gate, shared_up = m["shared_gate"].split(ffn), m["shared_up"].split(ffn)
    w13 = torch.stack([interleave_gate_up(m["gate_up"][e, :ffn], m["gate_up"][e, ffn:]) for e in range(E)]
                      + [interleave_gate_up(shared_gate[c], shared_up[c]) for c in range(chunks)])
    w2 = torch.cat([m["down"], torch.stack(m["shared_down"].split(ffn, dim=1))])
    routed_weights, routed = route_ref(x, m["router_weight"], top_k)
    scale = torch.sigmoid(F.linear(x, m["shared_expert_gate"]).float())  # [n, 1]
    experts = torch.cat([routed, torch.arange(E, E + chunks, device=DEVICE).expand(n, chunks)], dim=1).to(torch.int32)
    weights = torch.cat([routed_weights.float(), scale.expand(n, chunks)], dim=1).contiguous()
    s = top_k + chunks
    sorted_pairs, block_experts = pair_list(experts, E + chunks, block_m)

    h = expert_gate_up(x, w13, sorted_pairs, block_experts, s, act, block_m)
    y = expert_down(h, w2, sorted_pairs, block_experts, block_m, n * s)
    out = combine(y, weights, x.dtype)
    expected = swiglu_moe_ref(x, m["router_weight"], top_k, m["gate_up"], m["down"], m["shared_gate"],
                              m["shared_up"], m["shared_down"], m["shared_expert_gate"], act)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max().clamp(min=1)


# ----------------------------------------------------------------------------- bad input
def _inputs():
    x = randn(N, H)
    w13, w2 = expert_weights(torch.float32)
    experts = random_experts()
    sorted_pairs, block_experts = pair_list(experts, E_TOTAL, 16)
    h = randn(sorted_pairs.numel(), F_)
    y = randn(experts.numel(), H)
    weights = torch.rand(experts.shape, device=DEVICE)
    return dict(x=x, w13=w13, w2=w2, sp=sorted_pairs, be=block_experts, h=h, y=y, weights=weights)


S = TOP_K + SHARED


def _down_on_512_row_blocks(a):
    """expert_down on 512-row blocks, h's tile more rows than a TMA box holds."""
    sorted_pairs, block_experts = pair_list(random_experts(), E_TOTAL, 512)
    h = randn(sorted_pairs.numel(), F_, dtype=torch.float16)
    return expert_down(h, a["w2"].half(), sorted_pairs, block_experts, 512, N * S, tma=True)


@pytest.mark.parametrize("call, match", [
    (lambda a: expert_gate_up(a["x"][:, :30], a["w13"], a["sp"], a["be"], S, Activation(), 16), "w13: expected"),
    (lambda a: expert_gate_up(a["x"], a["w13"][:, :-1], a["sp"], a["be"], S, Activation(), 16), "w13: expected"),
    (lambda a: expert_gate_up(a["x"], a["w13"].half(), a["sp"], a["be"], S, Activation(), 16), "w13: dtype"),
    (lambda a: expert_gate_up(a["x"].long(), a["w13"], a["sp"], a["be"], S, Activation(), 16), "x: dtype"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"], a["be"], S, "silu", 16), "activation"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"].long(), a["be"], S, Activation(), 16), "sorted_pairs: dtype"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"], a["be"][:-1], S, Activation(), 16), "block_experts"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"], a["be"], S, Activation(), 24), "block_m"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"][:-3], a["be"], S, Activation(), 16), "sorted_pairs: length"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"], a["be"], 0, Activation(), 16), "slots"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"], a["be"], S, Activation(), 16,
                              out=torch.empty(N * S, F_ + 1, device=DEVICE)), "out: expected"),
    (lambda a: expert_down(a["h"], a["w2"][:, :, :-1], a["sp"], a["be"], 16, N * S), "w2: expected"),
    (lambda a: expert_down(a["h"], a["w2"].half(), a["sp"], a["be"], 16, N * S), "w2: dtype"),
    (lambda a: expert_down(a["h"], a["w2"], a["sp"], a["be"], 16, N * S,
                           out=torch.empty(N * S, H, dtype=torch.float16, device=DEVICE)), "out: expected"),
    (lambda a: expert_down(a["h"][:-1], a["w2"], a["sp"], a["be"], 16, N * S), "h: expected one row per entry"),
    (lambda a: expert_down(a["h"], a["w2"], a["sp"], a["be"], 16, -1), "num_pairs"),
    (lambda a: expert_down(a["h"], a["w2"], a["sp"], a["be"], 16, float(N * S)), "num_pairs"),
    (lambda a: expert_gate_up(a["x"], a["w13"], a["sp"], a["be"], S, Activation(), 16, tma=True), "tma: "),
    (lambda a: expert_gate_up(a["x"].half(), a["w13"].half(), a["sp"], a["be"], S, Activation(), 16, tma=True,
                              config=GroupedGemmConfig(256, 16, 4, 1)), "config: .* a TMA box cannot hold"),
    (lambda a: expert_down(a["h"].half()[:, :-1], a["w2"].half()[:, :, :-1].contiguous(), a["sp"], a["be"], 16,
                           N * S, tma=True), "tma: "),
    (_down_on_512_row_blocks, "block_m: 512 rows of h"),
    (lambda a: combine(a["y"], a["weights"][:-1], torch.float32), "y: expected"),
    (lambda a: combine(a["y"], a["weights"].half(), torch.float32), "weights: dtype"),
    (lambda a: combine(a["y"], a["weights"].t(), torch.float32), "weights: rows must be contiguous"),
    (lambda a: combine(a["y"].long(), a["weights"], torch.float32), "y: dtype"),
    (lambda a: combine(a["y"], a["weights"], torch.int8), "out_dtype"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_inputs())


# ----------------------------------------------------------------------------- CPU fallback
def test_cpu_without_interpreter_uses_reference(monkeypatch):
    import fuselm.ops.moe.grouped_gemm as gg

    monkeypatch.setattr(gg, "use_triton", lambda t: False)
    a = _inputs()
    a = {k: v.cpu() for k, v in a.items()}
    act = Activation.swiglu_oai(0.6, 1.702)
    h = expert_gate_up(a["x"], a["w13"], a["sp"], a["be"], S, act, 16)
    written = listed_rows(a["sp"], a["be"], 16, N * S).cpu()
    assert torch.equal(h[written], expert_gate_up_ref(a["x"], a["w13"], a["sp"], a["be"], S, act, 16)[written])
    y = expert_down(h, a["w2"], a["sp"], a["be"], 16, N * S)
    assert torch.equal(y, expert_down_ref(h, a["w2"], a["sp"], a["be"], 16, N * S))
    assert torch.equal(combine(y, a["weights"], torch.float16), combine_ref(y, a["weights"], torch.float16))
