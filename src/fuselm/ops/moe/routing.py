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
- logits = x router^T accumulated in fp32 (fp32 x: IEEE products), rounded to x's dtype;
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

Launches: ``_route_kernel`` (a program per BLOCK_T = 16 tokens: the fused router/gate GEMM over
H, softmax, k rounds of argmax, the gate's sigmoid) writes weights and experts; the counting sort
(``_sort_kernel``: one program, deterministic, no atomics) counts the pairs per expert, takes the
exclusive prefix sum of the padded counts, writes the sentinel at every padding position and the
expert of every block, fills the list with the sentinel and, after a barrier, scatters each pair
id to start[e] + (earlier pairs of e). Up to 16 tokens (decode)
the routing kernel is that one program and sorts too, after a barrier: one launch; more tokens
take it as a second launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuselm.ops.common.matmul import dot_acc, load_k_step
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
                    block_m: int) -> Routing:
    """The routing in plain PyTorch (the contract of the module docstring; the CPU fallback and
    the tests' reference). Numerics of ``naive.route_ref``, except that the top-k comes from a
    stable descending sort, so ties go to the lower expert id as in the kernel."""
    N = x.shape[0]
    E = router_with_gate.shape[0] - 1
    probs = torch.softmax(F.linear(x, router_with_gate[:E]), dim=-1, dtype=torch.float32)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :top_k], experts[:, :top_k]
    weights = [(top / top.sum(dim=-1, keepdim=True)).to(x.dtype).float()]
    ids = [experts.to(torch.int32)]
    if num_shared:
        scale = torch.sigmoid(F.linear(x, router_with_gate[E:]).float())  # [N, 1]
        weights.append(scale.expand(N, num_shared))
        ids.append(torch.arange(E, E + num_shared, dtype=torch.int32, device=x.device).expand(N, num_shared))
    weights, experts = torch.cat(weights, dim=1).contiguous(), torch.cat(ids, dim=1).contiguous()
    sorted_pairs, block_experts = sort_pairs_ref(experts, E + num_shared, block_m)
    return Routing(weights, experts, sorted_pairs, block_experts, top_k, num_shared, block_m)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _route_kernel(
    x_ptr, w_ptr, weights_ptr, experts_ptr, sorted_ptr, block_experts_ptr,
    N, H, stride_xn, stride_wn, num_slots, num_blocks,
    E: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, IEEE: tl.constexpr, EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
    SORT: tl.constexpr, BLOCK_M: tl.constexpr, SORT_BLOCK: tl.constexpr, E_TOTAL_PAD: tl.constexpr,
):
    S: tl.constexpr = TOP_K + NUM_SHARED
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    k = tl.arange(0, BLOCK_H)
    # Rows past N and columns past E wrap to valid ones: their results are masked or never stored.
    x_ptrs = x_ptr + (rows % N).to(tl.int64)[:, None] * stride_xn + k[None, :]
    w_ptrs = w_ptr + (cols % E).to(tl.int64)[None, :] * stride_wn + k[:, None]  # [BLOCK_H, E_PAD] of router.T
    acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    # The gate row E as a 16-column operand (the smallest dot) with only column 0 non-zero: 16
    # extra columns instead of doubling E_PAD when E is a power of two.
    gcols = tl.arange(0, 16)
    g_ptrs = w_ptr + tl.full([], E, tl.int64) * stride_wn + k[:, None] + gcols[None, :] * 0
    acc_g = tl.zeros([BLOCK_T, 16], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        xt, w = load_k_step(x_ptrs, w_ptrs, k, H - h0, EVEN_H)
        acc = dot_acc(xt, w, acc, IEEE)
        if NUM_SHARED > 0:
            g = tl.load(g_ptrs, mask=(k < H - h0)[:, None] & (gcols == 0)[None, :], other=0.0)
            acc_g = dot_acc(xt, g, acc_g, IEEE)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
        g_ptrs += BLOCK_H

    # Logits rounded to the model dtype (HF's router linear), softmax in fp32 over the E experts.
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    real = (cols < E)[None, :]
    logits = tl.where(real, logits, float("-inf"))
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
    out_w = (out_w / total[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    if NUM_SHARED > 0:
        gate = tl.sum(acc_g, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = 1.0 / (1.0 + tl.exp(-gate))
        shared = slots >= TOP_K
        out_w = tl.where(shared, scale[:, None], out_w)
        out_e = tl.where(shared, E - TOP_K + slots, out_e)

    offs = rows.to(tl.int64)[:, None] * S + slots
    mask = (rows < N)[:, None] & (slots < S)
    tl.store(weights_ptr + offs, out_w, mask=mask)
    tl.store(experts_ptr + offs, out_e, mask=mask)
    if SORT:  # the only program (N <= BLOCK_T): sort the pairs here too, one launch in all
        tl.debug_barrier()  # this program's expert ids are in memory for all its threads
        _sort_kernel(experts_ptr, sorted_ptr, block_experts_ptr, N * S, num_slots, num_blocks, E + NUM_SHARED,
                     BLOCK_M, SORT_BLOCK, E_TOTAL_PAD)


@triton.jit
def _sort_kernel(
    experts_ptr, sorted_ptr, block_experts_ptr,
    num_pairs, num_slots, num_blocks, E_TOTAL,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr,
):
    """The counting sort of one program (module docstring), over the [num_pairs] expert ids: a
    kernel of its own past 16 tokens, inlined into ``_route_kernel`` up to 16."""
    ecols = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK)

    # Pass 1: pairs per expert (one-hot rows summed); ids outside [0, E_TOTAL) count nowhere.
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for i0 in range(0, num_pairs, BLOCK):
        i = i0 + lanes
        e = tl.load(experts_ptr + i, mask=i < num_pairs, other=-1)
        hot = ((e[:, None] == ecols[None, :]) & (ecols < E_TOTAL)[None, :]).to(tl.int32)
        counts += tl.sum(hot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded  # exclusive prefix sum: each expert's first entry
    used = tl.sum(padded, axis=0)

    # The sentinel everywhere first; the scatter below overwrites the pairs' entries after a
    # barrier (this program's threads see each other's stores past it).
    for q0 in range(0, num_slots, BLOCK):
        q = q0 + lanes
        tl.store(sorted_ptr + q, tl.zeros([BLOCK], dtype=tl.int32) + num_pairs, mask=q < num_slots)
    tl.debug_barrier()

    # Each block's expert: the number of experts whose range ends at or before the block's first
    # entry (empty experts end where they start); -1 past ``used``.
    for b0 in range(0, num_blocks, BLOCK):
        b = b0 + lanes
        q = b * BLOCK_M
        owner = tl.sum((end[None, :] <= q[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + b, tl.where(q < used, owner, -1), mask=b < num_blocks)

    # Pass 2: in pair order, each pair to start[e] + (pairs of e before it): earlier blocks through
    # the running ``nxt``, earlier lanes of this block through the column-wise exclusive cumsum.
    nxt = start
    for i0 in range(0, num_pairs, BLOCK):
        i = i0 + lanes
        ok = i < num_pairs
        e = tl.load(experts_ptr + i, mask=ok, other=-1)
        ok = ok & (e >= 0) & (e < E_TOTAL)
        hot = ((e[:, None] == ecols[None, :]) & (ecols < E_TOTAL)[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot
        pos = tl.sum(hot * (before + nxt[None, :]), axis=1)
        tl.store(sorted_ptr + pos, i, mask=ok)
        nxt += tl.sum(hot, axis=0)


# ----------------------------------------------------------------------------- host launchers
def _route_geometry(E: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, E_PAD, num_warps): 16 tokens (the smallest dot), the H step sized so a
    router tile [E_PAD, BLOCK_H] is about 32 KiB (16..128)."""
    e_pad = max(16, next_power_of_2(E))
    elem = torch.finfo(dtype).bits // 8
    block_h = min(128, max(16, 32768 // (e_pad * elem)))
    return 16, block_h, e_pad, 8 if e_pad >= 256 else 4


def _sort_geometry(num_experts_total: int) -> tuple[int, int, int]:
    """(E_TOTAL_PAD, BLOCK pairs per step, num_warps) of the counting sort: a one-hot step of
    about 16K elements."""
    e_pad = max(16, next_power_of_2(num_experts_total))
    return e_pad, min(256, max(16, 16384 // e_pad)), 8 if e_pad >= 256 else 4


def route_kernel(x, router_with_gate, top_k: int, num_shared: int, weights, experts,
                 sorted_pairs=None, block_experts=None, block_m: int = 16) -> None:
    """Launch 1: weights, experts [N, S] of x [N, H] (N >= 1) and the fused router/gate weight;
    with ``sorted_pairs`` / ``block_experts`` given and one program holding every token (N <=
    BLOCK_T = 16, decode), the pair sort too (``sort_kernel``'s work, no second launch)."""
    N, H = x.shape
    E = router_with_gate.shape[0] - 1
    block_t, block_h, e_pad, num_warps = _route_geometry(E, x.dtype)
    sort = sorted_pairs is not None and N <= block_t
    e_total_pad, sort_block, sort_warps = _sort_geometry(E + num_shared)
    _route_kernel[(cdiv(N, block_t),)](
        x, router_with_gate, weights, experts, sorted_pairs if sort else experts, block_experts if sort else experts,
        N, H, x.stride(0), router_with_gate.stride(0),
        sorted_pairs.numel() if sort else 0, block_experts.numel() if sort else 0,
        E=E, TOP_K=top_k, NUM_SHARED=num_shared, IEEE=x.dtype == torch.float32, EVEN_H=H % block_h == 0,
        BLOCK_T=block_t, BLOCK_H=block_h, E_PAD=e_pad, S_PAD=max(2, next_power_of_2(top_k + num_shared)),
        SORT=sort, BLOCK_M=block_m, SORT_BLOCK=sort_block, E_TOTAL_PAD=e_total_pad,
        num_warps=max(num_warps, sort_warps) if sort else num_warps,
    )


def routes_and_sorts_in_one_launch(num_tokens: int) -> bool:
    """Whether ``route`` takes one launch (the routing kernel sorts the pairs too) for N tokens."""
    return num_tokens <= _route_geometry(1, torch.float32)[0]


def sort_kernel(experts, num_experts_total: int, block_m: int, sorted_pairs, block_experts) -> None:
    """Launch 2 (N > 16): sorted_pairs and block_experts of the [N, S] int32 expert ids (one program)."""
    e_pad, block, num_warps = _sort_geometry(num_experts_total)
    _sort_kernel[(1,)](
        experts, sorted_pairs, block_experts,
        experts.numel(), sorted_pairs.numel(), block_experts.numel(), num_experts_total,
        BLOCK_M=block_m, BLOCK=block, E_PAD=e_pad, num_warps=num_warps,
    )


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
          *, out: Routing | None = None) -> Routing:
    """The routing of x [N, H] (module docstring: layout, numerics, launches).

    Args:
        x: [N, H] fp32/fp16/bf16 tokens.
        router_with_gate: [E + 1, H] in x's dtype: the router weight's E rows, then the shared
            expert gate's row (ignored when num_shared is 0). E <= ``MAX_EXPERTS``.
        top_k: routed experts per token, in [1, E].
        num_shared: the shared expert's slots per token (>= 0), ids E .. E + num_shared - 1.
        block_m: the grouped GEMMs' row tile: a power of two >= 16.
        out: optional buffers to fill (e.g. a CUDA graph's static outputs), shaped as the result.
    Returns:
        ``Routing``; CUDA tensors (or CPU ones under TRITON_INTERPRET=1) take two Triton launches,
        other CPU tensors the PyTorch reference.
    """
    check_tensor("x", x)
    check_tensor("router_with_gate", router_with_gate)
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, H], got shape {tuple(x.shape)}")
    N, H = x.shape
    if router_with_gate.dim() != 2 or router_with_gate.shape[0] < 2 or router_with_gate.shape[1] != H:
        raise ValueError(f"router_with_gate: expected [E + 1, H = {H}] with E >= 1, "
                         f"got {tuple(router_with_gate.shape)}")
    E = router_with_gate.shape[0] - 1
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
        ref = route_pairs_ref(x, router_with_gate, top_k, num_shared, block_m)
        for name in ("weights", "experts", "sorted_pairs", "block_experts"):
            getattr(out, name).copy_(getattr(ref, name))
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if router_with_gate.stride(1) != 1:
        router_with_gate = router_with_gate.contiguous()
    route_kernel(x, router_with_gate, top_k, num_shared, out.weights, out.experts, out.sorted_pairs,
                 out.block_experts, block_m)
    if not routes_and_sorts_in_one_launch(N):
        sort_kernel(out.experts, E_total, block_m, out.sorted_pairs, out.block_experts)
    return out
