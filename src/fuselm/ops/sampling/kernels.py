"""Triton kernels and host launcher for ``sample_tokens``: a noisy argmax per row.

For row b with temperature T, cut-off c (from ``cutoffs``; no cut-off when unfiltered)
and stream keys from (seed, position), every token i gets the value

    greedy (T = 0):  x_i                           x_i = the logit in fp32 (exact)
    sampled (T > 0): x_i + T * g_i  if x_i >= c,   g_i the Gumbel noise of ``naive.py``
                     else -inf

and the row's id is the first index of the largest value. (x_i + T g_i = T (x_i / T + g_i): the
same argmax as the definition's logit / T + g, one fused multiply-add per token instead of a
division.) Arithmetic in fp32, the RNG in uint32; the reference does the same in float64, so ids
agree unless the two largest values of a row are within fp32 rounding of each other.

Launch geometry: a 2-D grid (row, vocab split). Program (b, s) loops over its split of the
vocabulary in blocks of BLOCK tokens, reading each logit once, and keeps a running (value, index)
per lane; a lane replaces its entry only when a value is strictly larger, so it holds the first
index of its maximum. It then reduces its lanes to the split's (max, first index of the max).
With one split per row that is the id; otherwise ``_reduce_splits_kernel`` (one program per row)
takes the max over the splits and, among equal maxima, the smallest index. Max with first-index
tie-break is associative, so the ids do not depend on the geometry.

Splits exist for small batches: a whole 248K-token row in one program leaves all but B SMs idle,
and the sampled path is bound by the per-token arithmetic (hash, two logs), not by the bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselm.ops.sampling.naive import (
    MIX_MUL_1, MIX_MUL_2, STREAM_INIT_A, STREAM_INIT_B, TWO_POW_MINUS_32, UNIFORM_MAX, UNIFORM_MIN,
)
from fuselm.runtime import cdiv, next_power_of_2, num_sms

# The RNG's constants (defined in naive.py), as constexprs the kernels may read.
_MIX_MUL_1: tl.constexpr = tl.constexpr(MIX_MUL_1)
_MIX_MUL_2: tl.constexpr = tl.constexpr(MIX_MUL_2)
_STREAM_INIT_A: tl.constexpr = tl.constexpr(STREAM_INIT_A)
_STREAM_INIT_B: tl.constexpr = tl.constexpr(STREAM_INIT_B)
_TWO_POW_MINUS_32: tl.constexpr = tl.constexpr(TWO_POW_MINUS_32)
_UNIFORM_MIN: tl.constexpr = tl.constexpr(UNIFORM_MIN)
_UNIFORM_MAX: tl.constexpr = tl.constexpr(UNIFORM_MAX)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * _MIX_MUL_1
    x = x ^ (x >> 15)
    x = x * _MIX_MUL_2
    return x ^ (x >> 16)


@triton.jit
def _stream_key(init, seed, position):
    """One 32-bit key lane: ``init`` absorbs the low then high words of seed, then of position."""
    state = _mix32(seed.to(tl.uint32) ^ init)
    state = _mix32(state ^ (seed >> 32).to(tl.uint32))
    state = _mix32(state ^ position.to(tl.uint32))
    return _mix32(state ^ (position >> 32).to(tl.uint32))


@triton.jit
def _gumbel_noise(cols, key_a, key_b):
    """g = -log(E), E = -log1p(-v), v the fp32 uniform of token ``cols`` (int32, >= 0)."""
    bits = _mix32(_mix32(cols.to(tl.uint32) ^ key_a) ^ key_b)
    v = tl.minimum(tl.maximum(bits.to(tl.float32) * _TWO_POW_MINUS_32, _UNIFORM_MIN), _UNIFORM_MAX)
    # E = -log(1 - v) to fp32 relative accuracy without a log1p primitive. y = fl(1 - v) is off by
    # d = v - (1 - y), computed exactly (1 - y and the difference are exact: Sterbenz), |d| <= 2^-25;
    # -log(1 - v) = -log(y - d) = -log(y) + d / y + O(d^2), and d / y = d (1 + O(v)). So
    # E = d - log(y), relative error ~2^-25 beside log's: small E (v near 0, the race's likely
    # winners) keeps the precision of v, where -log(y) alone would keep only 2^-24 absolute.
    y = 1.0 - v
    exponential = (v - (1.0 - y)) - tl.log(y)
    return -tl.log(exponential)


@triton.jit
def _keep_larger(best_value, best_index, value, cols):
    """Lane-wise running max; a lane keeps its earlier (smaller) index unless strictly beaten."""
    larger = value > best_value
    return tl.where(larger, value, best_value), tl.where(larger, cols, best_index)


@triton.jit
def _sample_splits_kernel(
    logits_ptr, temperature_ptr, threshold_ptr, seed_ptr, position_ptr,
    split_value_ptr, split_index_ptr, ids_ptr,
    n_vocab, stride_row, split_size, n_splits,
    FILTERED: tl.constexpr, WRITE_IDS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, split): the largest value of tokens [split * split_size, + split_size) and
    its first index, into split_value / split_index [B, n_splits]; or, when WRITE_IDS (one split
    per row), the index into ids [B] as int64."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * split_size
    end = tl.minimum(start + split_size, n_vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    best_value = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = start + lanes
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:
        seed = tl.load(seed_ptr + row)
        position = tl.load(position_ptr + row)
        key_a = _stream_key(_STREAM_INIT_A, seed, position)
        key_b = _stream_key(_STREAM_INIT_B, seed, position)
        if FILTERED:
            threshold = tl.load(threshold_ptr + row)
        for block_start in range(start, end, BLOCK):
            cols = block_start + lanes
            x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            value = x + temperature * _gumbel_noise(cols, key_a, key_b)
            if FILTERED:
                value = tl.where(x >= threshold, value, float("-inf"))
            best_value, best_index = _keep_larger(best_value, best_index, value, cols)
    else:
        for block_start in range(start, end, BLOCK):
            cols = block_start + lanes
            x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            best_value, best_index = _keep_larger(best_value, best_index, x, cols)
    split_best = tl.max(best_value, axis=0)
    # First index among the lanes holding the max. (All -inf: every lane ties, the first index wins.)
    split_first = tl.min(tl.where(best_value == split_best, best_index, n_vocab), axis=0)
    if WRITE_IDS:
        tl.store(ids_ptr + row, split_first.to(tl.int64))
    else:
        tl.store(split_value_ptr + row * n_splits + split, split_best)
        tl.store(split_index_ptr + row * n_splits + split, split_first)


@triton.jit
def _reduce_splits_kernel(split_value_ptr, split_index_ptr, ids_ptr, n_splits, BLOCK_SPLITS: tl.constexpr):
    """Program per row: the first index of the largest of its n_splits (value, index) pairs."""
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = splits < n_splits
    value = tl.load(split_value_ptr + row * n_splits + splits, mask=mask, other=float("-inf"))
    index = tl.load(split_index_ptr + row * n_splits + splits, mask=mask, other=2147483647)
    best = tl.max(value, axis=0)
    tl.store(ids_ptr + row, tl.min(tl.where(value == best, index, 2147483647), axis=0).to(tl.int64))


@triton.jit
def advance_slots_kernel(ids_ptr, slots_ptr, active_ptr, positions_ptr, remaining_ptr, stop_ids_ptr, next_ptr, n,
                         STOPS: tl.constexpr, BLOCK_STOPS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         HAS_SLOTS: tl.constexpr, HAS_NEXT: tl.constexpr):
    """``advance_slots``: BLOCK_ROWS rows a program, each row's slot read and written by that
    program alone (the slots are distinct)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = rows < n
    slots = rows
    if HAS_SLOTS:
        slots = tl.load(slots_ptr + rows, mask=in_range, other=0)
    slots = slots.to(tl.int64)
    ids = tl.load(ids_ptr + rows, mask=in_range, other=0)
    was_active = tl.load(active_ptr + slots, mask=in_range, other=0) != 0
    counted = was_active.to(tl.int64)
    left = tl.load(remaining_ptr + slots, mask=in_range, other=0) - counted
    stops = tl.arange(0, BLOCK_STOPS)
    stop_ids = tl.load(stop_ids_ptr + slots[:, None] * STOPS + stops[None, :],
                       mask=in_range[:, None] & (stops < STOPS)[None, :], other=-1)
    stopped = (tl.max((stop_ids == ids[:, None]).to(tl.int32), axis=1) > 0) | (left <= 0)
    tl.store(positions_ptr + slots, tl.load(positions_ptr + slots, mask=in_range, other=0) + counted, mask=in_range)
    tl.store(remaining_ptr + slots, left, mask=in_range)
    tl.store(active_ptr + slots, (was_active & ~stopped).to(active_ptr.dtype.element_ty), mask=in_range)
    if HAS_NEXT:
        tl.store(next_ptr + slots, ids, mask=in_range)


