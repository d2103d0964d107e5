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
    KEYS as _N_KEYS, MIX_MUL_1, MIX_MUL_2, STREAM_INIT_A, STREAM_INIT_B, TWO_POW_MINUS_32, UNIFORM_MAX, UNIFORM_MIN,
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
        tl.store(ids_ptr + row, tl.minimum(split_first, n_vocab - 1).to(tl.int64))  # in range, as below
    else:
        tl.store(split_value_ptr + row * n_splits + split, split_best)
        tl.store(split_index_ptr + row * n_splits + split, split_first)


@triton.jit
def _reduce_splits_kernel(split_value_ptr, split_index_ptr, ids_ptr, n_vocab, n_splits, BLOCK_SPLITS: tl.constexpr):
    """Program per row: the first index of the largest of its n_splits (value, index) pairs. The
    id stays in [0, n_vocab) whatever the values hold: were the max a NaN (no split's value equal
    to it), the sentinel would be taken, so it is clamped to the last token."""
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = splits < n_splits
    value = tl.load(split_value_ptr + row * n_splits + splits, mask=mask, other=float("-inf"))
    index = tl.load(split_index_ptr + row * n_splits + splits, mask=mask, other=n_vocab)
    best = tl.max(value, axis=0)
    first = tl.min(tl.where(value == best, index, n_vocab), axis=0)
    tl.store(ids_ptr + row, tl.minimum(first, n_vocab - 1).to(tl.int64))


@triton.jit
def advance_slots_kernel(ids_ptr, slots_ptr, active_ptr, positions_ptr, remaining_ptr, stop_ids_ptr, next_ptr,
                         counts_ptr, n, n_vocab, STOPS: tl.constexpr, BLOCK_STOPS: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_NEXT: tl.constexpr,
                         HAS_COUNTS: tl.constexpr):
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
    if HAS_COUNTS:  # the slot's generated-token count of the drawn id (apply_penalties' counts)
        counted_id = in_range & was_active & (ids >= 0) & (ids < n_vocab)
        count_ptrs = counts_ptr + slots * n_vocab + ids
        tl.store(count_ptrs, tl.load(count_ptrs, mask=counted_id, other=0) + 1, mask=counted_id)


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
        _reduce_splits_kernel[(n_rows,)](split_value, split_index, ids, n_vocab, geo.n_splits,
                                         BLOCK_SPLITS=next_power_of_2(geo.n_splits))
    return ids


# ----------------------------------------------------------------------------- cut-offs of 16-bit logits
# A 16-bit logit (bf16 / fp16) takes one of 2^16 values; its bits map to an order-preserving key
# (``naive.order_keys``), and all tokens of a key share one logit, hence one weight. So the count
# of tokens per key is all top-k and top-p need: the k-th largest key from the counts, each key's
# mass as count x weight. Three launches past a zero-fill:
#   1. ``_count_keys_kernel`` (row, split): the counts, by atomic adds; R replicas of a row's
#      counts (split s adds to replica s mod R) spread the adds to the popular keys over R
#      addresses;
#   2. ``_key_block_sums_kernel`` (row, key block): each block of KEY_BLOCK keys' token count and
#      float64 mass;
#   3. ``_cutoffs_of_key_blocks_kernel`` (row): the k-th largest key and the top-p cut from the
#      block sums, each found within its block by one pass over that block's keys.
KEYS: tl.constexpr = tl.constexpr(_N_KEYS)  # naive.KEYS, as a constexpr the kernels may read
# Keys whose weight exp((x - max) / T) is below 2^-60 add nothing to a top-p mass: the whole row's
# such tokens weigh < V x 2^-60 < 2^-40 of the total (total >= 1, the max's own weight), far below
# the 2^-24 by which a float32 p < 1 stays under 1, so no such key is ever kept by top-p.
_NEGLIGIBLE_WEIGHT: tl.constexpr = tl.constexpr(2.0 ** -60)


@triton.jit
def _key_of_bits(bits):
    """int32 bits in [0, 2^16) of a 16-bit float -> its key (``naive.order_keys``; -0 as +0)."""
    bits = tl.where(bits == 0x8000, 0, bits)
    return tl.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)


