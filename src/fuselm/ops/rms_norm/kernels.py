"""Triton kernels and host launchers for RMSNorm, optionally fused with the residual add.

Forward, per row (fp32 in registers):
    s        = round(x + residual)                  (HAS_RESIDUAL; s is also written out)
    rstd     = rsqrt(sum(s^2) / N + eps)            (sum in fp32, never from a rounded sum)
    x_normed = s * rstd
    y        = round(w * round(x_normed))           (offset == 0, HF Llama)
             = round(x_normed * (offset + w))       (offset != 0, HF Qwen3.5 zero-centered)
Backward, per row, with w_eff = w (+ offset), g = dy * w_eff:
    dx = rstd * (g - x_normed * sum(g * x_normed) / N)   (+ d_residual_out, HAS_DRES)
    dw = sum over rows of dy * x_normed   (round(x_normed) in the Llama mode, as the forward uses it)
rstd is recomputed in the backward from x (which the backward reads anyway), so the forward
writes nothing but its outputs.

On Hopper the forward is a programmatic dependent launch (``fuselm/ops/common/pdl.py``): its
program is resident while the kernel ahead still runs and has read the weight; it reads x and the
residual after the wait (so the weight must not be written by the kernel right before the call;
FUSELM_PDL=0 turns it off). A decode step's one-row norms so skip their launch latency: the
35B-A3B step at batch 1 2.940 ms with the norm launched plainly, 2.814 as a dependent (NOTES 73).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.common.rows import row_block_geometry, row_tile
from fuselm.ops.common.pdl import allow_next_kernel, wait_for_previous_kernel
from fuselm.runtime import cdiv, next_power_of_2, num_sms, use_pdl


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    n_rows, n_cols, stride_x, stride_res, stride_y, stride_res_out,
    eps, offset,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows, cols, col_mask, mask = row_tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    # Launched as a programmatic dependent: the weight loads while the kernel ahead (which writes
    # x) still runs; x and the residual after the wait.
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    wait_for_previous_kernel(USE_PDL)
    # The kernel after it (the MoE router, a one-token projection: decode_linear's vector kernel),
    # a programmatic dependent too, may begin now: it loads weights, then waits for y.
    allow_next_kernel(USE_PDL)
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows * stride_res_out + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_normed = x * rstd[:, None]
    if ZERO_CENTERED:
        y = x_normed * (offset + w)
    else:
        y = w * x_normed.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, dres_ptr, dx_ptr, dw_partial_ptr,
    n_rows, n_cols, rows_per_program, stride_dy, stride_x, stride_dres, stride_dx,
    eps, offset,
    HAS_DRES: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        row_mask = cols < tl.where(row < n_rows, n_cols, 0)  # all-false past the last row
        x = tl.load(x_ptr + row * stride_x + cols, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        x_normed = x * rstd
        if ZERO_CENTERED:
            dw += dy * x_normed
        else:
            dw += dy * x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = rstd * (g - x_normed * (tl.sum(g * x_normed, axis=0) / n_cols))
        if HAS_DRES:
            dx += tl.load(dres_ptr + row * stride_dres + cols, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


# ----------------------------------------------------------------------------- tuning constants
# Forward: the whole-row tile of ``fuselm.ops.common.rows`` (MAX_COLS, row_block_geometry).
# Backward: a persistent grid of PROGRAMS_PER_SM x SMs programs, each over a contiguous run of
# rows, accumulating its dw partial in registers (one fp32 row of partial sums per program).
PROGRAMS_PER_SM = 2


# ----------------------------------------------------------------------------- host launchers
def rms_norm_forward_kernel(x, residual, weight, y, residual_out, eps: float, offset: float):
    """Launch the forward on 2-D [rows, N] views (unit column stride). ``residual`` None: plain
    RMSNorm, else the fused add writing ``residual_out``."""
    n_rows, n_cols = x.shape
    block_m, block_n, num_warps = row_block_geometry(n_cols)
    has_res = residual is not None
    res, res_out = (residual, residual_out) if has_res else (x, y)
    pdl = use_pdl(x.device)
    _rms_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
        x, res, weight, y, res_out, n_rows, n_cols,
        x.stride(0), res.stride(0), y.stride(0), res_out.stride(0), eps, offset,
        HAS_RESIDUAL=has_res, ZERO_CENTERED=offset != 0.0, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )


def rms_norm_backward_kernel(dy, x, weight, d_residual_out, dx, eps: float, offset: float) -> torch.Tensor:
    """Launch the backward; writes ``dx`` (plus ``d_residual_out`` when given) and returns dw as
    fp32 partial sums reduced over programs."""
    n_rows, n_cols = x.shape
    programs = max(1, min(n_rows, PROGRAMS_PER_SM * num_sms(x.device)))
    rows_per_program = cdiv(n_rows, programs)
    programs = cdiv(n_rows, rows_per_program)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    block_n = next_power_of_2(n_cols)
    has_dres = d_residual_out is not None
    dres = d_residual_out if has_dres else dy
    _rms_norm_bwd_kernel[(programs,)](
        dy, x, weight, dres, dx, dw_partial, n_rows, n_cols, rows_per_program,
        dy.stride(0), x.stride(0), dres.stride(0), dx.stride(0), eps, offset,
        HAS_DRES=has_dres, ZERO_CENTERED=offset != 0.0, BLOCK_N=block_n,
        num_warps=min(max(block_n // 256, 4), 16),
    )
    return dw_partial.sum(0)
