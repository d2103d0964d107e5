"""The decode path of the Qwen3.5-MoE sparse block (issue 19): up to a few tokens, three launches
with the routing inside them, each pair's expert weights streamed by matrix-vector programs.

    out = swiglu_moe_decode(x, router_with_gate, w13, w2, top_k, activation, num_experts=E), i.e.
    logits = router_logits(x, router_with_gate)                                     # launch 1
    h = pair_gate_up(x, w13, logits, top_k, activation, num_experts=E, routing_out=r)  # launch 2
    out = down_combine(h, w2, logits, top_k, x.dtype, num_experts=E, routing=r)       # launch 3

No routing launch and no pair list: each routed program of launch 2 picks its expert itself from
its token's logits (a few rounds of a max over E values, ~1 us), so the routed weights start
streaming as soon as the logits are in memory. Launch 3 either routes itself the same way (up to
ROUTE_IN_DOWN_TOKENS tokens, ``r`` None) or reads the token's routing that launch 2's last routed
program of each token wrote into ``r`` (past it: there its many programs would each repeat the
routing). On Hopper and later, launches 2 and 3 use programmatic dependent launch
(``fuselm.runtime.use_pdl``), and so does launch 1, its router rows loading while the kernel ahead
(the norm that writes x) runs: launch 2's shared-expert programs, which need no routing, stream
their weights while the router kernel runs; launch 3's self-routing programs load all their down
weights into registers while launch 2 still runs, then wait for h. The weight streams so overlap
instead of each paying its own start and tail.

Shapes: x [N, H]; router_with_gate [R, H] (R >= E + 1: the router's E rows, the shared gate's,
padding); logits [N, R] in x's dtype; w13 [E_total, 2F, H] with each expert's gate and up rows
interleaved (row 2f = gate f, row 2f + 1 = up f); w2 [E_total, H, F]; E_total = E + num_shared
(ids E .. E_total - 1 the shared expert's chunks, always selected); S = top_k + num_shared slots a
token; h [N * S, F] in x's dtype, row p = n * S + j token n's slot j; out [N, H].

- ``router_logits``: ``decode_linear``'s vector kernel (``fuselm/ops/decode_linear/kernels.py``), a
  program per ROWS router rows and token, the row of H in a few unrolled loads, products summed in
  fp32, rounded to x's dtype (``F.linear``'s contract; past the decode path cuBLAS computes them,
  ``routing.route``). It lets gate/up begin after its wait: gate/up's shared-expert programs read x
  before their own.
- routing (in launches 2 and 3, ``_expert_keys`` and ``_top_k``): softmax in fp32 over the E experts, the top k in
  descending order, ties to the lower expert id, renormalised (slot order) and rounded to x's
  dtype; the shared scale sigmoid(logit E). The order is taken on exp(l - max) before the division
  by the sum, so that launches 2 and 3 pick the same experts whatever their reductions' order
  (the probabilities' order, up to a tie the division's rounding could make).
- ``pair_gate_up``: a program owns pair p and BLOCK_F features of h: the 2 BLOCK_F interleaved
  rows of w13[e] times x[p // S], K step by K step, products accumulated in fp32, then the dense
  kernel's epilogue: G and U rounded to x's dtype, the gate factor rounded, the product rounded once.
- ``down_combine``: a program owns token n and BLOCK_H output features: y_j = round(h[n S + j] @
  w2[e_j]^T) for every slot (fp32 sums, rounded to h's dtype as HF's down_proj output), then
  acc = fma(weight_j, y_j, acc) in fp32 in slot order (routed slots, then the shared ones); the
  output rounded once. Self-routing, all routed slots' weights are one [K, BLOCK_H, F] tile.

Numerics: ``naive.swiglu_moe_ref``'s contract through ``grouped_gemm``'s references (products
rounded to the model dtype, the weighted slots summed in fp32 in slot order, one rounding); only the
fp32 summation order inside each dot differs, and the router logits' (as between cuBLAS kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuselm.ops.common.activation import Activation, gate_factor, up_factor
from fuselm.ops.common.pdl import allow_next_kernel, wait_for_previous_kernel
from fuselm.ops.decode_linear.kernels import DecodeVectorConfig, decode_linear_vector_kernel
from fuselm.ops.moe.grouped_gemm import (_check_out, _check_tensor, combine_ref, expert_down_ref,  # the same checks
                                         expert_gate_up_ref, listed_entries)
from fuselm.ops.moe.routing import MAX_EXPERTS, sort_pairs_ref
from fuselm.runtime import cdiv, next_power_of_2, parse_dtype, use_pdl, use_triton

# A routing key's low 32 bits: _MAX_ID - expert id, so that the lower id wins a tie.
_MAX_ID: tl.constexpr = tl.constexpr(2**31 - 1)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _gemv_k_step(w_ptrs, v_ptrs, k, k_left, EVEN_K: tl.constexpr):
    """One K step of a matrix-vector product: the fp32 products of the weight tile [ROWS, BLOCK_K]
    at ``w_ptrs`` and the vector [BLOCK_K] at ``v_ptrs`` (K offsets ``k``; with ``EVEN_K`` False the
    columns at k >= ``k_left`` load as zeros), to be added to the caller's [ROWS, BLOCK_K] sums."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        v = tl.load(v_ptrs)
    else:
        k_ok = k < k_left
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=k_ok, other=0.0)
    return w.to(tl.float32) * v.to(tl.float32)[None, :]


