"""Routing of the Qwen3.5-MoE sparse block (issue 19): router and shared-expert gate in one GEMM,
softmax, top-k, renormalisation, and the per-expert pair list the grouped GEMMs read. Two Triton
launches, fixed grids, outputs whose sizes depend on shapes only, no host sync: CUDA-graph
capturable.

Shapes: x [N, H]; ``router_with_gate`` [E + 1, H] in x's dtype (rows 0..E-1 HF's router weight,
row E the ``shared_expert_gate`` weight, so one GEMM computes both). k = ``top_k``, ``num_shared``
the shared expert's chunks (0 allowed: row E is then ignored), S = k + num_shared slots per token,
E_total = E + num_shared expert ids (the shared chunks are ids E .. E_total - 1). A *pair* is
(token n, slot j), numbered p = n * S + j.

Numerics contract (``naive.route_ref``'s, with the ties fixed):
- logits = F.linear(x, router_with_gate): the GEMM's fp32 accumulation (fp32 x: as torch's fp32
  matmul settings allow), rounded to x's dtype, the router's E and the gate's one in one call;
- softmax in fp32 over the E experts; the top k probabilities, in descending order, ties to the
  lower expert id (torch.topk leaves the order of ties unspecified: on the CPU it is not the id
  order, so the reference here sorts stably instead);
- the k weights renormalised to sum 1 in fp32 (sum in slot order), rounded to x's dtype, stored as
  fp32;
- the shared scale sigmoid(x w_sg^T): the logit rounded to x's dtype, the sigmoid in fp32; the same
  value in each of the num_shared shared slots.

Outputs (``Routing``):
- ``weights`` [N, S] fp32 and ``experts`` [N, S] int32: slots 0..k-1 the routed experts, slots
  k..S-1 the shared chunks E, E + 1, ... with the shared scale;
- ``sorted_pairs`` [P_max] int32: the pair ids grouped by expert id ascending, ascending p within
  an expert, each expert's group padded with the sentinel N * S up to a multiple of ``block_m``
  (experts with no pair take no room); every entry past the last group is the sentinel too. The
  token of an entry p is p // S, its weight ``weights.view(-1)[p]``; a grouped GEMM tile of
  ``block_m`` rows reads one block of this list and skips the sentinel rows;
- ``block_experts`` [P_max // block_m] int32: the expert of each block of ``block_m`` entries, -1
  for the unused blocks at the end (a grouped GEMM program whose block is -1 exits);
- P_max = ``max_pairs(N, S, E_total, block_m)`` = cdiv(N S + min(E_total, N S) (block_m - 1),
  block_m) block_m: at most min(E_total, N S) experts have a pair, each padding fewer than
  block_m entries, so the list always fits.

Launches: the router and gate logits by one GEMM, ``F.linear(x, router_with_gate)`` (cuBLAS; a
Triton program per 16 tokens reading the whole router was 115 us at one token on the H200, one
program's share of the GPU's bandwidth); ``_route_kernel`` (a program per ROUTE_BLOCK_T
tokens: softmax, k rounds of argmax, the gate's sigmoid) writes weights and experts; the counting
sort, deterministic, no atomics: ``_count_kernel`` (a program per ``sort_chunk`` pairs: its pairs
per expert), ``_offsets_kernel`` (one program: each expert's first entry, the exclusive prefix
sum of the padded counts, and each chunk's first entry per expert), ``_scatter_kernel`` (a program
per chunk: each pair id to its chunk's entry for its expert + the chunk's earlier pairs of that
expert; a share of the blocks: each block's expert, the sentinel at each padding entry). One
program sorting all pairs took 2.3 ms at 4096 tokens on the H200. Up to 16 tokens (decode) the
routing kernel is one program and sorts too: two launches in all. It sorts up to FEW_PAIRS pairs
by pairwise comparisons (``_sort_few_pairs``: 10.7 -> 3.8 us at one token and 29.6 -> 13.2 at 8
on the H200 against one-hot counts over the 512 padded expert ids), more by those one-hot counts
(``_sort_in_one_program``: many slots a token). The block's decode path (``decode.py``) routes
inside its own kernels and uses none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuselm.runtime import cdiv, check_same_device, check_tensor, next_power_of_2, use_triton

MAX_EXPERTS = 512
"""The most routed experts E ``route`` takes: a program holds all E logits of its tokens."""

_INT32_MAX = 2**31 - 1


@dataclass
class Routing:
    """The routing of N tokens (module docstring: layout and numerics)."""

    weights: torch.Tensor  # [N, S] fp32: k renormalised top-k weights, then the shared scale per shared slot
    experts: torch.Tensor  # [N, S] int32: k expert ids (descending probability), then E .. E + num_shared - 1
    sorted_pairs: torch.Tensor  # [P_max] int32: pair ids p = n S + j grouped by expert, padded with N S
    block_experts: torch.Tensor  # [P_max // block_m] int32: each block's expert, -1 past the used blocks
    top_k: int
    num_shared: int
    block_m: int


def max_pairs(num_tokens: int, slots: int, num_experts_total: int, block_m: int) -> int:
    """P_max, the length of ``sorted_pairs``: room for N S pairs plus fewer than block_m padding
    entries for each expert that can have a pair (at most min(E_total, N S) of them), rounded up
    to whole blocks."""
    pairs = num_tokens * slots
    return cdiv(pairs + min(num_experts_total, pairs) * (block_m - 1), block_m) * block_m


def pad_router_rows(router_with_gate: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """router_with_gate [E + 1, H] with zero rows appended up to a multiple of ``multiple`` rows
    (a new tensor): ``route(..., num_experts=E)`` then gets 16-byte aligned logits rows."""
    rows = router_with_gate.shape[0]
    return F.pad(router_with_gate, (0, 0, 0, cdiv(rows, multiple) * multiple - rows))


# ----------------------------------------------------------------------------- reference
def sort_pairs_ref(experts: torch.Tensor, num_experts_total: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts) of an [N, S] expert-id tensor, in plain PyTorch (a stable sort)."""
    flat = experts.reshape(-1).long()
    pairs = flat.numel()
    p_max = max_pairs(experts.shape[0], experts.shape[1], num_experts_total, block_m)
    sorted_pairs = torch.full((p_max,), pairs, dtype=torch.int32, device=experts.device)
    block_experts = torch.full((p_max // block_m,), -1, dtype=torch.int32, device=experts.device)
    if pairs == 0:
        return sorted_pairs, block_experts
    order = torch.sort(flat, stable=True).indices  # ascending expert, ascending p within one
    counts = torch.bincount(flat, minlength=num_experts_total)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded
    grouped_start = torch.cumsum(counts, 0) - counts  # where each expert's run begins in ``order``
    e_sorted = flat[order]
    rank = torch.arange(pairs, device=experts.device) - grouped_start[e_sorted]
    sorted_pairs[start[e_sorted] + rank] = order.to(torch.int32)
    blocks = padded // block_m
    block_experts[:int(blocks.sum())] = torch.repeat_interleave(
        torch.arange(num_experts_total, dtype=torch.int32, device=experts.device), blocks)
    return sorted_pairs, block_experts


def route_pairs_ref(x: torch.Tensor, router_with_gate: torch.Tensor, top_k: int, num_shared: int,
                    block_m: int, num_experts: int | None = None) -> Routing:
    """The routing in plain PyTorch (the contract of the module docstring; the CPU fallback and
    the tests' reference). Numerics of ``naive.route_ref``, except that the top-k comes from a
    stable descending sort, so ties go to the lower expert id as in the kernel."""
    N = x.shape[0]
    E = router_with_gate.shape[0] - 1 if num_experts is None else num_experts
    logits = F.linear(x, router_with_gate)  # the router's E and the gate's one logit, as the kernel path
    probs = torch.softmax(logits[:, :E], dim=-1, dtype=torch.float32)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :top_k], experts[:, :top_k]
    weights = [(top / top.sum(dim=-1, keepdim=True)).to(x.dtype).float()]
    ids = [experts.to(torch.int32)]
    if num_shared:
        scale = torch.sigmoid(logits[:, E:E + 1].float())  # [N, 1]
        weights.append(scale.expand(N, num_shared))
        ids.append(torch.arange(E, E + num_shared, dtype=torch.int32, device=x.device).expand(N, num_shared))
    weights, experts = torch.cat(weights, dim=1).contiguous(), torch.cat(ids, dim=1).contiguous()
    sorted_pairs, block_experts = sort_pairs_ref(experts, E + num_shared, block_m)
    return Routing(weights, experts, sorted_pairs, block_experts, top_k, num_shared, block_m)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, experts_ptr, sorted_ptr, block_experts_ptr,
    N, stride_ln, num_blocks,
    E: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
    BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
    SORT: tl.constexpr, BLOCK_M: tl.constexpr, SORT_BLOCK: tl.constexpr, E_TOTAL_PAD: tl.constexpr,
    PAIRS_PAD: tl.constexpr, PAIRS_STEP: tl.constexpr, RUN_BLOCKS: tl.constexpr,
):
    """Weights and experts of BLOCK_T tokens from their [E + 1] logits (the router's E, then the
    shared gate's), as the module docstring; with SORT (the only program) the pair sort too."""
    S: tl.constexpr = TOP_K + NUM_SHARED
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < N
    real = (cols < E)[None, :]
    # Rows past N wrap to valid ones (their results are not stored); columns past E read -inf.
    row_ptrs = logits_ptr + (rows % N).to(tl.int64) * stride_ln
    # softmax in fp32 over the E experts
    logits = tl.load(row_ptrs[:, None] + cols[None, :], mask=real, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    prob = p / tl.sum(p, axis=1)[:, None]
    prob = tl.where(real, prob, -1.0)  # padding columns are never chosen (probabilities are >= 0)

    # Top-k by k rounds of argmax: ties to the lowest id; a chosen column drops to -1.
    slots = tl.arange(0, S_PAD)[None, :]
    out_w = tl.zeros([BLOCK_T, S_PAD], dtype=tl.float32)
    out_e = tl.zeros([BLOCK_T, S_PAD], dtype=tl.int32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in range(TOP_K):
        best = tl.max(prob, axis=1)
        idx = tl.min(tl.where(prob == best[:, None], cols[None, :], E_PAD), axis=1)
        idx = tl.minimum(idx, E - 1)  # a NaN row matches nothing: keep the id in range
        total += best
        out_w = tl.where(slots == j, best[:, None], out_w)
        out_e = tl.where(slots == j, idx[:, None], out_e)
        prob = tl.where(cols[None, :] == idx[:, None], -1.0, prob)
    out_w = (out_w / total[:, None]).to(logits_ptr.dtype.element_ty).to(tl.float32)
    if NUM_SHARED > 0:
        gate = tl.load(row_ptrs + E).to(tl.float32)
        scale = 1.0 / (1.0 + tl.exp(-gate))
        shared = slots >= TOP_K
        out_w = tl.where(shared, scale[:, None], out_w)
        out_e = tl.where(shared, E - TOP_K + slots, out_e)

    offs = rows.to(tl.int64)[:, None] * S + slots
    mask = row_ok[:, None] & (slots < S)
    tl.store(weights_ptr + offs, out_w, mask=mask)
    tl.store(experts_ptr + offs, out_e, mask=mask)
    if SORT:  # the only program (N <= DECODE_TOKENS): sort the pairs here too, one launch in all
        tl.debug_barrier()  # this program's expert ids are in memory for all its threads
        if PAIRS_PAD > 0:
            _sort_few_pairs(experts_ptr, sorted_ptr, block_experts_ptr, N * S, num_blocks, E + NUM_SHARED,
                            BLOCK_M, PAIRS_PAD, PAIRS_STEP, RUN_BLOCKS)
        else:
            _sort_in_one_program(experts_ptr, sorted_ptr, block_experts_ptr, N * S, num_blocks, E + NUM_SHARED,
                                 BLOCK_M, SORT_BLOCK, E_TOTAL_PAD)


@triton.jit
def _one_hot(e, ecols, E_TOTAL):
    """[BLOCK, E_PAD] int32: row i is 1 at column e[i]; ids outside [0, E_TOTAL) count nowhere."""
    return ((e[:, None] == ecols[None, :]) & (ecols < E_TOTAL)[None, :]).to(tl.int32)


@triton.jit
def _place_pairs(experts_ptr, sorted_ptr, i0, i_end, nxt, E_TOTAL, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """Pairs i0 .. i_end - 1, in order, each to nxt[e] + (pairs of e before it in this run); returns
    nxt advanced past them (earlier steps through ``nxt``, earlier lanes of a step through the
    column-wise exclusive cumsum)."""
    ecols = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK)
    for s0 in range(i0, i_end, BLOCK):
        i = s0 + lanes
        ok = i < i_end
        e = tl.load(experts_ptr + i, mask=ok, other=-1)
        ok = ok & (e >= 0) & (e < E_TOTAL)
        hot = _one_hot(e, ecols, E_TOTAL)
        before = tl.cumsum(hot, axis=0) - hot
        pos = tl.sum(hot * (before + nxt[None, :]), axis=1)
        tl.store(sorted_ptr + pos, i, mask=ok)
        nxt += tl.sum(hot, axis=0)
    return nxt


@triton.jit
def _mark_blocks(sorted_ptr, block_experts_ptr, start, count, b_begin, b_end, num_pairs,
                 BLOCK_M: tl.constexpr, BB: tl.constexpr, E_PAD: tl.constexpr):
    """Blocks b_begin .. b_end - 1 of the list: each block's expert (the number of experts whose
    padded range ends at or before the block's first entry; empty experts end where they start;
    -1 past the used blocks) and the sentinel num_pairs at each of their padding entries (those
    past the expert's count, and every entry of an unused block). Pair entries are not touched."""
    ecols = tl.arange(0, E_PAD)
    end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    used = tl.sum(end - start, axis=0)
    j = tl.arange(0, BLOCK_M)
    for b0 in range(b_begin, b_end, BB):
        b = b0 + tl.arange(0, BB)
        ok = b < b_end
        q = b * BLOCK_M
        unused = q >= used
        owner = tl.sum((end[None, :] <= q[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + b, tl.where(unused, -1, owner), mask=ok)
        owner_start = tl.sum(tl.where(ecols[None, :] == owner[:, None], start[None, :], 0), axis=1)
        owner_count = tl.sum(tl.where(ecols[None, :] == owner[:, None], count[None, :], 0), axis=1)
        entry = q[:, None] + j[None, :]
        padding = unused[:, None] | (entry - owner_start[:, None] >= owner_count[:, None])
        tl.store(sorted_ptr + entry, tl.zeros([BB, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=ok[:, None] & padding)


@triton.jit
def _sort_in_one_program(
    experts_ptr, sorted_ptr, block_experts_ptr,
    num_pairs, num_blocks, E_TOTAL,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr,
):
    """The counting sort by one program (module docstring), inlined into ``_route_kernel`` up to
    16 tokens past FEW_PAIRS pairs: pairs per expert, the exclusive prefix sum of the padded
    counts, the blocks and their padding, then each pair to its entry."""
    ecols = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros([E_PAD], dtype=tl.int32)
    for i0 in range(0, num_pairs, BLOCK):
        i = i0 + lanes
        count += tl.sum(_one_hot(tl.load(experts_ptr + i, mask=i < num_pairs, other=-1), ecols, E_TOTAL), axis=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    _mark_blocks(sorted_ptr, block_experts_ptr, start, count, 0, num_blocks, num_pairs, BLOCK_M, BLOCK, E_PAD)
    _place_pairs(experts_ptr, sorted_ptr, 0, num_pairs, start, E_TOTAL, BLOCK, E_PAD)


@triton.jit
def _sort_few_pairs(
    experts_ptr, sorted_ptr, block_experts_ptr,
    num_pairs, num_blocks, E_TOTAL,
    BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, CB: tl.constexpr, MAX_RUN_BLOCKS: tl.constexpr,
):
    """The counting sort of at most P_PAD pairs (decode) by pairwise comparisons, no per-expert
    columns. Pair j goes to its expert's first entry plus its expert's earlier pairs; an expert's
    first entry is the sum of the padded counts of the lower experts that have pairs (each counted
    at its first pair). The first pair of each expert also writes its expert's blocks and padding;
    blocks past the used ones get -1 and sentinels. The same list as ``_sort_in_one_program``.
    [P_PAD, CB] tiles (all pairs i against CB pairs j a step); MAX_RUN_BLOCKS >= an expert's
    blocks (cdiv(P_PAD, BLOCK_M)); blocks b < P_PAD (num_blocks <= num_pairs)."""
    i = tl.arange(0, P_PAD)
    e_i = tl.load(experts_ptr + i, mask=i < num_pairs, other=-1)
    ok_i = (i < num_pairs) & (e_i >= 0) & (e_i < E_TOTAL)  # ids outside [0, E_TOTAL): not counted, not placed
    # pass 1: whether pair i is its expert's first, and the expert's padded count
    before_i = tl.zeros([P_PAD], dtype=tl.int32)
    count_i = tl.zeros([P_PAD], dtype=tl.int32)
    for j0 in range(0, P_PAD, CB):
        j = j0 + tl.arange(0, CB)
        e_j = tl.load(experts_ptr + j, mask=j < num_pairs, other=-1)
        same = (e_i[:, None] == e_j[None, :]) & ok_i[:, None]
        before_i += tl.sum((same & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
        count_i += tl.sum(same.to(tl.int32), axis=1)
    first_i = ok_i & (before_i == 0)
    padded_i = tl.where(first_i, (count_i + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    used = tl.sum(padded_i, axis=0)
    # pass 2: pair j to its entry; an expert's first pair writes its blocks' expert and padding
    r = tl.arange(0, MAX_RUN_BLOCKS)
    m = tl.arange(0, BLOCK_M)
    for j0 in range(0, P_PAD, CB):
        j = j0 + tl.arange(0, CB)
        e_j = tl.load(experts_ptr + j, mask=j < num_pairs, other=-1)
        ok_j = (j < num_pairs) & (e_j >= 0) & (e_j < E_TOTAL)
        same = (e_i[:, None] == e_j[None, :]) & ok_i[:, None]
        before_j = tl.sum((same & (i[:, None] < j[None, :])).to(tl.int32), axis=0)
        count_j = tl.sum(same.to(tl.int32), axis=0)
        start_j = tl.sum(tl.where(e_i[:, None] < e_j[None, :], padded_i[:, None], 0), axis=0)
        tl.store(sorted_ptr + start_j + before_j, j, mask=ok_j)
        first_j = ok_j & (before_j == 0)
        blocks_j = (count_j + BLOCK_M - 1) // BLOCK_M
        tl.store(block_experts_ptr + start_j[:, None] // BLOCK_M + r[None, :],
                 tl.broadcast_to(e_j[:, None], [CB, MAX_RUN_BLOCKS]),
                 mask=first_j[:, None] & (r[None, :] < blocks_j[:, None]))
        pad = start_j + count_j  # the expert's padding entries: pad .. start + blocks BLOCK_M - 1
        tl.store(sorted_ptr + pad[:, None] + m[None, :], tl.zeros([CB, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=first_j[:, None] & (pad[:, None] + m[None, :] < (start_j + blocks_j * BLOCK_M)[:, None]))
    b = tl.arange(0, P_PAD)  # blocks past the used ones: -1, every entry the sentinel
    unused = (b * BLOCK_M >= used) & (b < num_blocks)
    tl.store(block_experts_ptr + b, tl.zeros([P_PAD], dtype=tl.int32) - 1, mask=unused)
    tl.store(sorted_ptr + (b * BLOCK_M)[:, None] + m[None, :], tl.zeros([P_PAD, BLOCK_M], dtype=tl.int32) + num_pairs,
             mask=unused[:, None])


@triton.jit
def _count_kernel(experts_ptr, counts_ptr, num_pairs, E_TOTAL,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """Sort launch 1 (a program per CHUNK pairs): counts [chunks, E_PAD], each chunk's pairs per expert."""
    c = tl.program_id(0)
    ecols = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros([E_PAD], dtype=tl.int32)
    for i0 in range(0, CHUNK, BLOCK):
        i = c * CHUNK + i0 + lanes
        count += tl.sum(_one_hot(tl.load(experts_ptr + i, mask=i < num_pairs, other=-1), ecols, E_TOTAL), axis=0)
    tl.store(counts_ptr + c * E_PAD + ecols, count)


@triton.jit
def _offsets_kernel(counts_ptr, table_ptr, num_chunks, BLOCK_M: tl.constexpr, RB: tl.constexpr, E_PAD: tl.constexpr):
    """Sort launch 2 (one program): each expert's count and first entry (exclusive prefix sum of
    the padded counts) into table [2, E_PAD]; counts[c, e] overwritten by chunk c's first entry for
    expert e (the expert's first entry plus the earlier chunks' pairs of e). RB chunks a step."""
    ecols = tl.arange(0, E_PAD)
    r = tl.arange(0, RB)
    count = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, RB):
        ok = (c0 + r < num_chunks)[:, None]
        count += tl.sum(tl.load(counts_ptr + (c0 + r)[:, None] * E_PAD + ecols[None, :], mask=ok, other=0), axis=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(table_ptr + ecols, start)
    tl.store(table_ptr + E_PAD + ecols, count)
    nxt = start
    for c0 in range(0, num_chunks, RB):
        ok = (c0 + r < num_chunks)[:, None]
        ptrs = counts_ptr + (c0 + r)[:, None] * E_PAD + ecols[None, :]
        cnt = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, nxt[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=ok)
        nxt += tl.sum(cnt, axis=0)


@triton.jit
def _scatter_kernel(experts_ptr, offsets_ptr, table_ptr, sorted_ptr, block_experts_ptr,
                    num_pairs, num_blocks, blocks_per_program, E_TOTAL,
                    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """Sort launch 3 (a program per CHUNK pairs): the chunk's pairs to their entries, and
    ``blocks_per_program`` blocks' experts and padding (disjoint from every pair entry)."""
    c = tl.program_id(0)
    ecols = tl.arange(0, E_PAD)
    i0 = c * CHUNK
    _place_pairs(experts_ptr, sorted_ptr, i0, tl.minimum(i0 + CHUNK, num_pairs),
                 tl.load(offsets_ptr + c * E_PAD + ecols), E_TOTAL, BLOCK, E_PAD)
    b0 = c * blocks_per_program
    _mark_blocks(sorted_ptr, block_experts_ptr, tl.load(table_ptr + ecols), tl.load(table_ptr + E_PAD + ecols),
                 b0, tl.minimum(b0 + blocks_per_program, num_blocks), num_pairs, BLOCK_M, BLOCK, E_PAD)


# ----------------------------------------------------------------------------- host launchers
DECODE_TOKENS = 16  # up to this many tokens one routing program routes and sorts them all
# Past that, tokens per routing program and its warps. H200 (moe.py --sweep-route, the three sort
# launches included): 2 tokens a program on 1 warp 42.7 us at 64 tokens and 69.4 at 4096, against
# 57.3 and 84.1 for 16 tokens on 8 warps (each of the k argmax rounds reduces across the warps).
ROUTE_BLOCK_T = 2
ROUTE_WARPS = 1
FEW_PAIRS = 256  # up to this many pairs (padded to a power of two) that program sorts by pairwise comparisons
FEW_PAIRS_STEP = 32  # ... against this many pairs a step
FEW_PAIRS_WARPS = None  # the routing program's warps then (None: 4 up to 128 pairs, 8 past; a sweep sets it)
SORT_CHUNK = 256  # pairs per program of the count and scatter launches, at least ...
# ... and doubled until at most SORT_MAX_CHUNKS programs: the offsets launch (one program) walks
# [chunks, E_PAD] counts twice (H100, 16384 tokens of the 35B-A3B layer: 576 chunks of 256 pairs,
# 62 us; NOTES.md 74).
SORT_MAX_CHUNKS = 256


def sort_chunk(num_pairs: int) -> int:
    """Pairs per program of the count and scatter launches for ``num_pairs`` pairs."""
    return max(SORT_CHUNK, next_power_of_2(cdiv(num_pairs, SORT_MAX_CHUNKS)))


def _route_geometry(E: int) -> tuple[int, int]:
    """(E_PAD, num_warps) of the routing kernel: all E logits of BLOCK_T tokens in one tile."""
    e_pad = max(16, next_power_of_2(E))
    return e_pad, 8 if e_pad >= 256 else 4


def _sort_geometry(num_experts_total: int) -> tuple[int, int, int]:
    """(E_TOTAL_PAD, BLOCK pairs per step, num_warps) of the counting sort: a one-hot step of
    about 16K elements."""
    e_pad = max(16, next_power_of_2(num_experts_total))
    return e_pad, min(256, max(16, 16384 // e_pad)), 8 if e_pad >= 256 else 4


def route_kernel(logits, num_experts: int, top_k: int, num_shared: int, weights, experts,
                 sorted_pairs, block_experts, block_m: int) -> None:
    """Launch 1: weights, experts [N, S] from the [N, >= E + 1] logits (N >= 1; columns 0..E-1 the
    router's, E the gate's, any further ones unread); when one program holds every token (N <=
    DECODE_TOKENS), the pair sort too (``sort_kernel``'s work, no more launches), else
    ROUTE_BLOCK_T tokens a program."""
    N, E = logits.shape[0], num_experts
    e_pad, num_warps = _route_geometry(E)
    sort = routes_and_sorts_in_one_launch(N)
    e_total_pad, sort_block, sort_warps = _sort_geometry(E + num_shared)
    pairs_pad = next_power_of_2(N * (top_k + num_shared))
    few_pairs = sort and pairs_pad <= FEW_PAIRS
    # Warps and step from the H200 (moe.py --sweep-route; router GEMM included): 1 token 12.8-14.1 us
    # at any warps; 8 tokens 23.0 us (32 pairs a step, 4 warps) against 34.9 for the one-hot sort;
    # 16 tokens 43.7 (8 warps) against 47.8.
    if sort:  # one program routes and sorts every token
        block_t = max(2, next_power_of_2(N))
        if few_pairs:
            num_warps = FEW_PAIRS_WARPS or (4 if pairs_pad <= 128 else 8)
        else:
            num_warps = max(num_warps, sort_warps)
    else:  # no sort in this launch (past DECODE_TOKENS): ROUTE_BLOCK_T tokens a program
        block_t, num_warps = ROUTE_BLOCK_T, ROUTE_WARPS
    _route_kernel[(cdiv(N, block_t),)](
        logits, weights, experts, sorted_pairs if sort else experts, block_experts if sort else experts,
        N, logits.stride(0), block_experts.numel() if sort else 0,
        E=E, TOP_K=top_k, NUM_SHARED=num_shared, BLOCK_T=block_t,
        E_PAD=e_pad, S_PAD=max(2, next_power_of_2(top_k + num_shared)), SORT=sort, BLOCK_M=block_m,
        SORT_BLOCK=sort_block, E_TOTAL_PAD=e_total_pad, PAIRS_PAD=pairs_pad if few_pairs else 0,
        PAIRS_STEP=min(pairs_pad, FEW_PAIRS_STEP), RUN_BLOCKS=max(2, pairs_pad // block_m), num_warps=num_warps,
    )


def routes_and_sorts_in_one_launch(num_tokens: int) -> bool:
    """Whether the routing kernel sorts the pairs too (no sort launches) for N tokens."""
    return num_tokens <= DECODE_TOKENS


def sort_kernel(experts, num_experts_total: int, block_m: int, sorted_pairs, block_experts) -> None:
    """sorted_pairs and block_experts of the [N, S] int32 expert ids in three launches (count per
    chunk of ``sort_chunk`` pairs, offsets in one program, scatter per chunk), deterministic, no atomics."""
    e_pad, block, num_warps = _sort_geometry(num_experts_total)
    num_pairs, num_blocks = experts.numel(), block_experts.numel()
    chunk = sort_chunk(num_pairs)
    chunks = max(1, cdiv(num_pairs, chunk))
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=experts.device)
    table = torch.empty(2, e_pad, dtype=torch.int32, device=experts.device)
    _count_kernel[(chunks,)](experts, counts, num_pairs, num_experts_total, CHUNK=chunk, BLOCK=block, E_PAD=e_pad,
                             num_warps=num_warps)
    _offsets_kernel[(1,)](counts, table, chunks, BLOCK_M=block_m, RB=max(1, 16384 // e_pad), E_PAD=e_pad,
                          num_warps=num_warps)
    _scatter_kernel[(chunks,)](experts, counts, table, sorted_pairs, block_experts, num_pairs, num_blocks,
                               cdiv(num_blocks, chunks), num_experts_total, BLOCK_M=block_m, CHUNK=chunk,
                               BLOCK=block, E_PAD=e_pad, num_warps=num_warps)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_buffer(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"out.{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"out.{name}: expected {shape} {dtype} on {device}, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"out.{name}: must be contiguous")


def route(x: torch.Tensor, router_with_gate: torch.Tensor, top_k: int, num_shared: int, block_m: int,
          *, num_experts: int | None = None, out: Routing | None = None) -> Routing:
    """The routing of x [N, H] (module docstring: layout, numerics, launches).

    Args:
        x: [N, H] fp32/fp16/bf16 tokens.
        router_with_gate: [R, H] in x's dtype, R >= E + 1: the router weight's E rows, then the
            shared expert gate's row (ignored when num_shared is 0), then rows that are ignored
            (``pad_router_rows``: logits rows 16-byte aligned, so that cuBLAS takes its fast
            kernels; at 257 columns it took an sm75-era kernel, 304 us at 16384 tokens on the
            H200). E <= ``MAX_EXPERTS``.
        num_experts: E, by default R - 1.
        top_k: routed experts per token, in [1, E].
        num_shared: the shared expert's slots per token (>= 0), ids E .. E + num_shared - 1.
        block_m: the grouped GEMMs' row tile: a power of two >= 16.
        out: optional buffers to fill (e.g. a CUDA graph's static outputs), shaped as the result.
    Returns:
        ``Routing``; CUDA tensors (or CPU ones under TRITON_INTERPRET=1) take the module
        docstring's launches, other CPU tensors the PyTorch reference.
    """
    check_tensor("x", x)
    check_tensor("router_with_gate", router_with_gate)
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, H], got shape {tuple(x.shape)}")
    N, H = x.shape
    if router_with_gate.dim() != 2 or router_with_gate.shape[0] < 2 or router_with_gate.shape[1] != H:
        raise ValueError(f"router_with_gate: expected [E + 1, H = {H}] with E >= 1, "
                         f"got {tuple(router_with_gate.shape)}")
    E = router_with_gate.shape[0] - 1 if num_experts is None else num_experts
    if not _is_int(E) or not 1 <= E <= router_with_gate.shape[0] - 1:
        raise ValueError(f"num_experts: expected an int in [1, {router_with_gate.shape[0] - 1}] (router_with_gate's "
                         f"rows less the gate's), got {num_experts!r}")
    if E > MAX_EXPERTS:
        raise ValueError(f"router_with_gate: {E} experts exceed the {MAX_EXPERTS} a program holds")
    if router_with_gate.dtype != x.dtype:
        raise ValueError(f"router_with_gate: dtype {router_with_gate.dtype} does not match x's {x.dtype}")
    check_same_device(x=x, router_with_gate=router_with_gate)
    if H < 1:
        raise ValueError("x: expected H >= 1 features")
    if not _is_int(top_k) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, {E}] (the number of experts), got {top_k!r}")
    if not _is_int(num_shared) or num_shared < 0:
        raise ValueError(f"num_shared: expected an int >= 0, got {num_shared!r}")
    if not _is_int(block_m) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= 16, got {block_m!r}")
    S = top_k + num_shared
    E_total = E + num_shared
    p_max = max_pairs(N, S, E_total, block_m)
    if p_max + block_m > _INT32_MAX:
        raise ValueError(f"x: {N} tokens x {S} slots overflow the int32 pair ids")
    device = x.device
    if out is None:
        out = Routing(torch.empty(N, S, dtype=torch.float32, device=device),
                      torch.empty(N, S, dtype=torch.int32, device=device),
                      torch.empty(p_max, dtype=torch.int32, device=device),
                      torch.empty(p_max // block_m, dtype=torch.int32, device=device),
                      top_k, num_shared, block_m)
    else:
        if not isinstance(out, Routing):
            raise TypeError(f"out: expected a Routing, got {type(out).__name__}")
        _check_buffer("weights", out.weights, (N, S), torch.float32, device)
        _check_buffer("experts", out.experts, (N, S), torch.int32, device)
        _check_buffer("sorted_pairs", out.sorted_pairs, (p_max,), torch.int32, device)
        _check_buffer("block_experts", out.block_experts, (p_max // block_m,), torch.int32, device)
        out.top_k, out.num_shared, out.block_m = top_k, num_shared, block_m
    if N == 0:
        return out
    if not use_triton(x):
        ref = route_pairs_ref(x, router_with_gate, top_k, num_shared, block_m, E)
        for name in ("weights", "experts", "sorted_pairs", "block_experts"):
            getattr(out, name).copy_(getattr(ref, name))
        return out
    logits = F.linear(x, router_with_gate)  # [N, R] in x's dtype: cuBLAS's fp32 accumulation, rounded
    route_kernel(logits, E, top_k, num_shared, out.weights, out.experts, out.sorted_pairs, out.block_experts, block_m)
    if not routes_and_sorts_in_one_launch(N):
        sort_kernel(out.experts, E_total, block_m, out.sorted_pairs, out.block_experts)
    return out