# ----------------------------------------------------------------------------- launch geometry
@dataclass(frozen=True)
class SamplingGeometry:
    """block: tokens per loop step of a program; split_size: tokens per program (a multiple of
    block); n_splits: programs per row (cdiv(V, split_size)); num_warps: per program."""

    block: int
    split_size: int
    n_splits: int
    num_warps: int


# GPU: blocks of 2048 tokens on 16 warps (4 tokens a thread), and enough splits that the grid has
# about PROGRAMS_PER_SM programs per SM. H100 sweep (benchmarks/sampling.py --sweep; sampled rows,
# bf16 logits [B, 248320]; blocks 1024-4096 x 8/16 warps x 2-8 programs per SM): this choice is
# the best or within 3% of it at B = 1, 8 and 32 (9.4 / 15.4 / 33.2 µs). The sampled path is
# bound by the per-token arithmetic: at B = 32 the logits stream at ~0.5 TB/s.
# The interpreter (CPU tests) costs per program and per block step, not per token: blocks of
# 1024 and 16 programs (num_sms is 4 there), so the tests' vocabularies still get several splits.
GPU_BLOCK = 2048
GPU_NUM_WARPS = 16
PROGRAMS_PER_SM = 4
INTERPRET_BLOCK = 1024
INTERPRET_MAX_STEPS = 64  # blocks per row at most under the interpreter (248k vocab: 4096-token blocks)


