"""Grouped expert GEMMs of the Qwen3.5-MoE sparse block (issue 19): the gate/up GEMM with SwiGLU
in its epilogue, the down GEMM, and the per-token combine with the routing weights, the GEMMs
reading the sorted, block-padded pair list that the routing kernel writes.

Pair list (the input contract). N tokens, S slots per token (the top-k routed experts, then the
shared expert's chunks: a shared expert is just more experts, E_total in all); pair p = n * S + j
is token n's slot j. ``sorted_pairs`` [P_max] int32 holds the pair ids grouped by expert,
ascending, each expert's group padded to a multiple of ``block_m`` with the sentinel N * S;
``block_experts`` [P_max // block_m] int32 is the expert of each block of ``block_m`` entries, -1
for an unused block. Its length P_max is ``routing.max_pairs`` (any multiple of block_m with a
matching ``block_experts`` works). The grids are fixed by P_max, so no launch depends on the routing's
values: no host sync, CUDA-graph safe. Unused blocks return at once.

Shapes: x [N, H]; w13 [E_total, 2F, H], each expert's gate and up rows interleaved (row 2f =
gate f, row 2f + 1 = up f: ``interleave_gate_up`` per expert); w2 [E_total, H, F];
weights [N, S] fp32; h [P_max, F] in list order (row i is entry i of ``sorted_pairs``) and y
[N * S, H] in pair order (row p is pair p's), both in x's dtype; out [N, H].

- ``expert_gate_up``: a program owns one block of ``block_m`` pairs (all of one expert e) and
  BLOCK_N features of h: the block's rows of x are gathered through the pair list (x[p // S], no
  permuted copy of x; sentinel rows read row 0 and are never stored) and multiplied by 2 BLOCK_N
  interleaved rows of w13[e] in one fp32 [block_m, 2 BLOCK_N] dot per K step. Epilogue as the
  dense ``_gemm_swiglu_kernel``: G and U rounded to x's dtype, the gate factor rounded, the
  product rounded once. Row i of h is entry i's: a block's rows are contiguous, so the down GEMM
  reads them as one tile (through a TMA box on Hopper). Rows of sentinel entries and of unused
  blocks are not written.
- ``expert_down``: per block, its contiguous rows of h times w2[e]^T in fp32, the product rounded
  to h's dtype (as HF's down_proj linear rounds it) and stored at row p of y for the entry's pair p.
- ``combine``: out[n] = sum_j weights[n, j] y[n * S + j] as fp32 fused multiply-adds, j = 0..S-1
  in order (deterministic, no atomics), rounded once to the output dtype. The weight is applied
  here, to the already rounded product, so y travels in the model dtype: half the bytes of an fp32
  y weighted in the down GEMM's epilogue (the combine 299 -> 154 us at 16384 tokens on the H200,
  the block 3.27 -> 3.08 ms).

Numerics: the contract of ``naive.swiglu_moe_ref`` (products rounded to the model dtype, weighted
expert outputs summed in fp32, one rounding), with the shared expert's gated output entering as
S - top_k more slots whose weight is the fp32 sigmoid gate. Only the summation order differs
from the reference (fp32 sums over K; the slots summed in slot order).

Two builds of each GEMM. The pointer kernels (``_expert_gate_up_kernel``, ``_expert_down_kernel``)
run a program per (block, feature tile). On Hopper, from 64-row blocks, with 16-bit operands, the
persistent TMA kernels (``_expert_gate_up_tma_kernel``, ``_expert_down_tma_kernel``) run instead:
min(tiles, SMs) programs walk the used blocks' tiles (counted in the kernel: the used blocks are a
prefix of the list), in groups of ``group`` blocks that walk the feature tiles together (an
expert's weight tile is fetched once for its blocks), the tile loop flattened into the K loop (the
next tile's loads under this tile's epilogue), the weight tile through a TMA descriptor over the
experts' rows ([E_total R, K]). The down GEMM's h tile comes through a descriptor too; gate/up's
rows of x are gathered by pointer (Hopper's TMA cannot gather rows). Same products, roundings and
stores. H100, 35B-A3B layer (NOTES.md 74): the block at 16384 tokens 2.90 -> 2.30 ms; h in list
order through TMA: NOTES.md 99.

Launches: three per block (gate/up, down, combine), after the routing's.

Up to ``op.PAIR_PATH_TOKENS`` tokens (decode) the block takes ``decode.py`` instead: a
matrix-vector program per pair, the down GEMM and this combine in one launch, no pair list.

Not done yet: tiles between 64 and 4096 tokens measured for the pointer kernels (tuned at 1, 8,
64 and 4096), and between 256 and 4096 for the TMA ones (4096-16384).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fuselm.ops.common.activation import Activation, gate_factor, up_factor
from fuselm.ops.common.matmul import dot_acc, grouped_tile, load_k_step, tma_ok
from fuselm.ops.common.precision import work_dtype
from fuselm.ops.swiglu_mlp.naive import gemm_swiglu_ref
from fuselm.runtime import KERNEL_DTYPES, arch_major, cdiv, next_power_of_2, num_sms, parse_dtype, use_triton


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _block_rows(pairs_ptr, experts_ptr, NUM_PAIRS, SLOTS, BLOCK_M: tl.constexpr):
    """(expert, list rows, pair ids, valid, token rows) of this program's block of the pair list."""
    b = tl.program_id(0)
    e = tl.load(experts_ptr + b)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    valid = (pairs >= 0) & (pairs < NUM_PAIRS)
    pairs = tl.where(valid, pairs, 0)  # sentinel rows read row 0; their results are never stored
    return e, rows, pairs, valid, pairs // SLOTS


