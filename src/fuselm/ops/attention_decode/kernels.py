"""Triton kernel and host launcher for ``qk_norm_rope_kv_write`` (gated-attention decode prep).

One launch per attention layer and decode step. Grid (B, q tiles + kv tiles): a program takes
one cache row b and a tile of BLOCK_M heads x BLOCK_N dims (BLOCK_N = head_dim rounded up to a
power of two), reads the heads from the qkv projection row and, per head (fp32 in registers):

    rstd = rsqrt(sum(x^2) / head_dim + eps)
    y    = round(x * rstd * (1 + w))                       (zero-centered RMSNorm, one rounding)
    for d < rotary_dim (half = rotary_dim / 2; partner p = d + half for d < half, d - half after):
        a   = round(y[d] * cos[d])
        s   = round((-y[p] if d < half else y[p]) * sin[d])
        out = round(a + s)
    for d >= rotary_dim: out = y[d]

round = to the model dtype, each step where PyTorch's eager ops round (``naive.py``). The
partner y[p] is recomputed from x[p] (a second load of the same row) with the same operations,
so it is bit-equal to y at p. q tiles store ``out`` to q_out [B, nH, 1, hd]; kv tiles store k's
``out`` to ``key_cache[r, h, write_column[b]]`` (r = ``write_row[b]``, a paged cache's page; by
default b) and copy v unchanged to ``value_cache``.

Bit-exactness with the PyTorch path (which runs fuselm's rms_norm kernel for the norm):
- the norm is the rms_norm forward kernel's own expression on a tile of the same shape and warp
  count (``row_block_geometry``, ``fuselm/ops/common/rows.py``), so a head's sum of squares is
  reduced in the same order;
- ``a + s`` is ``libdevice.add_rn`` on a GPU: a rounded add the compiler cannot contract into an
  FMA with the products (an fp32 model would otherwise round once where PyTorch rounds twice);
- the Triton interpreter converts fp32 to bf16 by truncation (checked on triton 3.9; tests/helpers.py):
  the norm keeps the plain conversion (as the rms_norm kernel does, also in the interpreter),
  while the rotary roundings, which are PyTorch ops in the model, round to nearest even by
  integer arithmetic under the interpreter (``EMULATE_BF16_RNE``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fuselm.ops.common.rows import row_block_geometry
from fuselm.runtime import INTERPRET, cdiv


@triton.jit
def _round(x, DTYPE: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    """fp32 x rounded to DTYPE (round to nearest even), returned as fp32."""
    if EMULATE_BF16_RNE:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + (((u >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norm_rope_tile(
    src_ptr, head_stride, heads, n_heads, w_ptr, cos_ptr, sin_ptr, n_cols, rot, half, eps,
    DTYPE: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr, ADD_RN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """RMSNorm (zero-centered) + partial rotary of the heads ``heads`` [BLOCK_M] (< n_heads) at
    ``src_ptr + head * head_stride``; returns the [BLOCK_M, BLOCK_N] tile in DTYPE."""
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    head_ok = heads < n_heads
    mask = head_ok[:, None] & col_mask[None, :]
    rows = heads.to(tl.int64)[:, None] * head_stride
    # The rms_norm forward kernel's expression (ZERO_CENTERED, offset 1).
    x = tl.load(src_ptr + rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_normed = x * rstd[:, None]
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = (x_normed * (1.0 + w)).to(DTYPE)
    # Rotate-half partner of each rotary column, normalised the same way.
    is_rot = cols < rot
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)
    partner = tl.where(is_rot, partner, cols)
    xp = tl.load(src_ptr + rows + partner[None, :], mask=head_ok[:, None] & is_rot[None, :], other=0.0)
    xp_normed = xp.to(tl.float32) * rstd[:, None]
    wp = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)[None, :]
    yp = (xp_normed * (1.0 + wp)).to(DTYPE).to(tl.float32)
    yp = tl.where(first[None, :], -yp, yp)
    c = tl.load(cos_ptr + cols, mask=is_rot, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + cols, mask=is_rot, other=0.0).to(tl.float32)[None, :]
    a = _round(y.to(tl.float32) * c, DTYPE, EMULATE_BF16_RNE)
    b = _round(yp * s, DTYPE, EMULATE_BF16_RNE)
    if ADD_RN:
        total = libdevice.add_rn(a, b)
    else:
        total = a + b
    rotated = _round(total, DTYPE, EMULATE_BF16_RNE).to(DTYPE)
    return tl.where(is_rot[None, :], rotated, y)


@triton.jit
def _qk_norm_rope_kv_write_kernel(
    qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, column_ptr, write_row_ptr, q_out_ptr,
    k_out_ptr, stride_qkv, stride_cos, stride_sin,
    stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    n_heads, n_kv_heads, n_cols, rot, eps, cache_len,
    Q_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATE_BF16_RNE: tl.constexpr, ADD_RN: tl.constexpr, HAS_WRITE_ROW: tl.constexpr, HAS_K_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    DTYPE: tl.constexpr = q_out_ptr.dtype.element_ty
    src = qkv_ptr + row * stride_qkv
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_sin
    half = rot // 2
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if tile < Q_TILES:
        heads = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        # q of head h: columns [2 h hd, 2 h hd + hd) of the q_gate block (the gate half follows).
        out = _norm_rope_tile(src, 2 * n_cols, heads, n_heads, q_w_ptr, cos_row, sin_row, n_cols, rot, half, eps,
                              DTYPE, EMULATE_BF16_RNE, ADD_RN, BLOCK_N)
        mask = (heads < n_heads)[:, None] & col_mask[None, :]
        offs = (row * n_heads + heads.to(tl.int64))[:, None] * n_cols + cols[None, :]
        tl.store(q_out_ptr + offs, out, mask=mask)
    else:
        heads = (tile - Q_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
        k_src = src + 2 * n_heads * n_cols
        v_src = k_src + n_kv_heads * n_cols
        out = _norm_rope_tile(k_src, n_cols, heads, n_kv_heads, k_w_ptr, cos_row, sin_row, n_cols, rot, half, eps,
                              DTYPE, EMULATE_BF16_RNE, ADD_RN, BLOCK_N)
        mask = (heads < n_kv_heads)[:, None] & col_mask[None, :]
        if HAS_K_OUT:  # k (normed, rotated) also to k_out [B, nKV, hd], for attention within the chunk
            tl.store(k_out_ptr + (row * n_kv_heads + heads.to(tl.int64))[:, None] * n_cols + cols[None, :], out,
                     mask=mask)
        column = tl.load(column_ptr + row).to(tl.int64)
        # a column outside [0, L) writes nothing (the host checks it only where that costs no sync)
        mask = mask & (cols < tl.where((column >= 0) & (column < cache_len), n_cols, 0))[None, :]
        h = heads.to(tl.int64)[:, None]
        cache_row = tl.load(write_row_ptr + row).to(tl.int64) if HAS_WRITE_ROW else row  # a paged cache's page
        tl.store(k_cache_ptr + cache_row * stride_kb + h * stride_kh + column * stride_kl + cols[None, :], out,
                 mask=mask)
        v = tl.load(v_src + h * n_cols + cols[None, :], mask=mask, other=0.0)
        tl.store(v_cache_ptr + cache_row * stride_vb + h * stride_vh + column * stride_vl + cols[None, :], v,
                 mask=mask)


def qk_norm_rope_kv_write_kernel(qkv, q_norm_weight, k_norm_weight, cos, sin, key_cache, value_cache, write_column,
                                 write_row, q_out, num_heads: int, num_kv_heads: int, head_dim: int,
                                 eps: float, k_out=None) -> None:
    """Launch on checked arguments: qkv [B, P], cos/sin [B, rotary_dim] (unit column stride, any
    row stride), weights contiguous [hd], caches [rows, nKV, L, hd] with unit last stride,
    write_column int [B], write_row int [B] or None (row b), q_out contiguous [B, nH, 1, hd],
    k_out contiguous [B, nKV, hd] or None."""
    B = qkv.shape[0]
    # The rms_norm forward kernel's tile (heads per program, padded head_dim) and warp count.
    block_m, block_n, num_warps = row_block_geometry(head_dim)
    q_tiles = cdiv(num_heads, block_m)
    kv_tiles = cdiv(num_kv_heads, block_m)
    _qk_norm_rope_kv_write_kernel[(B, q_tiles + kv_tiles)](
        qkv, q_norm_weight, k_norm_weight, cos, sin, key_cache, value_cache, write_column,
        write_column if write_row is None else write_row, q_out, q_out if k_out is None else k_out, qkv.stride(0),
        cos.stride(0), sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_heads, num_kv_heads, head_dim, cos.shape[-1], eps, key_cache.shape[2],
        Q_TILES=q_tiles, BLOCK_M=block_m, BLOCK_N=block_n,
        EMULATE_BF16_RNE=INTERPRET and qkv.dtype == torch.bfloat16, ADD_RN=not INTERPRET,
        HAS_WRITE_ROW=write_row is not None, HAS_K_OUT=k_out is not None, num_warps=num_warps,
    )