@triton.jit
def _logit_of_key(key, IS_BF16: tl.constexpr):
    """The fp32 logit of int32 ``key`` (the inverse of ``_key_of_bits``)."""
    bits = tl.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)
    if IS_BF16:  # a bf16 is the top half of the fp32 with the same value
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.where(bits >= 0x8000, bits - 0x10000, bits).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _row_top_and_scale(largest_ptr, temperature_ptr, b, IS_BF16: tl.constexpr):
    """(max key, max logit in float64, 1 / T in float64; T = 1 for greedy rows) of row b."""
    max_key = tl.load(largest_ptr + b) - 1
    temperature = tl.load(temperature_ptr + b)
    t = tl.where(temperature > 0, temperature, 1.0).to(tl.float64)
    return max_key, _logit_of_key(max_key, IS_BF16).to(tl.float64), 1.0 / t


@triton.jit
def _key_counts(counts_ptr, key, R: tl.constexpr):
    """Token counts (int64) of ``key``s in [0, KEYS), summed over the R replicas at ``counts_ptr``
    (the row's replica 0)."""
    count = tl.zeros(key.shape, dtype=tl.int64)
    for r in tl.static_range(R):
        count += tl.load(counts_ptr + r * KEYS + key).to(tl.int64)
    return count


@triton.jit
def _key_masses(count, key, max_key, top, inverse_t, IS_BF16: tl.constexpr):
    """float64 masses count x exp((x - top) / T) of ``key``s (keys above ``max_key`` hold no token:
    their weight is taken at the max, not overflowed)."""
    weight = tl.exp((_logit_of_key(tl.minimum(key, max_key), IS_BF16).to(tl.float64) - top) * inverse_t)
    return tl.where(count > 0, count.to(tl.float64) * weight, 0.0)