@triton.jit
def _expert_gate_up_kernel(
    x_ptr, w_ptr, pairs_ptr, experts_ptr, h_ptr,
    NUM_PAIRS, SLOTS, F, H, stride_xm, stride_we, stride_wn, stride_hm,
    limit, alpha,
    ACT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, rows, _, valid, tokens = _block_rows(pairs_ptr, experts_ptr, NUM_PAIRS, SLOTS, BLOCK_M)
    if e < 0:
        return
    pid_n = tl.program_id(1)
    wrows = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # interleaved gate/up rows of w13[e]
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm + k[None, :]  # the gather: rows x[p // S]
    w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + (wrows % (2 * F)).to(tl.int64)[None, :] * stride_wn
              + k[:, None])  # [BLOCK_K, 2 BLOCK_N] of w13[e].T; rows past 2F wrap, never stored
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        xt, w = load_k_step(x_ptrs, w_ptrs, k, H - k0, EVEN_K)
        acc = dot_acc(xt, w, acc, IEEE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_swiglu_rows(acc, h_ptr, rows, valid, pid_n, F, stride_hm, limit, alpha, ACT, BLOCK_M, BLOCK_N)


@triton.jit
def _store_swiglu_rows(acc, h_ptr, rows, valid, pid_n, F, stride_hm, limit, alpha, ACT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Both gate/up kernels' epilogue: the fp32 product ``acc`` [BLOCK_M, 2 BLOCK_N] (gate and up
    columns interleaved) -> h's ``rows`` (where ``valid``), features pid_n BLOCK_N + j. The
    dense kernel's roundings: G and U to h's dtype (x's), the gate factor, the product once."""
    dt = h_ptr.dtype.element_ty
    g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    a = gate_factor(g, ACT, limit, alpha).to(dt).to(tl.float32)
    hv = a * up_factor(u, ACT, limit)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], hv.to(dt),
             mask=valid[:, None] & (cols < F)[None, :])