def split_geometry(n_rows: int, n_vocab: int, block: int, target_programs: int, num_warps: int = 4) -> SamplingGeometry:
    """About ``target_programs`` programs over the grid: cdiv(target, rows) splits per row (at
    least 1, at most one block each), split sizes rounded up to whole blocks."""
    n_splits = max(1, min(cdiv(target_programs, max(n_rows, 1)), cdiv(n_vocab, block)))
    split_size = cdiv(cdiv(n_vocab, n_splits), block) * block
    return SamplingGeometry(block, split_size, cdiv(n_vocab, split_size), num_warps)


@functools.lru_cache(maxsize=256)
def choose_geometry(n_rows: int, n_vocab: int, device: torch.device) -> SamplingGeometry:
    """The geometry of ``sample_tokens`` for a [n_rows, n_vocab] batch on ``device``."""
    if device.type != "cuda":  # large vocabularies: larger blocks, fewer interpreted loop steps
        block = max(INTERPRET_BLOCK, next_power_of_2(cdiv(n_vocab, INTERPRET_MAX_STEPS)))
        return split_geometry(n_rows, n_vocab, block, PROGRAMS_PER_SM * num_sms(device))
    block = min(GPU_BLOCK, next_power_of_2(n_vocab))
    return split_geometry(n_rows, n_vocab, block, PROGRAMS_PER_SM * num_sms(device), GPU_NUM_WARPS)


# ----------------------------------------------------------------------------- host launcher
def sample_tokens_kernel(logits: torch.Tensor, temperature: torch.Tensor, thresholds: torch.Tensor | None,
                         seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
                         geometry: SamplingGeometry | None = None) -> torch.Tensor:
    """Write ids [B] (int64) for logits [B, V] (unit column stride, any row stride) with per-row
    temperature [B] fp32, cut-offs [B] fp32 (None: no filtering), seeds and positions [B] int64.
    No checks (``op.py`` does them), no host sync; one launch, or two with several splits (the
    second over a [B, n_splits] scratch allocated here)."""
    n_rows, n_vocab = logits.shape
    geo = geometry or choose_geometry(n_rows, n_vocab, logits.device)
    write_ids = geo.n_splits == 1
    if write_ids:
        split_value = split_index = ids  # not read
    else:
        split_value = torch.empty((n_rows, geo.n_splits), dtype=torch.float32, device=logits.device)
        split_index = torch.empty((n_rows, geo.n_splits), dtype=torch.int32, device=logits.device)
    _sample_splits_kernel[(n_rows, geo.n_splits)](
        logits, temperature, thresholds if thresholds is not None else temperature, seeds, positions,
        split_value, split_index, ids,
        n_vocab, logits.stride(0), geo.split_size, geo.n_splits,
        FILTERED=thresholds is not None, WRITE_IDS=write_ids, BLOCK=geo.block, num_warps=geo.num_warps,
    )
    if not write_ids:
        _reduce_splits_kernel[(n_rows,)](split_value, split_index, ids, geo.n_splits,
                                         BLOCK_SPLITS=next_power_of_2(geo.n_splits))
    return ids


