"""Triton kernels and host launchers for ``gated_rms_norm`` (``naive.py`` states HF's forward).

Forward, per row of D (fp32 in registers): r = rsqrt(sum(x^2) / D + eps), n = round(x r),
h = w n (rounded to x's dtype when ROUND_H: w has x's dtype, as HF's product), y = round(h silu(g)).
Backward, per row, from dy (fp32 throughout, HF's intermediate roundings not differentiated, as
autograd does not differentiate them either):
    s = sigmoid(g),  dh = dy g s,  dg = dy h s (1 + g (1 - s))
    dn = dh w,  dx = r (dn - x r <dn, x r> / D)
    dw = sum over rows of dh n          (n rounded as the forward uses it; per program, then summed)
Each program takes BLOCK_M rows; the backward writes its dw partial [D] (fp32). r and h are
recomputed in the backward from x, gate and w: the forward writes nothing but y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.common.rows import row_tile
from fuselm.runtime import cdiv, next_power_of_2

BLOCK_M = 32
WARPS = 4


@triton.jit
def _row_terms(x_ptr, g_ptr, w_ptr, n_rows, n_cols, stride_x, stride_g, eps, ROUND_H: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's BLOCK_M rows: their int64 row indices [BLOCK_M, 1], columns and masks, and in
    fp32 gate, w, r, x r, round(x r) and h (x read once, here)."""
    rows, cols, col_mask, mask = row_tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    r = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
    xr = x * r
    n = xr.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = w * n
    if ROUND_H:
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    return rows, cols, mask, col_mask, g, w, r, xr, n, h


@triton.jit
def _forward_kernel(x_ptr, g_ptr, w_ptr, y_ptr, n_rows, n_cols, stride_x, stride_g, stride_y, eps,
                    ROUND_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask, col_mask, g, w, r, xr, n, h = _row_terms(x_ptr, g_ptr, w_ptr, n_rows, n_cols, stride_x,
                                                               stride_g, eps, ROUND_H, BLOCK_M, BLOCK_N)
    y = h * (g / (1.0 + tl.exp(-g)))
    tl.store(y_ptr + rows * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, g_ptr, w_ptr, dx_ptr, dg_ptr, dw_part_ptr, n_rows, n_cols, stride_dy, stride_x,
                     stride_g, eps, ROUND_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask, col_mask, g, w, r, xr, n, h = _row_terms(x_ptr, g_ptr, w_ptr, n_rows, n_cols, stride_x,
                                                               stride_g, eps, ROUND_H, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dh = dy * g * s
    dg = dy * h * s * (1.0 + g * (1.0 - s))
    dn = dh * w
    dx = r * (dn - xr * (tl.sum(dn * xr, axis=1) / n_cols)[:, None])
    tl.store(dx_ptr + rows * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + rows * n_cols + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    dw_part = tl.sum(tl.where(mask, dh * n, 0.0), axis=0)
    tl.store(dw_part_ptr + tl.program_id(0) * n_cols + cols, dw_part, mask=col_mask)


def _geometry(n_cols):
    return BLOCK_M, next_power_of_2(n_cols)


def gated_rms_norm_forward_kernel(x2d, g2d, weight, eps, out, round_h: bool) -> None:
    """x2d, g2d [M, D] (unit column stride), weight [D], out [M, D] contiguous."""
    n_rows, n_cols = x2d.shape
    block_m, block_n = _geometry(n_cols)
    _forward_kernel[(cdiv(n_rows, block_m),)](
        x2d, g2d, weight, out, n_rows, n_cols, x2d.stride(0), g2d.stride(0), out.stride(0), eps,
        ROUND_H=round_h, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=WARPS)


def gated_rms_norm_backward_kernel(dy2d, x2d, g2d, weight, eps, round_h: bool):
    """(dx [M, D] x's dtype, dgate [M, D] gate's dtype, dw [D] fp32) from dy2d [M, D]."""
    n_rows, n_cols = x2d.shape
    block_m, block_n = _geometry(n_cols)
    grid = cdiv(n_rows, block_m)
    dx = torch.empty(n_rows, n_cols, dtype=x2d.dtype, device=x2d.device)
    dg = torch.empty(n_rows, n_cols, dtype=g2d.dtype, device=x2d.device)
    dw_part = torch.empty(grid, n_cols, dtype=torch.float32, device=x2d.device)
    _backward_kernel[(grid,)](
        dy2d, x2d, g2d, weight, dx, dg, dw_part, n_rows, n_cols, dy2d.stride(0), x2d.stride(0), g2d.stride(0), eps,
        ROUND_H=round_h, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=WARPS)
    return dx, dg, dw_part.sum(0)