@triton.jit
def _expert_down_kernel(
    h_ptr, w_ptr, pairs_ptr, experts_ptr, y_ptr,
    NUM_PAIRS, H, F, stride_hm, stride_we, stride_wn, stride_ym,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, rows, pairs, valid, _ = _block_rows(pairs_ptr, experts_ptr, NUM_PAIRS, 1, BLOCK_M)
    if e < 0:
        return
    pid_n = tl.program_id(1)
    wrows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features: rows of w2[e]
    k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + k[None, :]  # the block's rows of h
    w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + (wrows % H).to(tl.int64)[None, :] * stride_wn
              + k[:, None])  # [BLOCK_K, BLOCK_N] of w2[e].T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        ht, w = load_k_step(h_ptrs, w_ptrs, k, F - k0, EVEN_K)
        acc = dot_acc(ht, w, acc, IEEE)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The product rounded to h's dtype (HF's down_proj output); the combine weights it.
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = valid[:, None] & (cols < H)[None, :]
    tl.store(y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _used_blocks(experts_ptr, NUM_BLOCKS, CHUNK: tl.constexpr):
    """How many blocks of the pair list are in use: ``block_experts`` is -1 past them (a prefix)."""
    used = 0
    for b0 in range(0, NUM_BLOCKS, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        used += tl.sum((tl.load(experts_ptr + b, mask=b < NUM_BLOCKS, other=-1) >= 0).to(tl.int32))
    return used


@triton.jit
def _tile_rows(tile, num_blocks, num_n, pairs_ptr, experts_ptr, NUM_PAIRS, BLOCK_M: tl.constexpr,
               GROUP: tl.constexpr):
    """(expert, feature tile, block, pair ids, valid) of a persistent kernel's tile in the grouped order:
    GROUP consecutive blocks of the pair list walk the feature tiles together (an expert's blocks
    are consecutive, so the programs at work share its weight tiles in L2; GROUP 1: a block's
    feature tiles one after the other)."""
    b, pid_n = grouped_tile(tile, num_blocks, num_n, GROUP)
    e = tl.load(experts_ptr + b)
    pairs = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = (pairs >= 0) & (pairs < NUM_PAIRS)
    return e, pid_n, b, tl.where(valid, pairs, 0), valid


@triton.jit
def _expert_gate_up_tma_kernel(
    x_ptr, w_desc, pairs_ptr, experts_ptr, h_ptr,
    NUM_BLOCKS, NUM_PAIRS, SLOTS, F, H, stride_xm, stride_hm, limit, alpha,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr,
):
    # Persistent (Hopper): program p takes tiles p, p + PROGRAMS, ... of the used blocks; the tile
    # loop is flattened into the K loop, so the next tile's loads start under this tile's epilogue.
    # The weight tile comes through a TMA descriptor over w13 as [E_total 2F, H] (zero-filled past
    # H; rows past expert e's 2F belong to e + 1 or are zeros, never stored); x's rows are gathered
    # by pointer (a TMA box cannot gather rows on Hopper).
    num_n = tl.cdiv(F, BLOCK_N)
    used = _used_blocks(experts_ptr, NUM_BLOCKS, 1024)
    k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), used * num_n, PROGRAMS, flatten=True):
        e, pid_n, b, pairs, valid = _tile_rows(tile, used, num_n, pairs_ptr, experts_ptr, NUM_PAIRS, BLOCK_M, GROUP)
        x_ptrs = x_ptr + (pairs // SLOTS).to(tl.int64)[:, None] * stride_xm + k[None, :]
        w_row = e * (2 * F) + pid_n * (2 * BLOCK_N)
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs + k0)
            else:
                xt = tl.load(x_ptrs + k0, mask=(k < H - k0)[None, :], other=0.0)
            w = w_desc.load([w_row, k0])  # 2 BLOCK_N interleaved gate/up rows
            acc = tl.dot(xt, w.T, acc)
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        _store_swiglu_rows(acc, h_ptr, rows, valid, pid_n, F, stride_hm, limit, alpha, ACT, BLOCK_M, BLOCK_N)