@triton.jit
def _expert_keys(row_ptr, E: tl.constexpr, E_PAD: tl.constexpr):
    """(keys [E_PAD] int64, ex [E_PAD] fp32) of one token's logits row: ex = exp(l - max l) over
    the E experts (0 past them), key = ex's bits << 32 | (_MAX_ID - id) (ex >= 0, so its bits order
    as its value; the lower id wins a tie), -1 past E. Read past L1 (.cg): the router kernel wrote
    the row while this kernel may already have been running (programmatic dependent launch)."""
    cols = tl.arange(0, E_PAD)
    real = cols < E
    logits = tl.load(row_ptr + cols, mask=real, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    ex = tl.where(real, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    bits = ex.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(real, (bits << 32) | (-cols.to(tl.int64) + _MAX_ID), -1)
    return keys, ex


@triton.jit
def _key_expert(key):
    """The expert id a key encodes."""
    return (-(key & 0x7FFFFFFF) + _MAX_ID).to(tl.int32)  # the low word is < 2^31


@triton.jit
def _top_k(keys, ex, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, dtype: tl.constexpr):
    """(experts [K_PAD] int32, weights [K_PAD] fp32) from a token's keys and ex (``_expert_keys``):
    k rounds of a max, each expert's probability ex / sum(ex), renormalised over the k (summed in
    slot order), rounded to ``dtype``; zeros past k."""
    total_ex = tl.sum(ex, axis=0)
    cols = tl.arange(0, E_PAD)
    slot = tl.arange(0, K_PAD)
    experts = tl.zeros([K_PAD], dtype=tl.int32)
    probs = tl.zeros([K_PAD], dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        e = _key_expert(best)
        prob = tl.sum(tl.where(cols == e, ex, 0.0), axis=0) / total_ex  # softmax: exp(l - max) / sum
        total += prob  # slot order
        experts = tl.where(slot == j, e, experts)
        probs = tl.where(slot == j, prob, probs)
        keys = tl.where(keys == best, -1, keys)
    return experts, (probs / total).to(dtype).to(tl.float32)


@triton.jit
def _shared_scale(row_ptr, E: tl.constexpr):
    """sigmoid of a token's shared-gate logit (column E), in fp32."""
    return 1.0 / (1.0 + tl.exp(-tl.load(row_ptr + E, cache_modifier=".cg").to(tl.float32)))


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, logits_ptr, h_ptr, experts_ptr, weights_ptr,
    F, H, stride_xm, stride_we, stride_wn, stride_lm, stride_hm,
    limit, alpha,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, SLOTS: tl.constexpr,
    WRITE_ROUTING: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)  # the pair: token p // S, slot p % S
    n = p // SLOTS
    j = p % SLOTS
    if j < TOP_K:  # a routed slot: the (j + 1)-th largest key of the token's logits
        wait_for_previous_kernel(USE_PDL)
        row_ptr = logits_ptr + n * stride_lm
        keys, ex = _expert_keys(row_ptr, E, E_PAD)
        if WRITE_ROUTING:  # the token's last routed slot, first program: its whole routing, for down
            if (j == TOP_K - 1) & (tl.program_id(1) == 0):
                experts, weights = _top_k(keys, ex, E_PAD, TOP_K, K_PAD, logits_ptr.dtype.element_ty)
                slot = tl.arange(0, K_PAD)
                tl.store(experts_ptr + n * SLOTS + slot, experts, mask=slot < TOP_K)
                tl.store(weights_ptr + n * SLOTS + slot, weights, mask=slot < TOP_K)
                scale = _shared_scale(row_ptr, E)
                for c in tl.static_range(SLOTS - TOP_K):
                    tl.store(experts_ptr + n * SLOTS + TOP_K + c, E + c)
                    tl.store(weights_ptr + n * SLOTS + TOP_K + c, scale)
        for _ in range(j):
            keys = tl.where(keys == tl.max(keys, axis=0), -1, keys)
        e = _key_expert(tl.max(keys, axis=0)).to(tl.int64)
    else:  # a shared chunk: no routing, so no wait (x was complete when the router kernel let this one begin)
        e = (E + j - TOP_K).to(tl.int64)
    # After the wait (routed programs): the down kernel may launch once every program is here, and
    # then reads the logits before its own wait.
    allow_next_kernel(USE_PDL)
    wrows = tl.program_id(1) * 2 * BLOCK_F + tl.arange(0, 2 * BLOCK_F)  # interleaved gate/up rows
    k = tl.arange(0, BLOCK_K)
    # Rows past 2F wrap to valid ones (never stored).
    w_ptrs = w_ptr + e * stride_we + (wrows % (2 * F)).to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + n * stride_xm + k
    acc = tl.zeros([2 * BLOCK_F, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc += _gemv_k_step(w_ptrs, x_ptrs, k, H - k0, EVEN_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gu = tl.sum(acc, axis=1)  # [2 BLOCK_F]: gate f at 2f, up f at 2f + 1
    g, u = tl.split(tl.reshape(gu, [BLOCK_F, 2]))
    # The dense kernel's roundings: G and U to x's dtype, the gate factor, the product once.
    g = g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(x_ptr.dtype.element_ty).to(tl.float32)
    a = gate_factor(g, ACT, limit, alpha).to(x_ptr.dtype.element_ty).to(tl.float32)
    hv = a * up_factor(u, ACT, limit)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    tl.store(h_ptr + p * stride_hm + cols, hv.to(h_ptr.dtype.element_ty), mask=cols < F)


@triton.jit
def _down_combine_kernel(
    h_ptr, w_ptr, experts_ptr, weights_ptr, out_ptr,
    H, stride_hm, stride_we, stride_wn, stride_om,
    SLOTS: tl.constexpr, F: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """down_combine on the routing gate/up wrote (experts, weights [N, S]), read after the wait."""
    wait_for_previous_kernel(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # output features: rows of w2[e]
    k = tl.arange(0, BLOCK_K)
    w_offs = (rows % H).to(tl.int64)[:, None] * stride_wn + k[None, :]  # rows past H wrap, never stored
    out = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Both loops unrolled (SLOTS and F are constexpr): no load waits on an earlier slot's sum, so
    # every slot's weight tiles can be in flight at once (a rolled loop kept one 16 KB tile in
    # flight a program: 12.5 us for 18.9 MB at one token on the H200).
    for j in tl.static_range(SLOTS):  # slot order: deterministic
        p = n * SLOTS + j
        e = tl.load(experts_ptr + p).to(tl.int64)
        w_ptrs = w_ptr + e * stride_we + w_offs
        h_ptrs = h_ptr + p * stride_hm + k
        acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, F, BLOCK_K):
            acc += _gemv_k_step(w_ptrs, h_ptrs, k, F - k0, EVEN_K)
            w_ptrs += BLOCK_K
            h_ptrs += BLOCK_K
        # The product rounded to h's dtype (HF's down_proj output), then weighted: one fma.
        y = tl.sum(acc, axis=1).to(h_ptr.dtype.element_ty).to(tl.float32)
        out = tl.fma(tl.load(weights_ptr + p), y, out)
    tl.store(out_ptr + n * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)


@triton.jit
def _slot_rows(w_ptr, e, stride_we, stride_wn, rows, f, ok, F: tl.constexpr):
    """[len(e), BLOCK_H, F_PAD] weights: w2[e[s], rows[i], f] (zeros where not ``ok`` or f >= F)."""
    ptrs = w_ptr + e.to(tl.int64)[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn \
        + f[None, None, :]
    return tl.load(ptrs, mask=ok[:, None, None] & (f < F)[None, None, :], other=0.0)


@triton.jit
def _slot_products(w, h_ptr, pairs, stride_hm, f, ok, F: tl.constexpr):
    """[len(pairs), BLOCK_H] fp32: y[s] = h[pairs[s]] @ w[s]^T rounded to h's dtype (HF's down_proj)."""
    hv = tl.load(h_ptr + pairs[:, None] * stride_hm + f[None, :], mask=ok[:, None] & (f < F)[None, :], other=0.0)
    y = tl.sum(w.to(tl.float32) * hv.to(tl.float32)[:, None, :], axis=2)
    return y.to(h_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _down_combine_routing_kernel(
    h_ptr, w_ptr, logits_ptr, out_ptr,
    H, stride_hm, stride_we, stride_wn, stride_lm, stride_om,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    NUM_SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    """down_combine routing from the logits itself, every slot's weights loaded before the wait."""
    n = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # output features: rows of w2[e]
    f = tl.arange(0, F_PAD)
    SLOTS: tl.constexpr = TOP_K + NUM_SHARED
    row_ptr = logits_ptr + n * stride_lm
    keys, ex = _expert_keys(row_ptr, E, E_PAD)
    experts, weights = _top_k(keys, ex, E_PAD, TOP_K, K_PAD, logits_ptr.dtype.element_ty)
    # Every slot's down weights into registers before the wait: they stream while h is computed.
    slot = tl.arange(0, K_PAD)
    routed = slot < TOP_K
    w_routed = _slot_rows(w_ptr, experts, stride_we, stride_wn, rows % H, f, routed, F)
    if NUM_SHARED > 0:
        chunk = tl.arange(0, SHARED_PAD)
        shared = chunk < NUM_SHARED
        w_shared = _slot_rows(w_ptr, E + chunk, stride_we, stride_wn, rows % H, f, shared, F)
        scale = _shared_scale(row_ptr, E)
    wait_for_previous_kernel(USE_PDL)  # h is the gate/up kernel's
    y = _slot_products(w_routed, h_ptr, n * SLOTS + slot, stride_hm, f, routed, F)  # [K_PAD, BLOCK_H]
    out = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order: deterministic
        y_j = tl.sum(tl.where((slot == j)[:, None], y, 0.0), axis=0)
        out = tl.fma(tl.sum(tl.where(slot == j, weights, 0.0), axis=0), y_j, out)
    if NUM_SHARED > 0:
        y = _slot_products(w_shared, h_ptr, n * SLOTS + TOP_K + chunk, stride_hm, f, shared, F)
        for j in tl.static_range(NUM_SHARED):
            out = tl.fma(scale, tl.sum(tl.where((chunk == j)[:, None], y, 0.0), axis=0), out)
    tl.store(out_ptr + n * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)


# ----------------------------------------------------------------------------- tile configs
@dataclass(frozen=True)
class PairGemvConfig:
    """Output features per program (``block``: router rows for the router, h features for gate/up,
    so 2 * block rows of w13; hidden features for down), the K step (down routing itself holds each
    slot's whole F: 0), warps and stages (Triton's launch options)."""

    block: int
    block_k: int
    num_warps: int
    num_stages: int


# H200 sweeps (moe.py --sweep-decode, session 19, moe_decode_sweep.md; graph replays): gate/up 8
# features, K step 256, 4 warps first or within 1% at 1, 4, 8, 16 tokens; a tensor-core dot variant
# never among the first six; stages change nothing (Triton does not pipeline these plain loads).
PAIR_GATE_UP_TILE = PairGemvConfig(8, 256, 4, 1)
# down_combine reading gate/up's routing: 8 features, K step 256 (H200, session 19: 44.2 us at 8
# tokens against 47.7 at 4 features, 70.9 against 72.2 at 16).
DOWN_COMBINE_TILE = PairGemvConfig(8, 256, 4, 1)
# H100 sweep (moe.py --sweep-decode, session 26, graph replays of one kernel at one token): the
# router 1 row a program, K step 512, 4 warps 6.6 us (2 rows 7.0; cuBLAS's F.linear 9.4).
ROUTER_TILE = PairGemvConfig(1, 512, 4, 1)
# Up to ROUTE_IN_DOWN_TOKENS tokens (gate/up and down overlapping under programmatic dependent
# launch), from the 35B-A3B block in a graph of 8 layers on the H100 (50 tile triples, session 26,
# NOTES 68): gate/up 4 features a program, down routing itself 2 features on 2 warps, the router 1
# row: 26.9 us a block at one token against 27.9 for 8 / 4 on 4 warps, 48.1 against 50.7 at two.
FEW_TOKENS_GATE_UP_TILE = PairGemvConfig(4, 256, 4, 1)
# down routing itself: the most output features a program (a power of two <= 16) whose weights
# (K_PAD x BLOCK_H x F_PAD) stay within this many elements, 64 registers a thread at 2 warps; a
# single feature on more warps past that.
DOWN_ROUTING_ELEMENTS = 8192
# The interpreter (CPU tests): tiles small enough that the kernel tests' odd shapes (H 40, F 24) have
# several programs and a K tail, large enough that a tiny model's decode steps stay short (each
# program routes itself: in the interpreter its cost is per program, not per element).
INTERPRET_TILE = PairGemvConfig(16, 32, 4, 1)
INTERPRET_ROUTER_TILE = PairGemvConfig(4, 32, 4, 1)
# Up to this many tokens down_combine routes itself (its N x H / BLOCK_H programs each take ~25
# reductions over E: one wave at 1-2 tokens, under gate/up's stream by programmatic dependent
# launch); past it gate/up's last routed program of each token writes the token's routing and
# down_combine reads it (at 8 tokens the self-routing down took 172 us a block against 151).
ROUTE_IN_DOWN_TOKENS = 2


def pair_gemv_config(kind: str, dtype: torch.dtype, device: torch.device, *, num_tokens: int = 1, top_k: int = 1,
                     num_features: int = 1) -> PairGemvConfig:
    """The tile of ``kind`` in {"router", "gate_up", "down", "down_routing"} for ``dtype`` operands
    and ``num_tokens`` tokens (fp32: half the K step); "down_routing" (down_combine routing itself)
    from ``top_k`` and F (``num_features``): the most output features whose weights fit
    DOWN_ROUTING_ELEMENTS on 2 warps, more warps past that."""
    if kind == "down_routing":
        held = next_power_of_2(top_k) * next_power_of_2(num_features)
        block = 1 << (max(1, min(16, DOWN_ROUTING_ELEMENTS // held)).bit_length() - 1)
        return PairGemvConfig(block, 0, min(8, max(2, 2 * held * block // DOWN_ROUTING_ELEMENTS)), 1)
    if device.type != "cuda":
        tile = INTERPRET_ROUTER_TILE if kind == "router" else INTERPRET_TILE
    elif kind == "gate_up":
        tile = FEW_TOKENS_GATE_UP_TILE if num_tokens <= ROUTE_IN_DOWN_TOKENS else PAIR_GATE_UP_TILE
    else:
        tile = {"router": ROUTER_TILE, "down": DOWN_COMBINE_TILE}[kind]
    if dtype == torch.float32:
        return PairGemvConfig(tile.block, max(16, tile.block_k // 2), tile.num_warps, tile.num_stages)
    return tile


# ----------------------------------------------------------------------------- checks
def _check_weights(name, w, x_name, x, k_dim: int) -> None:
    _check_tensor(name, w, 3)
    if w.dtype != x.dtype:
        raise ValueError(f"{name}: dtype {w.dtype} does not match {x_name} {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"{name}: on {w.device}, {x_name} on {x.device}")
    if w.shape[2] != k_dim:
        raise ValueError(f"{name}: expected its last dimension = {k_dim} ({x_name}'s features), got {tuple(w.shape)}")


def _check_routing(logits, num_tokens: int, like: torch.Tensor, top_k, num_experts, num_experts_total: int) -> int:
    """The slots a token (top_k + the shared chunks) after checking logits, top_k and num_experts."""
    _check_tensor("logits", logits, 2)
    if logits.dtype != like.dtype or logits.device != like.device:
        raise ValueError(f"logits: expected {like.dtype} on {like.device}, got {logits.dtype} on {logits.device}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or \
            not 1 <= num_experts <= min(MAX_EXPERTS, num_experts_total):
        raise ValueError(f"num_experts: expected an int in [1, {min(MAX_EXPERTS, num_experts_total)}] (the routed "
                         f"experts, at most the weights' {num_experts_total}), got {num_experts!r}")
    if logits.shape[0] != num_tokens or logits.shape[1] < num_experts + (num_experts_total > num_experts):
        raise ValueError(f"logits: expected [N = {num_tokens}, >= {num_experts + (num_experts_total > num_experts)}] "
                         f"(the router's and the shared gate's logits), got {tuple(logits.shape)}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an int in [1, {num_experts}] (num_experts), got {top_k!r}")
    return top_k + num_experts_total - num_experts


def _check_routing_buffers(name: str, routing, num_tokens: int, slots: int, device) -> tuple:
    if not isinstance(routing, (tuple, list)) or len(routing) != 2:
        raise ValueError(f"{name}: expected (experts, weights), got {type(routing).__name__}")
    for t, dtype in zip(routing, (torch.int32, torch.float32)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (num_tokens, slots) or t.dtype != dtype \
                or t.device != device or not t.is_contiguous():
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected contiguous [{num_tokens}, {slots}] int32 experts and fp32 weights on "
                             f"{device}, got {got}")
    return tuple(routing)


# ----------------------------------------------------------------------------- host functions
def router_logits(x: torch.Tensor, router_with_gate: torch.Tensor, *, out: torch.Tensor | None = None,
                  config: PairGemvConfig | None = None) -> torch.Tensor:
    """logits [N, R] in x's dtype = x @ router_with_gate^T (fp32 sums, rounded once). One launch."""
    _check_tensor("x", x, 2)
    _check_tensor("router_with_gate", router_with_gate, 2)
    if router_with_gate.dtype != x.dtype or router_with_gate.device != x.device \
            or router_with_gate.shape[1] != x.shape[1]:
        raise ValueError(f"router_with_gate: expected [R, H = {x.shape[1]}] {x.dtype} on {x.device}, got "
                         f"{tuple(router_with_gate.shape)} {router_with_gate.dtype} on {router_with_gate.device}")
    N, R = x.shape[0], router_with_gate.shape[0]
    logits = _check_out("out", out, (N, R), x.dtype, x.device)
    if not use_triton(x):
        return logits.copy_(F.linear(x, router_with_gate))
    if N == 0 or R == 0:
        return logits
    cfg = config or pair_gemv_config("router", x.dtype, x.device)
    return decode_linear_vector_kernel(x, router_with_gate, logits,
                                       config=DecodeVectorConfig(cfg.block, cfg.block_k, cfg.num_warps))


def pair_gate_up(x: torch.Tensor, w13: torch.Tensor, logits: torch.Tensor, top_k: int, activation: Activation, *,
                 num_experts: int, routing_out: tuple | None = None, out: torch.Tensor | None = None,
                 config: PairGemvConfig | None = None) -> torch.Tensor:
    """h [N * S, F] in x's dtype: row n * S + j = the activation of x[n] through its slot j's expert
    (the routing of ``logits``, module docstring; gate/up rows interleaved), as ``expert_gate_up``
    computes it (that one stores it in the pair list's order). One launch. ``routing_out``:
    (experts [N, S] int32, weights [N, S] fp32) to fill with that routing (``routing_ref``'s), for
    ``down_combine(..., routing=routing_out)``."""
    _check_tensor("x", x, 2)
    _check_weights("w13", w13, "x", x, x.shape[1])
    if w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E_total, 2F, H] (gate/up rows interleaved), got {tuple(w13.shape)}")
    if not isinstance(activation, Activation):
        raise ValueError(f"activation: expected an Activation, got {activation!r}")
    (N, H), F_ = x.shape, w13.shape[1] // 2
    S = _check_routing(logits, N, x, top_k, num_experts, w13.shape[0])
    if routing_out is not None:
        routing_out = _check_routing_buffers("routing_out", routing_out, N, S, x.device)
    h = _check_out("out", out, (N * S, F_), x.dtype, x.device)
    if not use_triton(x):
        if routing_out is not None:
            for buffer, ref in zip(routing_out, routing_ref(logits, top_k, num_experts, S - top_k)):
                buffer.copy_(ref)
        return h.copy_(pair_gate_up_ref(x, w13, logits, top_k, activation, num_experts=num_experts))
    if N == 0 or F_ == 0:
        return h
    cfg = config or pair_gemv_config("gate_up", x.dtype, x.device, num_tokens=N)
    pdl = use_pdl(x.device)
    experts, weights = routing_out if routing_out is not None else (h, h)  # unused without WRITE_ROUTING
    _pair_gate_up_kernel[(N * S, cdiv(F_, cfg.block))](
        x, w13, logits, h, experts, weights,
        F_, H, x.stride(0), w13.stride(0), w13.stride(1), logits.stride(0), h.stride(0),
        activation.kernel_limit, float(activation.alpha),
        E=num_experts, E_PAD=max(2, next_power_of_2(num_experts)), TOP_K=top_k,
        K_PAD=max(2, next_power_of_2(top_k)), SLOTS=S, WRITE_ROUTING=routing_out is not None,
        ACT=activation.code, EVEN_K=H % cfg.block_k == 0, BLOCK_F=cfg.block, BLOCK_K=cfg.block_k, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return h


def down_combine(h: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int, out_dtype: torch.dtype | str,
                 *, num_experts: int, routing: tuple | None = None, out: torch.Tensor | None = None,
                 config: PairGemvConfig | None = None) -> torch.Tensor:
    """[N, H] in ``out_dtype``: out[n] = sum_j weight[n, j] * round(h[n S + j] @ w2[expert[n, j]]^T)
    over the slots of ``logits``' routing (module docstring), in slot order as fp32 fused
    multiply-adds, rounded once: ``expert_down`` then ``combine`` in one launch. h [N * S, F],
    w2 [E_total, H, F] in h's dtype, logits [N, >= E + 1] in h's dtype. ``routing``: the
    (experts, weights) ``pair_gate_up(..., routing_out=...)`` wrote for these logits, read instead
    of routing here."""
    _check_tensor("h", h, 2)
    _check_weights("w2", w2, "h", h, h.shape[1])
    N = logits.shape[0] if isinstance(logits, torch.Tensor) and logits.dim() == 2 else -1
    S = _check_routing(logits, N, h, top_k, num_experts, w2.shape[0])
    if h.shape[0] != N * S:
        raise ValueError(f"h: expected N * S = {N * S} rows, got shape {tuple(h.shape)}")
    if routing is not None:
        routing = _check_routing_buffers("routing", routing, N, S, h.device)
    out_dtype = parse_dtype(out_dtype, "out_dtype")
    H, F_ = w2.shape[1], h.shape[1]
    o = _check_out("out", out, (N, H), out_dtype, h.device)
    if not use_triton(h):
        if routing is not None:
            return o.copy_(_down_combine_routed_ref(h, w2, *routing, out_dtype))
        return o.copy_(down_combine_ref(h, w2, logits, top_k, out_dtype, num_experts=num_experts))
    if N == 0 or H == 0:
        return o
    pdl = use_pdl(h.device)
    if routing is not None:
        cfg = config or pair_gemv_config("down", h.dtype, h.device)
        _down_combine_kernel[(N, cdiv(H, cfg.block))](
            h, w2, *routing, o,
            H, h.stride(0), w2.stride(0), w2.stride(1), o.stride(0),
            SLOTS=S, F=F_, EVEN_K=F_ % cfg.block_k == 0, BLOCK_H=cfg.block, BLOCK_K=cfg.block_k, USE_PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
        )
        return o
    num_shared = S - top_k
    cfg = config or pair_gemv_config("down_routing", h.dtype, h.device, top_k=top_k, num_features=F_)
    _down_combine_routing_kernel[(N, cdiv(H, cfg.block))](
        h, w2, logits, o,
        H, h.stride(0), w2.stride(0), w2.stride(1), logits.stride(0), o.stride(0),
        E=num_experts, E_PAD=max(2, next_power_of_2(num_experts)), TOP_K=top_k,
        K_PAD=max(2, next_power_of_2(top_k)), NUM_SHARED=num_shared,
        SHARED_PAD=max(2, next_power_of_2(num_shared)), F=F_, F_PAD=max(16, next_power_of_2(F_)),
        BLOCK_H=cfg.block, USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return o


def swiglu_moe_decode(x: torch.Tensor, router_with_gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      top_k: int, activation: Activation, *, num_experts: int) -> torch.Tensor:
    """The block on a few tokens x [N, H] -> [N, H] in x's dtype: ``router_logits``, ``pair_gate_up``,
    ``down_combine`` (which routes itself up to ROUTE_IN_DOWN_TOKENS tokens, else reads the routing
    gate/up wrote). Three launches."""
    logits = router_logits(x, router_with_gate)
    routing = None
    if x.shape[0] > ROUTE_IN_DOWN_TOKENS:
        slots = top_k + w13.shape[0] - num_experts
        routing = (torch.empty(x.shape[0], slots, dtype=torch.int32, device=x.device),
                   torch.empty(x.shape[0], slots, dtype=torch.float32, device=x.device))
    h = pair_gate_up(x, w13, logits, top_k, activation, num_experts=num_experts, routing_out=routing)
    return down_combine(h, w2, logits, top_k, x.dtype, num_experts=num_experts, routing=routing)


# ----------------------------------------------------------------------------- references
def routing_ref(logits: torch.Tensor, top_k: int, num_experts: int,
                num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, S] int32, weights [N, S] fp32) of ``logits`` [N, >= E + 1] in plain PyTorch (the
    module docstring's routing; the shared chunks E .. E + num_shared - 1 last, with the scale)."""
    E = num_experts
    logits32 = logits[:, :E].float()
    ex = torch.exp(logits32 - logits32.max(dim=-1, keepdim=True).values)
    top_ex, experts = torch.sort(ex, dim=-1, descending=True, stable=True)  # ties: the lower id first
    probs = top_ex[:, :top_k] / ex.sum(dim=-1, keepdim=True)
    total = probs[:, 0]
    for j in range(1, top_k):  # slot order
        total = total + probs[:, j]
    weights = [(probs / total[:, None]).to(logits.dtype).float()]
    ids = [experts[:, :top_k].to(torch.int32)]
    if num_shared:
        N = logits.shape[0]
        weights.append(torch.sigmoid(logits[:, E:E + 1].float()).expand(N, num_shared))
        ids.append(torch.arange(E, E + num_shared, dtype=torch.int32, device=logits.device).expand(N, num_shared))
    return torch.cat(ids, dim=1).contiguous(), torch.cat(weights, dim=1).contiguous()


def _pair_list(experts: torch.Tensor, num_experts_total: int):
    """The grouped path's pair list of [N, S] expert ids (16-row blocks): the references reuse its
    references, so both paths share one contract."""
    return (*sort_pairs_ref(experts, num_experts_total, 16), 16)


def pair_gate_up_ref(x, w13, logits, top_k: int, activation: Activation, *, num_experts: int) -> torch.Tensor:
    """``pair_gate_up`` in plain PyTorch (``expert_gate_up_ref``: the dense contract per expert),
    its rows taken from list order to pair order."""
    experts, _ = routing_ref(logits, top_k, num_experts, w13.shape[0] - num_experts)
    pair_list = _pair_list(experts, w13.shape[0])
    h_list = expert_gate_up_ref(x, w13, *pair_list[:2], experts.shape[1], activation, 16)
    entries, pairs, _ = listed_entries(*pair_list, experts.numel())
    h = h_list.new_zeros(experts.numel(), h_list.shape[1])
    h[pairs] = h_list[entries]
    return h


def down_combine_ref(h, w2, logits, top_k: int, out_dtype: torch.dtype, *, num_experts: int) -> torch.Tensor:
    """``down_combine`` in plain PyTorch: ``expert_down_ref`` then ``combine_ref``."""
    return _down_combine_routed_ref(h, w2, *routing_ref(logits, top_k, num_experts, w2.shape[0] - num_experts),
                                    out_dtype)


def _down_combine_routed_ref(h, w2, experts, weights, out_dtype: torch.dtype) -> torch.Tensor:
    """``down_combine`` on given (experts, weights) [N, S]: ``expert_down_ref`` (h's rows taken from
    pair order to list order) then ``combine_ref``."""
    pair_list = _pair_list(experts, w2.shape[0])
    entries, pairs, _ = listed_entries(*pair_list, experts.numel())
    h_list = h.new_zeros(pair_list[0].numel(), h.shape[1])
    h_list[entries] = h[pairs]
    return combine_ref(expert_down_ref(h_list, w2, *pair_list, experts.numel()), weights, out_dtype)