@triton.jit
def _count_keys_kernel(bits_ptr, counts_ptr, largest_ptr, V, stride_row, split_len,
                       R: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, s): adds the keys of tokens [s * split_len, (s + 1) * split_len) of row b to its
    replica s mod R of counts [B, R, KEYS] (zeroed), and max(key) + 1 to largest[b] (atomic max)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    start = s * split_len
    row_counts = counts_ptr + (b * R + s % R) * KEYS
    largest = tl.full([BLOCK], -1, dtype=tl.int32)
    for v0 in range(start, tl.minimum(start + split_len, V), BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        ok = v < V
        bits = tl.load(bits_ptr + b * stride_row + v, mask=ok, other=0).to(tl.int32) & 0xFFFF
        key = _key_of_bits(bits)
        tl.atomic_add(row_counts + key, tl.full([BLOCK], 1, dtype=tl.int32), mask=ok, sem="relaxed")
        largest = tl.maximum(largest, tl.where(ok, key, -1))
    tl.atomic_max(largest_ptr + b, tl.max(largest, axis=0) + 1, sem="relaxed")


@triton.jit
def _key_block_sums_kernel(counts_ptr, largest_ptr, temperature_ptr, block_count_ptr, block_mass_ptr,
                           R: tl.constexpr, IS_BF16: tl.constexpr, KEY_BLOCK: tl.constexpr):
    """Program (b, j): the token count and the float64 mass of keys [j * KEY_BLOCK, (j + 1) *
    KEY_BLOCK) of row b, into block_count / block_mass [B, KEYS / KEY_BLOCK]. A block whose
    weights are all negligible (or above the max) gets mass 0 without computing them."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n_blocks = tl.num_programs(1)
    max_key, top, inverse_t = _row_top_and_scale(largest_ptr, temperature_ptr, b, IS_BF16)
    key = j * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
    row_counts = counts_ptr + b * R * KEYS
    block_top = tl.minimum(j * KEY_BLOCK + KEY_BLOCK - 1, max_key)
    top_weight = tl.exp((_logit_of_key(block_top, IS_BF16).to(tl.float64) - top) * inverse_t)
    count = _key_counts(row_counts, key, R)
    block_mass = tl.zeros([1], dtype=tl.float64).sum(axis=0)
    if (top_weight >= _NEGLIGIBLE_WEIGHT) & (j * KEY_BLOCK <= max_key):
        block_mass = tl.sum(_key_masses(count, key, max_key, top, inverse_t, IS_BF16), axis=0)
    n_tokens = tl.sum(count, axis=0)
    tl.store(block_count_ptr + b * n_blocks + j, n_tokens)
    tl.store(block_mass_ptr + b * n_blocks + j, block_mass)


@triton.jit
def _cutoffs_of_key_blocks_kernel(counts_ptr, largest_ptr, block_count_ptr, block_mass_ptr, temperature_ptr,
                                  top_k_ptr, top_p_ptr, min_p_ptr, out_ptr, V, R: tl.constexpr, IS_BF16: tl.constexpr,
                                  KEY_BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr, MIN_P: tl.constexpr):
    """One program per row b: ``naive.keep_thresholds``'s cut-off from the block sums, refined to a
    key by a pass over one block's keys (two at most: the k-th largest's, the top-p cut's). Blocks
    and keys are taken largest first (position d <-> block N_BLOCKS - 1 - d). MIN_P: min-p's cut
    too (``min_p_ptr``), the larger of the two."""
    b = tl.program_id(0).to(tl.int64)
    max_key, top, inverse_t = _row_top_and_scale(largest_ptr, temperature_ptr, b, IS_BF16)
    row_counts = counts_ptr + b * R * KEYS
    k = tl.load(top_k_ptr + b).to(tl.int64)
    k_on = (k > 0) & (k < V)
    p = tl.load(top_p_ptr + b)
    p_on = p < 1
    d = tl.arange(0, N_BLOCKS)
    n_tokens = tl.load(block_count_ptr + b * N_BLOCKS + (N_BLOCKS - 1 - d))  # [N_BLOCKS] largest first
    mass = tl.load(block_mass_ptr + b * N_BLOCKS + (N_BLOCKS - 1 - d))
    lane = tl.arange(0, KEY_BLOCK)

    # 1. top-k: the k-th largest key is the largest key with count(>= key) >= k, in the first block
    #    (largest first) where the running count reaches k; top-k off: key 0, every token.
    kth_key = max_key * 0  # 0, as an int32 tensor like the value it may take below
    d_k = N_BLOCKS - 1
    if k_on:
        d_k = tl.sum((tl.cumsum(n_tokens, axis=0) < k).to(tl.int32), axis=0)
        tokens_above = tl.sum(tl.where(d < d_k, n_tokens, 0), axis=0)
        key = (N_BLOCKS - 1 - d_k) * KEY_BLOCK + (KEY_BLOCK - 1 - lane)  # descending
        count = _key_counts(row_counts, key, R)
        key_mass = _key_masses(count, key, max_key, top, inverse_t, IS_BF16)
        short = tl.sum((tokens_above + tl.cumsum(count, axis=0) < k).to(tl.int32), axis=0)
        kth_key = (N_BLOCKS - 1 - d_k) * KEY_BLOCK + (KEY_BLOCK - 1 - short)
        # block d_k's mass counts only its keys >= the k-th; blocks past it none
        mass = tl.where(d == d_k, tl.sum(tl.where(key >= kth_key, key_mass, 0.0), axis=0), mass)
    mass = tl.where(d <= d_k, mass, 0.0)
    has_tokens = (n_tokens > 0) & (d <= d_k)
    total = tl.sum(mass, axis=0)

    # 2. top-p: keep the keys whose mass strictly above is < p x total (a prefix, largest first);
    #    the cut is the smallest kept key holding tokens, in the last block whose mass above is
    #    < p x total. Top-p off: the k-th key.
    cut_key = kth_key
    if p_on:
        limit = p.to(tl.float64) * total
        above = tl.cumsum(mass, axis=0) - mass
        d_c = tl.max(tl.where(has_tokens & (above < limit), d, -1), axis=0)
        cut_key = max_key  # the most likely token is always kept (also for p <= 0)
        if d_c >= 0:
            key = (N_BLOCKS - 1 - d_c) * KEY_BLOCK + (KEY_BLOCK - 1 - lane)
            count = _key_counts(row_counts, key, R)
            key_mass = _key_masses(count, key, max_key, top, inverse_t, IS_BF16)
            holds = (count > 0) & (key >= kth_key)
            key_mass = tl.where(holds, key_mass, 0.0)
            block_above = tl.sum(tl.where(d < d_c, mass, 0.0), axis=0)
            strictly_above = block_above + tl.cumsum(key_mass, axis=0) - key_mass
            cut_key = tl.min(tl.where(holds & (strictly_above < limit), key, max_key), axis=0)
    cutoff = _logit_of_key(cut_key, IS_BF16)
    cutoff = tl.where(k_on, cutoff, tl.where(p_on, cutoff, float("-inf")))
    if MIN_P:
        cutoff = tl.maximum(cutoff, _min_p_cutoff(top, temperature_ptr, min_p_ptr, b))
    tl.store(out_ptr + b, cutoff)


@triton.jit
def _min_p_cutoff(top, temperature_ptr, min_p_ptr, b):
    """min-p's cut-off of row b (``naive.keep_thresholds``): fp32(top + T log(min_p)) in float64
    (T = 1 for greedy rows), -inf where min_p <= 0. ``top``: the row's largest logit, float64."""
    min_p = tl.load(min_p_ptr + b).to(tl.float64)
    temperature = tl.load(temperature_ptr + b)
    t = tl.where(temperature > 0, temperature, 1.0).to(tl.float64)
    cut = (top + t * tl.log(tl.where(min_p > 0, min_p, 1.0))).to(tl.float32)
    return tl.where(min_p > 0, cut, float("-inf"))


COUNT_BLOCK = 2048  # tokens a step of the counting program reads (programs: as the sampler's split_geometry)
KEY_BLOCK = 1024  # keys a block sum covers
MAX_COUNT_REPLICAS = 8


def count_replicas(n_rows: int) -> int:
    """Replicas of a row's counts: the fewer the rows, the more programs add to each one's popular
    keys. H200, bf16 [B, 248320] (benchmarks/NOTES.md 98): counting took 30 -> 15 µs at B = 1 with
    8 replicas, 79 -> 54 at B = 8 with 4; at B = 32 a second replica gained nothing."""
    return max(1, min(MAX_COUNT_REPLICAS, 32 // max(n_rows, 1)))


def cutoffs_of_16_bit_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, min_p: torch.Tensor | None = None,
                             replicas: int | None = None) -> torch.Tensor:
    """``naive.keep_thresholds(logits, temperature, top_k, top_p, min_p)`` [B] fp32 for bf16 / fp16
    ``logits`` [B, V] (last dim contiguous) in three launches and a zero-fill, no sort (the block
    comment above). The per-row parameters contiguous [B] as ``sample_tokens`` takes them."""
    n_rows, n_vocab = logits.shape
    out = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return out
    keys, n_blocks = KEYS.value, KEYS.value // KEY_BLOCK
    replicas = replicas or count_replicas(n_rows)
    zeroed = torch.zeros(n_rows * (replicas * keys + 1), dtype=torch.int32, device=logits.device)
    counts, largest = zeroed[:n_rows * replicas * keys], zeroed[n_rows * replicas * keys:]
    block_count = torch.empty(n_rows, n_blocks, dtype=torch.int32, device=logits.device)
    block_mass = torch.empty(n_rows, n_blocks, dtype=torch.float64, device=logits.device)
    geo = split_geometry(n_rows, n_vocab, COUNT_BLOCK, PROGRAMS_PER_SM * num_sms(logits.device))
    bits = logits.view(torch.int16)
    is_bf16 = logits.dtype == torch.bfloat16
    _count_keys_kernel[(n_rows, geo.n_splits)](bits, counts, largest, n_vocab, bits.stride(0), geo.split_size,
                                               R=replicas, BLOCK=COUNT_BLOCK, num_warps=4)
    _key_block_sums_kernel[(n_rows, n_blocks)](counts, largest, temperature, block_count, block_mass, R=replicas,
                                               IS_BF16=is_bf16, KEY_BLOCK=KEY_BLOCK, num_warps=4)
    _cutoffs_of_key_blocks_kernel[(n_rows,)](counts, largest, block_count, block_mass, temperature, top_k, top_p,
                                             top_p if min_p is None else min_p, out, n_vocab, R=replicas,
                                             IS_BF16=is_bf16, KEY_BLOCK=KEY_BLOCK, N_BLOCKS=n_blocks,
                                             MIN_P=min_p is not None, num_warps=4)
    return out