@triton.jit
def _expert_down_tma_kernel(
    h_desc, w_desc, pairs_ptr, experts_ptr, y_ptr,
    NUM_BLOCKS, NUM_PAIRS, H, F, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr, PROGRAMS: tl.constexpr,
):
    # Persistent as _expert_gate_up_tma_kernel; both operands through descriptors (zero-filled
    # past F): the block's rows of h (list order: contiguous) and the weight tile of w2 as
    # [E_total H, F]. Sentinel rows of h are unwritten; a row of the product depends on its own row
    # of h alone, and theirs are never stored.
    num_n = tl.cdiv(H, BLOCK_N)
    used = _used_blocks(experts_ptr, NUM_BLOCKS, 1024)
    for tile in tl.range(tl.program_id(0), used * num_n, PROGRAMS, flatten=True):
        e, pid_n, b, pairs, valid = _tile_rows(tile, used, num_n, pairs_ptr, experts_ptr, NUM_PAIRS, BLOCK_M, GROUP)
        w_row = e * H + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            ht = h_desc.load([b * BLOCK_M, k0])  # [BLOCK_M, BLOCK_K]: the block's rows of h
            w = w_desc.load([w_row, k0])  # [BLOCK_N, BLOCK_K] rows of w2[e]
            acc = tl.dot(ht, w.T, acc)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cols < H)[None, :])


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, H, SLOTS, stride_ym, stride_om, BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_ptr = y_ptr + n * SLOTS * stride_ym + cols
    for j in range(0, SLOTS):  # slot order: deterministic; acc = fma(w, y, acc) in fp32, one rounding a slot
        acc = tl.fma(tl.load(weights_ptr + n * SLOTS + j), tl.load(row_ptr, mask=ok, other=0.0).to(tl.float32), acc)
        row_ptr += stride_ym
    tl.store(out_ptr + n * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- tile configs
@dataclass(frozen=True)
class GroupedGemmConfig:
    """Features per program (``block_n``; gate/up: h features, so 2 * block_n rows of w13), the K
    step, warps and pipeline stages. The token rows per program are the routing's ``block_m``.
    ``group`` (the persistent TMA kernels only): blocks of the pair list walking the feature tiles
    together."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 1


# Tuned on the H200 (benchmarks/moe.py --sweep, 35B-A3B layer, bf16): at block_m 16 (1 and 8
# tokens, session 17) gate/up 64 features, K step 128, 4 warps (20.4 / 74.2 us against 23.8 / 74.3
# at K step 64, 8 warps) and down 128 features (14.1 / 45.1 us); 4 stages (2 stages: +5-70%). The
# 64-row tiles serve past ~16 pairs an expert (``op.routing_block_m``: from ~450 tokens); at 4096
# tokens (session 18) 256 features: gate/up 0.488 ms against 0.523 at 128, down 0.355 against
# 0.462 (128-row tiles: 0.496 and 0.377). The 128-row tiles (past 384 pairs an expert): gate/up at
# 128 features (256 would need 245 KB of stages), down as at 64 rows. fp32 halves the K step and
# takes at most 128 features (shared memory).
GATE_UP_TILES = {16: GroupedGemmConfig(64, 128, 4, 4), 64: GroupedGemmConfig(256, 64, 8, 3),
                 128: GroupedGemmConfig(128, 64, 8, 3)}  # by block_m
DOWN_TILES = {16: GroupedGemmConfig(128, 64, 8, 4), 64: GroupedGemmConfig(256, 64, 8, 4),
              128: GroupedGemmConfig(256, 64, 8, 4)}

# The persistent TMA kernels (Hopper, 16-bit), from the H100 sweeps of session 29 (moe_sweep.md:
# 4096, 8192 and 16384 tokens on 64- and 128-row blocks, the pointer kernels' default tile beside
# them; NOTES.md 74). Gate/up: 128 features (a TMA box holds at most 256 weight rows), K step 64,
# 8 warps; on 64-row blocks 4 stages in groups of 16 blocks (0.538 / 0.773 / 1.365 ms, against the
# pointer kernel's 0.549 / 0.803 / 1.435), on 128-row blocks 3 stages in groups of 2 (1.267 ms at
# 16384). Down, h's rows through TMA (scratch A/B, H200, session 44; NOTES.md 99): 256 features, K
# step 64, 8 warps, groups of 16; on 64-row blocks 4 stages (0.233 / 0.390 ms at 4096 / 8192 tokens
# against 0.317 / 0.465 with h gathered by pointer), on 128-row blocks 3 stages (0.635 ms at 16384
# against 0.733).
TMA_GATE_UP_TILES = {64: GroupedGemmConfig(128, 64, 8, 4, 16), 128: GroupedGemmConfig(128, 64, 8, 3, 2)}
TMA_DOWN_TILES = {64: GroupedGemmConfig(256, 64, 8, 4, 16), 128: GroupedGemmConfig(256, 64, 8, 3, 16)}
TMA_MIN_BLOCK_M = {"gate_up": 64, "down": 64}  # the TMA kernels by default from these row tiles
TMA_INTERPRET_TILE = GroupedGemmConfig(16, 16, 4, 1, 2)  # the interpreter (tests): several tiles, a K tail, groups

COMBINE_BLOCK_H = 1024  # combine: hidden features per program (4 warps)


def _row_tile(tiles: dict, block_m: int) -> GroupedGemmConfig:
    """The entry of ``tiles`` (keyed by row tile) for the smallest key >= block_m, else the largest."""
    return tiles[min((m for m in tiles if m >= block_m), default=max(tiles))]


def grouped_gemm_config(kind: str, dtype: torch.dtype, block_m: int, tma: bool = False) -> GroupedGemmConfig:
    """The tile config of ``kind`` in {"gate_up", "down"} for ``dtype`` operands at ``block_m``
    rows (the 16-, 64- or 128-row tiles); ``tma``: the persistent TMA kernels'."""
    if tma:
        return _row_tile(TMA_GATE_UP_TILES if kind == "gate_up" else TMA_DOWN_TILES, block_m)
    tile = _row_tile(GATE_UP_TILES if kind == "gate_up" else DOWN_TILES, block_m)
    if dtype == torch.float32:
        return dataclasses.replace(tile, block_k=tile.block_k // 2, block_n=min(tile.block_n, 128))
    return tile


def grouped_tma_ok(kind: str, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the TMA kernel of ``kind`` can take operand ``a`` (x or h: 16-bit rows; h, read
    through a descriptor, TMA-addressable) and weights ``w`` [E_total, R, K]: contiguous, so that
    [E_total R, K] is a TMA-addressable view."""
    return (a.dtype in (torch.float16, torch.bfloat16) and w.is_contiguous() and tma_ok(w.view(-1, w.shape[-1]))
            and (kind == "gate_up" or tma_ok(a)))


def _tma_box_ok(kind: str, a: torch.Tensor, block_m: int, config: GroupedGemmConfig | None) -> bool:
    """Whether the weight tile of ``config`` (and the down GEMM's tile of h) fits a TMA box: at
    most 256 rows of at least 16 bytes."""
    if kind == "down" and block_m > 256:
        return False
    if config is None:
        return True
    rows = 2 * config.block_n if kind == "gate_up" else config.block_n
    return rows <= 256 and config.block_k * a.element_size() >= 16


def _check_tma(tma, kind: str, a: torch.Tensor, w: torch.Tensor, block_m: int,
               config: GroupedGemmConfig | None) -> None:
    if tma not in (None, True, False):
        raise ValueError(f"tma: expected None, True or False, got {tma!r}")
    if tma and not grouped_tma_ok(kind, a, w):
        raise ValueError("tma: the TMA kernels need 16-bit operands, contiguous weights and (down) a contiguous h, "
                         "with rows of 16-byte multiples")
    if tma and kind == "down" and block_m > 256:
        raise ValueError(f"block_m: {block_m} rows of h are more than a TMA box holds (256)")
    if tma and not _tma_box_ok(kind, a, block_m, config):
        raise ValueError(f"config: {config} gives a weight tile that a TMA box cannot hold (at most 256 rows of at "
                         "least 16 bytes)")


def _tma_config(kind: str, a: torch.Tensor, block_m: int, config: GroupedGemmConfig | None) -> GroupedGemmConfig:
    """The TMA kernel's tile: ``config`` (checked by ``_check_tma``), the interpreter's small tile,
    or Hopper's."""
    if config is not None:
        return config
    if arch_major(a.device) == 0:
        return TMA_INTERPRET_TILE
    return grouped_gemm_config(kind, a.dtype, block_m, tma=True)


def _use_tma(kind: str, a: torch.Tensor, w: torch.Tensor, block_m: int, tma: bool | None,
             config: GroupedGemmConfig | None) -> bool:
    """``tma`` None: the TMA kernel of ``kind`` on Hopper from TMA_MIN_BLOCK_M[kind] rows when it
    can address the operands and its tiles fit a box (else the pointer kernel, for
    which such a config was meant); True: it (checked by ``_check_tma``); False: the pointer kernel."""
    if tma is None:
        return (arch_major(a.device) == 9 and block_m >= TMA_MIN_BLOCK_M[kind] and grouped_tma_ok(kind, a, w)
                and _tma_box_ok(kind, a, block_m, config))
    return tma


# ----------------------------------------------------------------------------- checks
def _check_tensor(name, t, dims: int, dtypes=KERNEL_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not supported (use {allowed})")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: rows must be contiguous (last-dim stride 1)")


def _check_int(name, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _check_pair_list(sorted_pairs, block_experts, block_m, device) -> None:
    _check_int("block_m", block_m)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two >= 16 (the routing's block), got {block_m}")
    _check_tensor("sorted_pairs", sorted_pairs, 1, (torch.int32,))
    _check_tensor("block_experts", block_experts, 1, (torch.int32,))
    if sorted_pairs.numel() % block_m:
        raise ValueError(f"sorted_pairs: length {sorted_pairs.numel()} is not a multiple of block_m = {block_m}")
    if block_experts.numel() != sorted_pairs.numel() // block_m:
        raise ValueError(f"block_experts: expected {sorted_pairs.numel() // block_m} entries (one per block of "
                         f"sorted_pairs), got {block_experts.numel()}")
    for name, t in (("sorted_pairs", sorted_pairs), ("block_experts", block_experts)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device}")


def _check_out(name, out, shape, dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name}: expected {tuple(shape)} {dtype}, got {got}")
    if out.device != device or not out.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor on {device}")
    return out


def _check_gate_up(x, w13, sorted_pairs, block_experts, slots, activation, block_m) -> None:
    _check_tensor("x", x, 2)
    _check_tensor("w13", w13, 3)
    if w13.shape[1] % 2 or w13.shape[2] != x.shape[1]:
        raise ValueError(f"w13: expected [E_total, 2F, H = {x.shape[1]}] (gate/up rows interleaved), "
                         f"got {tuple(w13.shape)}")
    if w13.dtype != x.dtype:
        raise ValueError(f"w13: dtype {w13.dtype} does not match x {x.dtype}")
    if w13.device != x.device:
        raise ValueError(f"w13: on {w13.device}, x on {x.device}")
    _check_int("slots", slots)
    if not isinstance(activation, Activation):
        raise ValueError(f"activation: expected an Activation, got {activation!r}")
    _check_pair_list(sorted_pairs, block_experts, block_m, x.device)


def _check_down(h, w2, sorted_pairs, block_experts, block_m, num_pairs) -> None:
    _check_tensor("h", h, 2)
    _check_tensor("w2", w2, 3)
    if w2.shape[2] != h.shape[1]:
        raise ValueError(f"w2: expected [E_total, H, F = {h.shape[1]}], got {tuple(w2.shape)}")
    if w2.dtype != h.dtype:
        raise ValueError(f"w2: dtype {w2.dtype} does not match h {h.dtype}")
    if w2.device != h.device:
        raise ValueError(f"w2: on {w2.device}, h on {h.device}")
    _check_pair_list(sorted_pairs, block_experts, block_m, h.device)
    if h.shape[0] != sorted_pairs.numel():
        raise ValueError(f"h: expected one row per entry of sorted_pairs ({sorted_pairs.numel()}: list order, as "
                         f"expert_gate_up writes it), got shape {tuple(h.shape)}")
    if not isinstance(num_pairs, int) or isinstance(num_pairs, bool) or num_pairs < 0:
        raise ValueError(f"num_pairs: expected a non-negative int (N * S), got {num_pairs!r}")


def _check_combine(y, weights, out_dtype) -> torch.dtype:
    _check_tensor("y", y, 2)
    _check_tensor("weights", weights, 2, (torch.float32,))
    if not weights.is_contiguous():
        raise ValueError("weights: must be contiguous")
    if y.shape[0] != weights.numel():
        raise ValueError(f"y: expected N * S = {weights.numel()} rows (weights [N, S] = {tuple(weights.shape)}), "
                         f"got shape {tuple(y.shape)}")
    if weights.device != y.device:
        raise ValueError(f"weights: on {weights.device}, y on {y.device}")
    return parse_dtype(out_dtype, "out_dtype")


# ----------------------------------------------------------------------------- host functions
def expert_gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                   slots: int, activation: Activation, block_m: int, *, out: torch.Tensor | None = None,
                   config: GroupedGemmConfig | None = None, tma: bool | None = None) -> torch.Tensor:
    """h [P_max, F] in x's dtype, in list order: row i = SwiGLU of token p // S through expert
    w13[e] for entry i of ``sorted_pairs`` (pair p, module docstring); rows of sentinel entries and
    unused blocks keep ``out``'s values (or are uninitialised). x [N, H], w13 [E_total, 2F, H]
    interleaved, S = ``slots``. ``tma``: which
    kernel (None: the persistent TMA kernel on Hopper from 64-row blocks, else the pointer one;
    True / False force it, True in the interpreter too)."""
    _check_gate_up(x, w13, sorted_pairs, block_experts, slots, activation, block_m)
    _check_tma(tma, "gate_up", x, w13, block_m, config)
    N, H = x.shape
    F = w13.shape[1] // 2
    h = _check_out("out", out, (sorted_pairs.numel(), F), x.dtype, x.device)
    if not use_triton(x):
        return expert_gate_up_ref(x, w13, sorted_pairs, block_experts, slots, activation, block_m, out=h)
    if N == 0 or F == 0 or sorted_pairs.numel() == 0:
        return h
    if _use_tma("gate_up", x, w13, block_m, tma, config):
        cfg = _tma_config("gate_up", x, block_m, config)
        w_desc = TensorDescriptor.from_tensor(w13.view(-1, H), [2 * cfg.block_n, cfg.block_k])
        programs = min(block_experts.numel() * cdiv(F, cfg.block_n), num_sms(x.device))
        _expert_gate_up_tma_kernel[(programs,)](
            x, w_desc, sorted_pairs, block_experts, h,
            block_experts.numel(), N * slots, slots, F, H, x.stride(0), h.stride(0),
            activation.kernel_limit, float(activation.alpha),
            ACT=activation.code, EVEN_K=H % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP=cfg.group, PROGRAMS=programs, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return h
    cfg = config or grouped_gemm_config("gate_up", x.dtype, block_m)
    grid = (block_experts.numel(), cdiv(F, cfg.block_n))
    _expert_gate_up_kernel[grid](
        x, w13, sorted_pairs, block_experts, h,
        N * slots, slots, F, H, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        activation.kernel_limit, float(activation.alpha),
        ACT=activation.code, IEEE=x.dtype == torch.float32, EVEN_K=H % cfg.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return h


def expert_down(h: torch.Tensor, w2: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                block_m: int, num_pairs: int, *, out: torch.Tensor | None = None,
                config: GroupedGemmConfig | None = None, tma: bool | None = None) -> torch.Tensor:
    """y [num_pairs, H] (num_pairs = N * S) in h's dtype, in pair order: row p = round(h[i] @ w2[e]^T)
    (fp32 product, one rounding) for the entry i of each listed pair p; h [P_max, F] in list order
    (``expert_gate_up``'s). Rows of unlisted pairs keep ``out``'s values (or are uninitialised).
    ``tma`` as ``expert_gate_up``'s (the TMA kernel by default from 64-row blocks)."""
    _check_down(h, w2, sorted_pairs, block_experts, block_m, num_pairs)
    _check_tma(tma, "down", h, w2, block_m, config)
    F, H = h.shape[1], w2.shape[1]
    y = _check_out("out", out, (num_pairs, H), h.dtype, h.device)
    if not use_triton(h):
        return expert_down_ref(h, w2, sorted_pairs, block_experts, block_m, num_pairs, out=y)
    if num_pairs == 0 or H == 0 or sorted_pairs.numel() == 0:
        return y
    if _use_tma("down", h, w2, block_m, tma, config):
        cfg = _tma_config("down", h, block_m, config)
        h_desc = TensorDescriptor.from_tensor(h, [block_m, cfg.block_k])
        w_desc = TensorDescriptor.from_tensor(w2.view(-1, F), [cfg.block_n, cfg.block_k])
        programs = min(block_experts.numel() * cdiv(H, cfg.block_n), num_sms(h.device))
        _expert_down_tma_kernel[(programs,)](
            h_desc, w_desc, sorted_pairs, block_experts, y,
            block_experts.numel(), num_pairs, H, F, y.stride(0),
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP=cfg.group, PROGRAMS=programs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return y
    cfg = config or grouped_gemm_config("down", h.dtype, block_m)
    grid = (block_experts.numel(), cdiv(H, cfg.block_n))
    _expert_down_kernel[grid](
        h, w2, sorted_pairs, block_experts, y,
        num_pairs, H, F, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        IEEE=h.dtype == torch.float32, EVEN_K=F % cfg.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def combine(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | str, *,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, H] in ``out_dtype``: out[n] = sum_j weights[n, j] * y[n * S + j] for weights [N, S] fp32:
    in slot order acc = fma(weights[n, j], y[n * S + j], acc) in fp32 (each product added unrounded,
    as the GPU's compiler would contract it anyway), then one rounding to ``out_dtype``."""
    out_dtype = _check_combine(y, weights, out_dtype)
    (num_tokens, slots), H = weights.shape, y.shape[1]
    o = _check_out("out", out, (num_tokens, H), out_dtype, y.device)
    if not use_triton(y):
        return o.copy_(combine_ref(y, weights, out_dtype))
    if num_tokens == 0 or H == 0:
        return o
    block_h = min(COMBINE_BLOCK_H, next_power_of_2(H))
    _combine_kernel[(num_tokens, cdiv(H, block_h))](y, weights, o, H, slots, y.stride(0), o.stride(0), BLOCK_H=block_h,
                                                    num_warps=4)
    return o


# ----------------------------------------------------------------------------- references
def listed_entries(sorted_pairs, block_experts, block_m: int, num_pairs: int):
    """(entries, pair ids, experts) of every listed (non-sentinel, used-block) entry of the pair
    list, int64: h's row ``entries[i]`` (list order) is pair ``pairs[i]``'s, y's row ``pairs[i]``."""
    experts = block_experts.long().repeat_interleave(block_m)
    pairs = sorted_pairs.long()
    keep = (experts >= 0) & (pairs >= 0) & (pairs < num_pairs)
    return keep.nonzero().flatten(), pairs[keep], experts[keep]


def expert_gate_up_ref(x, w13, sorted_pairs, block_experts, slots: int, activation: Activation, block_m: int,
                       *, out=None) -> torch.Tensor:
    """``expert_gate_up`` in plain PyTorch: ``gemm_swiglu_ref`` (the dense contract) per expert on
    its gathered rows, in list order; the other rows of a new h are zero."""
    N, F = x.shape[0], w13.shape[1] // 2
    h = torch.zeros((sorted_pairs.numel(), F), dtype=x.dtype, device=x.device) if out is None else out
    entries, pairs, experts = listed_entries(sorted_pairs, block_experts, block_m, N * slots)
    for e in experts.unique().tolist():
        mine = experts == e
        h[entries[mine]] = gemm_swiglu_ref(x[pairs[mine] // slots], w13[e], activation)
    return h


def expert_down_ref(h, w2, sorted_pairs, block_experts, block_m: int, num_pairs: int, *, out=None) -> torch.Tensor:
    """``expert_down`` in plain PyTorch: the product in fp32 (work dtype), rounded to h's dtype;
    unlisted rows of a new y are zero."""
    y = torch.zeros((num_pairs, w2.shape[1]), dtype=h.dtype, device=h.device) if out is None else out
    entries, pairs, experts = listed_entries(sorted_pairs, block_experts, block_m, num_pairs)
    work = work_dtype(h)
    for e in experts.unique().tolist():
        mine = experts == e
        y[pairs[mine]] = (h[entries[mine]].to(work) @ w2[e].to(work).T).to(h.dtype)
    return y


def combine_ref(y, weights, out_dtype: torch.dtype) -> torch.Tensor:
    """``combine`` in plain PyTorch: the fp32 fused multiply-adds in slot order, then one rounding. An
    fp32 product is exact in fp64, so acc + w * y in fp64 rounded to fp32 is the fp32 fma (but for a
    sum landing exactly halfway between two fp32 values after its fp64 rounding: ~2^-29 a step)."""
    num_tokens, slots = weights.shape
    rows = y.double().reshape(num_tokens, slots, y.shape[1])
    w = weights.double()
    acc = torch.zeros_like(rows[:, 0], dtype=torch.float32)
    for j in range(slots):
        acc = (acc.double() + w[:, j, None] * rows[:, j]).float()
    return acc.to(out_dtype)
