"""Triton kernel and host launcher for ``prefill_attention`` (paged causal attention of a prompt
chunk, flash-attention style, GQA).

Grid (B x nKV, cdiv(T x GROUP, BLOCK_M)). The GROUP = nH / nKV query heads of one kv head are
folded into the M dimension of the dots: flat row m of a program is (query t, head g) with
t = m // GROUP, g = m % GROUP, so BLOCK_M (a power of two) covers about BLOCK_M / GROUP queries
and a group that is not a power of two wastes nothing but the last tile's tail (a query's heads
may straddle two programs; every row is independent). A program takes one row b, one kv head and
one tile of rows, and walks its row's cache columns BLOCK_N at a time (64, or the page size P if
smaller; BLOCK_N divides P): one block-table load per block, then the K/V tile of that block.

Query t sits at position starts[b] + t. Real queries (t < lengths[b]) see columns 0 .. position.
Padding queries (t >= lengths[b], right padding) are computed as if they sat at the row's last
real position (so a mixed tile reads nothing more) and their outputs are stored as zeros; a
tile with no real query reads nothing and stores zeros. The program's columns:

    full blocks      [0, F)  F = (starts + t_first + 1) // P * P: every row of the tile sees them
    diagonal blocks  [F, E)  E = starts + min(t_last, lengths - 1) + 1: causal mask per row, and
                             the K/V loads masked at E (columns past the row's last real
                             position are never loaded: NaN or stale data there cannot enter)

so no block past the tile's last real position is visited, and no column at or past
starts[b] + lengths[b] is ever read (block-table entries past them are never loaded either).

Per block, online softmax in fp32 (FlashAttention's recurrence, in base 2):

    s = (q k^T) scale log2(e)    m' = max(m, max_j s_j)    p = 2^(s - m')
    l = l 2^(m - m') + sum p     acc = acc 2^(m - m') + round(p) v

with both dots accumulating in fp32 (``dot_acc``: ieee for fp32 operands; p rounded to the cache
dtype first, as flash attention does). Output acc / l, rounded once to q's dtype.

Everything the launch depends on is a shape (the grid, the tiles); starts, lengths and the block
table are read on the device: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.common.matmul import dot_acc
from fuselm.runtime import cdiv, next_power_of_2

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot's smallest M / K: BLOCK_M and the padded head dim are at least this
BLOCK_N = 64  # key columns per step (tile_config says why)
MAX_HEAD_DIM = 256  # head dims above it are refused (the tile no longer fits a program)


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, starts_ptr, lengths_ptr, out_ptr,
    stride_qb, stride_qh, stride_qt,
    stride_kp, stride_kh, stride_kl, stride_vp, stride_vh, stride_vl,
    stride_tb, stride_tp,
    stride_ob, stride_oh, stride_ot,
    num_kv_heads, T, table_columns, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    b = (pid // num_kv_heads).to(tl.int64)
    kv_head = pid % num_kv_heads
    start = tl.load(starts_ptr + b).to(tl.int32)
    length = tl.load(lengths_ptr + b).to(tl.int32)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # flat (query, head-in-group) rows
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < T
    d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    d_ok = d < HEAD_DIM

    q_offs = b * stride_qb + head.to(tl.int64)[:, None] * stride_qh + t.to(tl.int64)[:, None] * stride_qt + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Padding queries take the row's last real position (nothing past it is read).
    pos = start + tl.minimum(t, length - 1)  # [BLOCK_M]
    t_first = (tile * BLOCK_M) // GROUP
    t_last = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, T - 1)
    has_real = t_first < length
    # Columns [0, end), never past the block table's (bad starts / lengths that a GPU call does
    # not check on the host then give a wrong answer, not an out-of-bounds read).
    end = tl.minimum(tl.where(has_real, start + tl.minimum(t_last, length - 1) + 1, 0), table_columns)
    full_end = tl.minimum(tl.where(has_real, (start + t_first + 1) // PAGE * PAGE, 0), end)  # seen by every row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)  # columns per step: a page, or part of one (BLOCK_N divides PAGE)
    table_row = table_ptr + b * stride_tb
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    kt_offs = n[None, :] * stride_kl + d[:, None]  # K^T tile [BLOCK_D, BLOCK_N]
    v_offs = n[:, None] * stride_vl + d[None, :]  # V tile [BLOCK_N, BLOCK_D]

    # Full blocks: every column visible to every row of the tile.
    for n0 in range(0, full_end, BLOCK_N):
        page = tl.load(table_row + (n0 // PAGE) * stride_tp).to(tl.int64)
        k_block = k_head + page * stride_kp + (n0 % PAGE) * stride_kl
        v_block = v_head + page * stride_vp + (n0 % PAGE) * stride_vl
        if EVEN_D:
            kt = tl.load(k_block + kt_offs)
            v = tl.load(v_block + v_offs)
        else:
            kt = tl.load(k_block + kt_offs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_block + v_offs, mask=d_ok[None, :], other=0.0)
        s = dot_acc(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    # Diagonal blocks: causal mask per row; loads stop at the tile's last real position.
    for n0 in range(full_end, end, BLOCK_N):
        page = tl.load(table_row + (n0 // PAGE) * stride_tp).to(tl.int64)
        k_block = k_head + page * stride_kp + (n0 % PAGE) * stride_kl
        v_block = v_head + page * stride_vp + (n0 % PAGE) * stride_vl
        col = n0 + n
        col_ok = col < end
        kt = tl.load(k_block + kt_offs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_block + v_offs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = dot_acc(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE) * qk_scale
        s = tl.where(col[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: column 0 came in the first block
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    real = (t < length) & (l_i > 0)
    out = tl.where(real[:, None], acc / tl.where(real, l_i, 1.0)[:, None], 0.0)
    o_offs = b * stride_ob + head.to(tl.int64)[:, None] * stride_oh + t.to(tl.int64)[:, None] * stride_ot + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def tile_config(T: int, group: int, head_dim: int, page: int, element_size: int) -> dict:
    """BLOCK_M (flat query-head rows per program), warps and pipeline stages, from shapes only."""
    block_d = max(MIN_DOT, next_power_of_2(head_dim))
    block_m = 128 if block_d <= 128 else 64
    if block_d * element_size > 512:  # fp32 at head dim 256: the q tile and K/V pages would not fit
        block_m = 32
    block_m = min(block_m, max(MIN_DOT, next_power_of_2(T * group)))
    # The q tile plus the K and V tiles of one page, double-buffered, within ~160 KiB of shared
    # memory (an H100 has 227 KiB per block; the rest is layout-conversion scratch); else 1 stage.
    q_bytes = block_m * block_d * element_size
    stages = 2 if q_bytes + 2 * 2 * page * block_d * element_size <= 160 * 1024 else 1
    # Key columns per step: 64 (or the page, if smaller). At Qwen3.5's head dim 256 this spills
    # (255 registers and 912 B a thread in an sm_90 build of triton 3.6; 32 columns: 96 B), yet 32
    # columns were 20-43% slower on the H200 (benchmarks/prefill_attention.py, NOTES 42).
    block_n = min(page, BLOCK_N)
    return dict(BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4 if block_d <= 64 else 8,
                num_stages=stages)


def prefill_attention_kernel(q, key_pages, value_pages, block_table, starts, lengths, scale,
                             block_m: int | None = None) -> torch.Tensor:
    """Launch on checked arguments (``op.prefill_attention``). Returns [B, nH, T, hd], a
    transposed view of a contiguous [B, T, nH, hd] buffer. ``block_m`` (a power of two >= 16)
    overrides the tile height (tests)."""
    B, num_heads, T, head_dim = q.shape
    num_kv_heads, page = key_pages.shape[1], key_pages.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(B, T, num_heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    config = tile_config(T, group, head_dim, page, q.element_size())
    if block_m is not None:
        config["BLOCK_M"] = block_m
    grid = (B * num_kv_heads, cdiv(T * group, config["BLOCK_M"]))
    _prefill_attention_kernel[grid](
        q, key_pages, value_pages, block_table, starts, lengths, out,
        q.stride(0), q.stride(1), q.stride(2),
        *key_pages.stride()[:3], *value_pages.stride()[:3],
        block_table.stride(0), block_table.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        num_kv_heads, T, block_table.shape[1] * page, float(scale) * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, IEEE=q.dtype == torch.float32, **config)
    return out
