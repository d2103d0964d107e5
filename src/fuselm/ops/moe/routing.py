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
program's share of the GPU's bandwidth); then up to 16 tokens (decode) one more: ``_route_kernel``
as one program routes and sorts (up to FEW_PAIRS pairs by pairwise comparisons,
``_sort_few_pairs``: 10.7 -> 3.8 us at one token and 29.6 -> 13.2 at 8 on the H200 against one-hot
counts over the 512 padded expert ids; more by those one-hot counts, ``_sort_in_one_program``);
past 16 tokens two more, a counting sort, deterministic, no atomics: ``_route_kernel`` on chunks
of ``route_chunk(N)`` tokens (softmax, k rounds of argmax, the gate's sigmoid; weights, experts,
and the chunk's pairs per routed expert), then ``_place_kernel`` (a program per chunk: every
chunk's counts summed to each expert's first entry and the chunk's share of it; its pairs placed
by a cumsum over its tokens of their expert hits; the shared chunks' pairs by arithmetic, since
they are every token in order; a share of the blocks' experts and padding). One program sorting
all pairs took 2.3 ms at 4096 tokens on the H200; count / offsets / scatter launches over one-hot
[pairs, 512] tiles took 52 us at 4096 and 132 at 16384 (NOTES.md 103). The block's decode path
(``decode.py``) routes inside its own kernels and uses none of this.
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
    logits_ptr, weights_ptr, experts_ptr, sorted_ptr, block_experts_ptr, counts_ptr,
    N, chunk_tokens, num_blocks, STRIDE_LN: tl.constexpr,
    E: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr, S_PAD: tl.constexpr,
    SORT: tl.constexpr, BLOCK_M: tl.constexpr, SORT_BLOCK: tl.constexpr, E_TOTAL_PAD: tl.constexpr,
    PAIRS_PAD: tl.constexpr, PAIRS_STEP: tl.constexpr, RUN_BLOCKS: tl.constexpr,
):
    """Weights and experts of ``chunk_tokens`` tokens, BLOCK_T a step, from their [E + 1] logits (the
    router's E, then the shared gate's), as the module docstring; with SORT (the only program) the
    pair sort too, else the chunk's pairs per routed expert into counts [chunks, E_PAD]."""
    S: tl.constexpr = TOP_K + NUM_SHARED
    cols = tl.arange(0, E_PAD)
    slots = tl.arange(0, S_PAD)[None, :]
    real = (cols < E)[None, :]
    chunk_count = tl.zeros([E_PAD], dtype=tl.int32)
    first = tl.program_id(0) * chunk_tokens
    for t0 in range(first, tl.minimum(first + chunk_tokens, N), BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < N
        # Rows past N wrap to valid ones (their results are not stored); columns past E read -inf.
        row_ptrs = logits_ptr + (rows % N).to(tl.int64) * STRIDE_LN
        # softmax in fp32 over the E experts
        if E == E_PAD:  # no mask: with STRIDE_LN a multiple of 8 the rows' loads vectorise (a warp's rows
            # its own, intra-warp reductions; a masked or unaligned load spreads a row over the warps)
            logits = tl.load(row_ptrs[:, None] + cols[None, :]).to(tl.float32)
        else:
            logits = tl.load(row_ptrs[:, None] + cols[None, :], mask=real, other=float("-inf")).to(tl.float32)
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        prob = p / tl.sum(p, axis=1)[:, None]
        prob = tl.where(real, prob, -1.0)  # padding columns are never chosen (probabilities are >= 0)

        # Top-k by k rounds of argmax: ties to the lowest id; a chosen column drops to -1.
        out_w = tl.zeros([BLOCK_T, S_PAD], dtype=tl.float32)
        out_e = tl.zeros([BLOCK_T, S_PAD], dtype=tl.int32)
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        hits = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)  # each expert's slots of a token (a NaN row: k on E - 1)
        for j in range(TOP_K):
            best = tl.max(prob, axis=1)
            idx = tl.min(tl.where(prob == best[:, None], cols[None, :], E_PAD), axis=1)
            idx = tl.minimum(idx, E - 1)  # a NaN row matches nothing: keep the id in range
            total += best
            out_w = tl.where(slots == j, best[:, None], out_w)
            out_e = tl.where(slots == j, idx[:, None], out_e)
            chosen = cols[None, :] == idx[:, None]
            prob = tl.where(chosen, -1.0, prob)
            if not SORT:
                hits += chosen.to(tl.int32)
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
        if not SORT:
            chunk_count += tl.sum(tl.where(row_ok[:, None], hits, 0), axis=0)
    if SORT:  # the only program (N <= DECODE_TOKENS): sort the pairs here too, one launch in all
        tl.debug_barrier()  # this program's expert ids are in memory for all its threads
        if PAIRS_PAD > 0:
            _sort_few_pairs(experts_ptr, sorted_ptr, block_experts_ptr, N * S, num_blocks, E + NUM_SHARED,
                            BLOCK_M, PAIRS_PAD, PAIRS_STEP, RUN_BLOCKS)
        else:
            _sort_in_one_program(experts_ptr, sorted_ptr, block_experts_ptr, N * S, num_blocks, E + NUM_SHARED,
                                 BLOCK_M, SORT_BLOCK, E_TOTAL_PAD)
    else:
        tl.store(counts_ptr + tl.program_id(0) * E_PAD + cols, chunk_count)


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
def _mark_blocks(sorted_ptr, block_experts_ptr, start, count, b_begin, b_end, num_pairs, num_tokens,
                 E, NUM_SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BB: tl.constexpr, E_PAD: tl.constexpr):
    """Blocks b_begin .. b_end - 1 of the list: each block's expert and the sentinel num_pairs at
    each of their padding entries (those past the expert's count, and every entry of an unused
    block); -1 past the used blocks. Pair entries are not touched. start, count [E_PAD]: the
    experts whose ids are columns (a block's expert: the number of them whose padded range ends at
    or before the block's first entry; empty ones end where they start); then NUM_SHARED shared
    chunks E, E + 1, ..., each num_tokens pairs padded to whole blocks."""
    ecols = tl.arange(0, E_PAD)
    end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    routed_used = tl.sum(end - start, axis=0)
    shared_len = (num_tokens + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    used = routed_used + NUM_SHARED * shared_len
    j = tl.arange(0, BLOCK_M)
    for b0 in range(b_begin, b_end, BB):
        b = b0 + tl.arange(0, BB)
        ok = b < b_end
        q = b * BLOCK_M
        unused = q >= used
        owner = tl.sum((end[None, :] <= q[:, None]).to(tl.int32), axis=1)
        owner_start = tl.sum(tl.where(ecols[None, :] == owner[:, None], start[None, :], 0), axis=1)
        owner_count = tl.sum(tl.where(ecols[None, :] == owner[:, None], count[None, :], 0), axis=1)
        if NUM_SHARED > 0:
            in_shared = q >= routed_used
            chunk = (q - routed_used) // tl.maximum(shared_len, 1)
            owner = tl.where(in_shared, E + chunk, owner)
            owner_start = tl.where(in_shared, routed_used + chunk * shared_len, owner_start)
            owner_count = tl.where(in_shared, num_tokens, owner_count)
        tl.store(block_experts_ptr + b, tl.where(unused, -1, owner), mask=ok)
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
    _mark_blocks(sorted_ptr, block_experts_ptr, start, count, 0, num_blocks, num_pairs, 0, 0, 0, BLOCK_M, BLOCK, E_PAD)
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
def _place_kernel(experts_ptr, counts_ptr, sorted_ptr, block_experts_ptr,
                  N, chunk_tokens, num_chunks, num_blocks, blocks_per_program,
                  E: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  RB: tl.constexpr, BB: tl.constexpr):
    """The pair list after the routing kernel's counts (a program per chunk of ``chunk_tokens`` tokens):
    every chunk's counts summed (RB chunks a step) to each expert's first entry, plus the earlier
    chunks' pairs of it; the chunk's routed pairs, BLOCK_T tokens a step, each to that entry plus
    the pairs of its expert in earlier tokens (a cumsum of per-token hits) and earlier slots of its
    token; the shared chunks' pairs, token n at its chunk's first entry + n; and
    ``blocks_per_program`` blocks' experts and padding (disjoint from every pair entry)."""
    S: tl.constexpr = TOP_K + NUM_SHARED
    c = tl.program_id(0)
    ecols = tl.arange(0, E_PAD)
    r = tl.arange(0, RB)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    earlier = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, RB):
        ch = c0 + r
        cnt = tl.load(counts_ptr + ch[:, None] * E_PAD + ecols[None, :], mask=(ch < num_chunks)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
        earlier += tl.sum(tl.where((ch < c)[:, None], cnt, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    routed_used = tl.sum(padded, axis=0)
    shared_len = (N + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    nxt = start + earlier  # each expert's entry for this chunk's first pair of it
    first = c * chunk_tokens
    last = tl.minimum(first + chunk_tokens, N)
    jcols = tl.arange(0, S_PAD)
    for t0 in range(first, last, BLOCK_T):
        n = t0 + tl.arange(0, BLOCK_T)
        ok = n < last
        ids = tl.load(experts_ptr + n[:, None] * S + jcols[None, :], mask=ok[:, None] & (jcols < TOP_K)[None, :],
                      other=-1)  # the tokens' routed ids, one load
        hits = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)  # token n's slots on expert e
        for j in range(TOP_K):
            e = tl.sum(tl.where(jcols[None, :] == j, ids, 0), axis=1)
            hits += (ecols[None, :] == e[:, None]).to(tl.int32)
        hits = tl.where((ecols < E)[None, :], hits, 0)  # ids outside [0, E): not counted, not placed
        entry = tl.cumsum(hits, axis=0) - hits + nxt[None, :]  # token n's first entry on each expert
        nxt += tl.sum(hits, axis=0)
        # slot j: its expert's entry for the token, after the token's earlier slots on it (a NaN row repeats an id)
        placed = ok[:, None] & (ids >= 0) & (ids < E)
        earlier_slots = tl.sum(((ids[:, :, None] == ids[:, None, :]) & (jcols[None, None, :] < jcols[None, :, None]))
                               .to(tl.int32), axis=2)
        pos = tl.gather(entry, tl.where(placed, ids, 0), axis=1) + earlier_slots
        tl.store(sorted_ptr + pos, n[:, None] * S + jcols[None, :], mask=placed)
        for s in range(NUM_SHARED):
            tl.store(sorted_ptr + routed_used + s * shared_len + n, n * S + TOP_K + s, mask=ok)
    b0 = c * blocks_per_program
    _mark_blocks(sorted_ptr, block_experts_ptr, start, total, b0, tl.minimum(b0 + blocks_per_program, num_blocks),
                 N * S, N, E, NUM_SHARED, BLOCK_M, BB, E_PAD)


# ----------------------------------------------------------------------------- host launchers
DECODE_TOKENS = 16  # up to this many tokens one routing program routes and sorts them all
FEW_PAIRS = 256  # up to this many pairs (padded to a power of two) that program sorts by pairwise comparisons
FEW_PAIRS_STEP = 32  # ... against this many pairs a step
FEW_PAIRS_WARPS = None  # the routing program's warps then (None: 4 up to 128 pairs, 8 past; a sweep sets it)
# Past DECODE_TOKENS: the routing and placement launches take a chunk of tokens a program, at least
# ROUTE_CHUNK and doubled until at most ROUTE_MAX_CHUNKS programs (each placement program reads all
# chunks' counts, [chunks, E_PAD] ints); ROUTE_STEP / PLACE_STEP tokens a step on ROUTE_WARPS /
# PLACE_WARPS warps (``moe.py --sweep-route``).
ROUTE_CHUNK = 4
ROUTE_MAX_CHUNKS = 256
ROUTE_STEP = 16
ROUTE_WARPS = 4
PLACE_STEP = 16
PLACE_WARPS = 4


def route_chunk(num_tokens: int) -> int:
    """Tokens a program of the routing (with counts) and placement launches for N tokens."""
    return max(ROUTE_CHUNK, next_power_of_2(cdiv(num_tokens, ROUTE_MAX_CHUNKS)))


def counts_shape(num_tokens: int, num_experts: int) -> tuple[int, int]:
    """The routing kernel's counts past DECODE_TOKENS: [chunks, E_PAD] int32, a row per chunk of
    ``route_chunk(N)`` tokens, a column per routed expert (padded to the kernel's E_PAD)."""
    return cdiv(num_tokens, route_chunk(num_tokens)), _route_geometry(num_experts)[0]


def _route_geometry(E: int) -> tuple[int, int]:
    """(E_PAD, num_warps) of the routing kernel: all E logits of BLOCK_T tokens in one tile."""
    e_pad = max(16, next_power_of_2(E))
    return e_pad, 8 if e_pad >= 256 else 4


def _sort_geometry(num_experts_total: int) -> tuple[int, int, int]:
    """(E_TOTAL_PAD, BLOCK pairs per step, num_warps) of the one-program one-hot sort: a step of
    about 16K elements."""
    e_pad = max(16, next_power_of_2(num_experts_total))
    return e_pad, min(256, max(16, 16384 // e_pad)), 8 if e_pad >= 256 else 4


def route_kernel(logits, num_experts: int, top_k: int, num_shared: int, weights, experts,
                 sorted_pairs, block_experts, block_m: int, counts=None) -> None:
    """Launch 1: weights, experts [N, S] from the [N, >= E + 1] logits (N >= 1; columns 0..E-1 the
    router's, E the gate's, any further ones unread). When one program holds every token (N <=
    DECODE_TOKENS) it sorts the pairs too (no more launches); else ``route_chunk(N)`` tokens a
    program, each program's pairs per routed expert into counts [chunks, E_PAD] int32 for
    ``place_kernel``."""
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
        chunk = block_t = max(2, next_power_of_2(N))
        if few_pairs:
            num_warps = FEW_PAIRS_WARPS or (4 if pairs_pad <= 128 else 8)
        else:
            num_warps = max(num_warps, sort_warps)
    else:
        chunk, block_t, num_warps = route_chunk(N), ROUTE_STEP, ROUTE_WARPS
        if counts is None or tuple(counts.shape) != counts_shape(N, E):
            raise ValueError(f"counts: expected {list(counts_shape(N, E))} int32 past {DECODE_TOKENS} tokens")
    _route_kernel[(cdiv(N, chunk),)](
        logits, weights, experts, sorted_pairs if sort else experts, block_experts if sort else experts,
        experts if sort else counts, N, chunk, block_experts.numel() if sort else 0, STRIDE_LN=logits.stride(0),
        E=E, TOP_K=top_k, NUM_SHARED=num_shared, BLOCK_T=min(block_t, chunk),
        E_PAD=e_pad, S_PAD=max(2, next_power_of_2(top_k + num_shared)), SORT=sort, BLOCK_M=block_m,
        SORT_BLOCK=sort_block, E_TOTAL_PAD=e_total_pad, PAIRS_PAD=pairs_pad if few_pairs else 0,
        PAIRS_STEP=min(pairs_pad, FEW_PAIRS_STEP), RUN_BLOCKS=max(2, pairs_pad // block_m), num_warps=num_warps,
    )


def routes_and_sorts_in_one_launch(num_tokens: int) -> bool:
    """Whether the routing kernel sorts the pairs too (no placement launch) for N tokens."""
    return num_tokens <= DECODE_TOKENS


def place_kernel(experts, counts, num_experts: int, top_k: int, num_shared: int, block_m: int,
                 sorted_pairs, block_experts) -> None:
    """Launch 2 past DECODE_TOKENS tokens: sorted_pairs and block_experts from the [N, S] int32
    expert ids (slots 0..k-1 routed, ids in [0, E); slots k.. the shared chunks E, E + 1, ...,
    not read) and the routing kernel's counts (``counts_shape(N, E)``: each chunk's
    pairs per routed expert). Deterministic, no atomics."""
    N = experts.shape[0]
    e_pad = counts.shape[1]
    chunk, chunks = route_chunk(N), counts.shape[0]
    num_blocks = block_experts.numel()
    _place_kernel[(chunks,)](experts, counts, sorted_pairs, block_experts, N, chunk, chunks, num_blocks,
                             cdiv(num_blocks, chunks), E=num_experts, TOP_K=top_k, NUM_SHARED=num_shared,
                             BLOCK_M=block_m, BLOCK_T=min(PLACE_STEP, chunk), E_PAD=e_pad,
                             S_PAD=max(2, next_power_of_2(top_k)),
                             RB=max(1, 8192 // e_pad), BB=max(1, 4096 // e_pad), num_warps=PLACE_WARPS)


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
    one_launch = routes_and_sorts_in_one_launch(N)
    counts = None if one_launch else torch.empty(counts_shape(N, E), dtype=torch.int32, device=device)
    route_kernel(logits, E, top_k, num_shared, out.weights, out.experts, out.sorted_pairs, out.block_experts,
                 block_m, counts)
    if not one_launch:
        place_kernel(out.experts, counts, E, top_k, num_shared, block_m, out.sorted_pairs, out.block_experts)
    return out