@triton.jit
def _cutoffs_of_candidates_kernel(ordered_ptr, logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, out_ptr,
                                  V, C, stride_ordered, stride_logits,
                                  BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, COUNT_TIES: tl.constexpr):
    """One program per row b: ``naive.cutoffs_of_ordered``'s cut-off from the row's C largest logits
    ``ordered`` (largest first), its arithmetic in float64 as the reference's; with COUNT_TIES (C < V)
    one pass over the row counts the tokens tied with the k-th largest that lie past the C. The sums
    run in another order (a tree, a scan) than the reference's, so a row whose p x total falls within
    float64 rounding of a prefix mass may be cut one candidate apart (the tests see equal values)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    ordered = tl.load(ordered_ptr + b * stride_ordered + c, mask=c_ok, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + b)
    t = tl.where(temperature > 0, temperature, 1.0).to(tl.float64)
    k = tl.load(top_k_ptr + b).to(tl.int64)
    k_on = (k > 0) & (k < V)
    k = tl.where(k_on, tl.minimum(k, C), C)
    kth = tl.max(tl.where(c == k - 1, ordered, float("-inf")), axis=0)
    top = tl.max(ordered, axis=0).to(tl.float64)  # ordered[0]
    in_top_k = c_ok & (ordered >= kth)
    weight = tl.where(in_top_k, tl.exp((ordered.to(tl.float64) - top) / t), 0.0)
    total = tl.sum(weight, axis=0)
    if COUNT_TIES:  # the tokens tied with the k-th largest past the C: same weight, same fate
        ties = tl.zeros([BLOCK_V], dtype=tl.int32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + b * stride_logits + v, mask=v < V, other=0.0).to(tl.float32)
            ties += ((x == kth) & (v < V)).to(tl.int32)
        ties_past = tl.sum(ties, axis=0) - tl.sum((c_ok & (ordered == kth)).to(tl.int32), axis=0)
        total += ties_past.to(tl.float64) * tl.exp((kth.to(tl.float64) - top) / t)
    mass_before = tl.cumsum(weight, axis=0) - weight
    p = tl.load(top_p_ptr + b)
    mass_limit = tl.where(p >= 1, float("inf"), p.to(tl.float64) * total)  # top-p off: every top-k token
    kept = in_top_k & (mass_before < mass_limit)
    n_kept = tl.maximum(tl.sum(kept.to(tl.int32), axis=0), 1)
    cutoff = tl.max(tl.where(c == n_kept - 1, ordered, float("-inf")), axis=0)  # the smallest kept logit
    # neither top-k nor top-p: no cut-off (where-chains: the interpreter has no | of scalars)
    tl.store(out_ptr + b, tl.where(k_on, cutoff, tl.where(p < 1, cutoff, float("-inf"))))


CUTOFF_BLOCK_V = 4096  # logits a step of the ties pass reads


def cutoffs_of_candidates_kernel(ordered: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
                                 top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``naive.cutoffs_of_ordered(ordered, logits, temperature, top_k, top_p)`` [B] fp32 in one
    launch (the reference's ~20 small PyTorch kernels took 100-190 µs at B = 1-32 on an H200):
    ``ordered`` [B, C] each row's C largest logits, largest first, C <= 1024; the per-row
    parameters contiguous [B] as ``sample_tokens`` takes them."""
    n_rows, n_candidates = ordered.shape
    n_vocab = logits.shape[-1]
    out = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _cutoffs_of_candidates_kernel[(n_rows,)](
            ordered, logits, temperature, top_k, top_p, out, n_vocab, n_candidates, ordered.stride(0),
            logits.stride(0), BLOCK_C=max(16, next_power_of_2(n_candidates)), BLOCK_V=CUTOFF_BLOCK_V,
            COUNT_TIES=n_candidates < n_vocab, num_warps=4)
    return out
