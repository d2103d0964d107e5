"""``decode_attention``: one query token per cache row against that row's filled cache columns
only, split over the sequence (flash-decoding), for GQA.

Grid (B x nKV, splits): a program takes one row b, one kv head and one split of ``split_size``
columns, and stops at the row's length (columns past it are never read, so a 512-token row in a
32k-column cache costs what it would in a 512-column one; a split wholly past the length exits at
once). Its GROUP = nH / nKV query heads share each K/V tile (padded to 16 rows for the tensor-core
dot). Per BLOCK_N columns, online softmax in fp32 (FlashAttention's recurrence):

    s = (q k^T) scale          m' = max(m, max_j s_j)       p = exp(s - m')
    l = l e^(m - m') + sum p   acc = acc e^(m - m') + round(p) v

with q k^T and p v as dots with fp32 accumulation (p rounded to the cache dtype first, as flash
attention does; fp32 caches stay fp32, with ieee fp32 dots, not tf32). Each split writes acc / l and lse = m + log l (fp32);
a second kernel combines the splits of each (row, head): o = sum_s e^(lse_s - M) o_s / sum_s
e^(lse_s - M), rounded once to q's dtype. A row of length 0 gets zeros. With a gate (Qwen3.5's
output gate), the combine applies it to the rounded output (``fuselm.ops.common.prologue``).

The number of splits depends on the shapes only (B, nKV, the cache's columns, the SM count): a
CUDA graph may capture the op, and the lengths are read on the device. A paged cache (pages of P
columns, a block table per row) is read page by page: a block never straddles two pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.attention_decode.naive import decode_attention_ref
from fuselm.ops.common.pdl import allow_next_kernel
from fuselm.ops.common.prologue import PROLOGUE_NONE, PROLOGUE_SIGMOID_GATE, prologue_tile
from fuselm.runtime import cdiv, check_same_device, check_tensor, next_power_of_2, num_sms, use_pdl, use_triton

BLOCK_N = 64  # cache columns per inner step
MIN_GROUP_ROWS = 16  # the tensor-core dot's smallest M
MIN_DOT_K = 16  # and its smallest K: head dims below it are padded with zeros


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, table_ptr, part_o_ptr, part_lse_ptr,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_tb,
                  num_kv_heads, split_size, scale,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, PAGED: tl.constexpr,
                  PAGE: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * split_size
    end = tl.minimum(start + split_size, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None] & d_mask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_row = k_ptr + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_row = v_ptr + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        tile_mask = n_mask[:, None] & d_mask[None, :]
        if PAGED:  # the block lies in one page (BLOCK_N divides PAGE): the row's page n0 // PAGE
            page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + n0 // PAGE).to(tl.int64)
            k_row = k_ptr + page * stride_kb + kv_head.to(tl.int64) * stride_kh
            v_row = v_ptr + page * stride_vb + kv_head.to(tl.int64) * stride_vh
            n = n0 % PAGE + tl.arange(0, BLOCK_N)
        k = tl.load(k_row + n.to(tl.int64)[:, None] * stride_kl + d[None, :], mask=tile_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_row + n.to(tl.int64)[:, None] * stride_vl + d[None, :], mask=tile_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    has_keys = l > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    head = (pid * GROUP + g).to(tl.int64)  # (b, kv_head, g) -> the query head's row b * nH + h
    g_mask = g < GROUP
    tl.store(part_o_ptr + (head[:, None] * NUM_SPLITS + split) * HEAD_DIM + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + head * NUM_SPLITS + split, lse, mask=g_mask)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, gate_ptr, stride_gb, stride_gh, NUM_HEADS,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                    PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr):
    # The kernel after it (the output projection, launched as a programmatic dependent) may begin
    # now: it loads its weights, then waits for the output.
    allow_next_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # b * nH + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    total = tl.sum(weight, axis=0)
    parts = tl.load(part_o_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
                    mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = (tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty)
    if PROLOGUE:  # Qwen3.5's output gate on the rounded output: round(o round(sigmoid(gate)))
        gate_row = gate_ptr + (row // NUM_HEADS) * stride_gb + (row % NUM_HEADS) * stride_gh
        out = tl.reshape(prologue_tile(out[None, :], gate_row + d[None, :], (d < HEAD_DIM)[None, :], 0.0, 0.0,
                                       PROLOGUE, 1, 1, BLOCK_D), [BLOCK_D])
    tl.store(out_ptr + row * HEAD_DIM + d, out, mask=d < HEAD_DIM)


def num_splits(batch: int, num_kv_heads: int, columns: int, block: int, device: torch.device) -> tuple[int, int]:
    """(splits, split_size): about two programs per SM over the whole cache, splits a multiple of
    ``block`` columns wide. Shapes only (graph safe)."""
    wanted = max(1, cdiv(2 * num_sms(device), batch * num_kv_heads))
    split_size = cdiv(cdiv(columns, min(wanted, cdiv(columns, block))), block) * block
    return cdiv(columns, split_size), split_size


def decode_attention_kernels(q, key_cache, value_cache, kv_lengths, scale, block_table=None, gate=None):
    B, num_heads, head_dim = q.shape
    num_kv_heads, page = key_cache.shape[1], key_cache.shape[2]
    columns = page if block_table is None else block_table.shape[1] * page
    block_n = BLOCK_N if block_table is None else min(BLOCK_N, page)
    group = num_heads // num_kv_heads
    splits, split_size = num_splits(B, num_kv_heads, columns, block_n, q.device)
    part_o = torch.empty(B * num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B * num_heads, splits, dtype=torch.float32, device=q.device)
    block_d = max(MIN_DOT_K, next_power_of_2(head_dim))
    _split_kernel[(B * num_kv_heads, splits)](
        q, key_cache, value_cache, kv_lengths, kv_lengths if block_table is None else block_table, part_o, part_lse,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        0 if block_table is None else block_table.stride(0), num_kv_heads, split_size, float(scale),
        GROUP=group, BLOCK_G=max(MIN_GROUP_ROWS, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PAGED=block_table is not None, PAGE=page, num_warps=4 if block_d <= 128 else 8, num_stages=2)
    out = torch.empty(B, num_heads, head_dim, dtype=q.dtype, device=q.device)
    gated = gate is not None
    _combine_kernel[(B * num_heads,)](part_o, part_lse, out, gate if gated else out, gate.stride(0) if gated else 0,
                                      gate.stride(1) if gated else 0, num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                      NUM_SPLITS=splits, BLOCK_S=next_power_of_2(splits),
                                      PROLOGUE=PROLOGUE_SIGMOID_GATE if gated else PROLOGUE_NONE,
                                      USE_PDL=use_pdl(q.device), num_warps=4)
    return out


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     kv_lengths: torch.Tensor, scale: float, block_table: torch.Tensor | None = None,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row over its cache row's filled columns (decode).

    Args:
        q: [B, nH, hd] or [B, nH, 1, hd] (last dim contiguous), fp32/fp16/bf16.
        key_cache, value_cache: [>= B, nKV, L, hd] in q's dtype, last dim contiguous; row b of
            the batch is cache row b; nH a multiple of nKV (query head h reads kv head
            h // (nH / nKV)). With ``block_table``: pages [pages, nKV, P, hd], P a power of two
            >= 16.
        kv_lengths: int32/int64 [B] on q's device: row b attends to its columns 0 .. kv_lengths[b] - 1
            (0: the row gets zeros); values in [0, L] (not checked on a GPU: no host sync).
        scale: on q k^T.
        block_table: optional int32/int64 [B, pages_per_row]: row b's column n is at page
            ``block_table[b, n // P]``, slot n % P (L = pages_per_row * P); entries past a row's
            length are never read. Values in [0, pages) (not checked: read on the device).
        gate: optional [B, nH, hd] in q's dtype (last dim contiguous, any row and head strides:
            Qwen3.5's gate read in place from its projection): the output is then
            round(o round(sigmoid(gate))), ``decode_linear``'s sigmoid_gate prologue applied to the
            rounded attention output, so the projection after it runs plain.
    Returns:
        [B, nH, hd] in q's dtype (``split_kv.py`` gives the numerics; ``naive.decode_attention_ref``
        is the fp32 reference). Inference only. CUDA-graph safe.
    """
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, t)
    if not isinstance(kv_lengths, torch.Tensor) or kv_lengths.dtype not in (torch.int32, torch.int64):
        raise TypeError("kv_lengths: expected an int32/int64 tensor [B]")
    if block_table is not None and (not isinstance(block_table, torch.Tensor)
                                    or block_table.dtype not in (torch.int32, torch.int64)):
        raise TypeError("block_table: expected None or an int32/int64 tensor [B, pages_per_row]")
    check_same_device(q=q, key_cache=key_cache, value_cache=value_cache, kv_lengths=kv_lengths, block_table=block_table)
    if q.dim() == 4 and q.shape[2] == 1:
        q = q[:, :, 0]
    if q.dim() != 3:
        raise ValueError(f"q: expected [B, nH, hd] or [B, nH, 1, hd], got {tuple(q.shape)}")
    B, num_heads, head_dim = q.shape
    min_rows = B if block_table is None else 1
    if key_cache.dim() != 4 or key_cache.shape[0] < min_rows or key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache: expected [>= {min_rows}, nKV, L, {head_dim}] (head_dim of q), got "
                         f"{tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: shape {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}")
    if num_heads % key_cache.shape[1]:
        raise ValueError(f"q: {num_heads} heads is not a multiple of the cache's {key_cache.shape[1]} kv heads")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous")
    if kv_lengths.shape != (B,):
        raise ValueError(f"kv_lengths: expected [B] = ({B},), got {tuple(kv_lengths.shape)}")
    if gate is not None:
        check_tensor("gate", gate)
        check_same_device(q=q, gate=gate)
        if gate.shape != q.shape or gate.dtype != q.dtype or (gate.stride(-1) != 1 and head_dim > 1):
            raise ValueError(f"gate: expected [B, nH, hd] = {tuple(q.shape)} in {q.dtype} with a contiguous last dim, "
                             f"got {tuple(gate.shape)} {gate.dtype} strides {tuple(gate.stride())}")
    columns = key_cache.shape[2]
    if block_table is not None:
        page = key_cache.shape[2]
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table: expected [B = {B}, pages_per_row], got {tuple(block_table.shape)}")
        if page < 16 or page & (page - 1):
            raise ValueError(f"key_cache: a paged cache's page size (dim 2) must be a power of two >= 16, got {page}")
        columns = block_table.shape[1] * page
    if not kv_lengths.is_cuda and not bool(((kv_lengths >= 0) & (kv_lengths <= columns)).all()):
        raise ValueError(f"kv_lengths: values must be in [0, {columns}] (the cache's columns)")
    if B == 0:
        return q.new_empty(q.shape)
    if not use_triton(q):
        return decode_attention_ref(q, key_cache, value_cache, kv_lengths, scale, block_table, gate)
    return decode_attention_kernels(q, key_cache, value_cache, kv_lengths, scale, block_table, gate)
