"""Triton kernels and host launchers for ``silu_mul(gate, up)`` = gate_factor(gate) * up_factor(up).

Both kernels are elementwise over a [rows, cols] view whose columns are contiguous (rows may be
strided, e.g. the two halves of a [M, 2F] projection). A program covers a BLOCK_M x BLOCK_N tile
on a 2-D grid (row blocks, column tiles). The launch geometry only decides which tile a program
owns, never the arithmetic, so every geometry gives bit-identical results.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselm.ops.common.activation import Activation, gate_factor, gate_factor_grad, up_factor, up_factor_grad
from fuselm.runtime import arch_major, cdiv, next_power_of_2


@triton.jit
def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: int64 row offsets [BLOCK_M, 1], columns [1, BLOCK_N], in-bounds mask."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _silu_mul_fwd_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_rows, n_cols, stride_gate, stride_up, stride_out,
    limit, alpha,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COL_STRIDE: tl.constexpr = 1,
):
    """COL_STRIDE: gate and up columns this many elements apart (2: the (gate, up) pairs of a
    product with the interleaved weight, ``swiglu_pairs_forward_kernel``); out's columns are contiguous."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(gate_ptr + rows * stride_gate + cols * COL_STRIDE, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_up + cols * COL_STRIDE, mask=mask, other=0.0).to(tl.float32)
    a = gate_factor(g, ACT, limit, alpha).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = a * up_factor(u, ACT, limit)
    tl.store(out_ptr + rows * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr,
    n_rows, n_cols, stride_grad, stride_gate, stride_up, stride_dgate, stride_dup,
    limit, alpha,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    dy = tl.load(grad_ptr + rows * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    a = gate_factor(g, ACT, limit, alpha).to(dgate_ptr.dtype.element_ty).to(tl.float32)
    dg = dy * up_factor(u, ACT, limit) * gate_factor_grad(g, ACT, limit, alpha)
    du = dy * a * up_factor_grad(u, ACT, limit)
    tl.store(dgate_ptr + rows * stride_dgate + cols, dg.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * stride_dup + cols, du.to(dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch geometry
@dataclass(frozen=True)
class Geometry:
    """Which tile a program owns: BLOCK_M rows x BLOCK_N columns, and its warps."""

    block_m: int
    block_n: int
    num_warps: int


# The widest row one program may cover in the one-row geometry (registers: 64K fp32 / program).
MAX_ROW_BLOCK = 65536
# Column-tiled geometry: a program per (row block, 1024-column tile), 4 warps; seed 004's B200
# sweep found 1024 best or tied for the backward. On the H100 every tiling we swept ran within 4%
# of the one-row geometry (benchmarks/results/, sweep.md).
TILE_N = 1024


def row_geometry(n_cols: int) -> Geometry:
    """One program per row, the whole row in one tile; a warp per 512 columns (4 to 32), the
    best or within 1% of the best warp count at each width of the H100 sweep."""
    block_n = next_power_of_2(max(n_cols, 1))
    if block_n > MAX_ROW_BLOCK:
        raise ValueError(f"row geometry covers rows up to {MAX_ROW_BLOCK} columns, got {n_cols}")
    return Geometry(1, block_n, num_warps=min(max(block_n // 512, 4), 32))


def tiled_geometry(n_cols: int) -> Geometry:
    """Column tiles of TILE_N on a 2-D grid; several rows per program when rows are narrow."""
    block_n = min(TILE_N, next_power_of_2(max(n_cols, 1)))
    block_m = max(2048 // block_n, 1)
    return Geometry(block_m, block_n, num_warps=4)


@functools.lru_cache(maxsize=256)
def choose_geometry(n_cols: int, device: torch.device) -> Geometry:
    """Geometry per architecture and row width.

    Hopper and older: one program per row. Our H100 sweep (benchmarks/results/, sweep.md) has it
    1-4% ahead of every column tiling at 4096, 14336 and 18944 columns, forward and backward, at
    96-97% of copy bandwidth. Blackwell: column tiles for rows wider than 8192 (seed 004: the
    one-row backward is occupancy-starved there, 1.6x from tiling at 14336). Rows wider than a
    program holds are tiled everywhere.
    """
    if n_cols > MAX_ROW_BLOCK or (arch_major(device) >= 10 and n_cols > 8192):
        return tiled_geometry(n_cols)
    return row_geometry(n_cols)


def pairs_geometry(n_cols: int) -> Geometry:
    """SwiGLU over a [M, 2F] product's column pairs (stride-2 loads): one row's 2048-column tile a
    program, 4 warps. H200 sweep (benchmarks/prefill_kernels_sweep.py, 9B F = 12288): 5.30 us at
    255 rows (84% of copy), 22.4 at 1024 (80%), against the one-row geometry's 8.04 and 33.8 (55%,
    53%); 1024-column tiles 5.52 / 21.7."""
    return Geometry(1, min(2048, next_power_of_2(max(n_cols, 1))), num_warps=4)


GEOMETRIES = {"row": row_geometry, "tiled": tiled_geometry, "pairs": pairs_geometry}


def _geometry(n_cols: int, device: torch.device, geometry: str | None) -> Geometry:
    if geometry is None:
        return choose_geometry(n_cols, device)
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry: expected one of {sorted(GEOMETRIES)} or None, got {geometry!r}")
    return GEOMETRIES[geometry](n_cols)


def _grid(n_rows: int, n_cols: int, geo: Geometry):
    return (cdiv(n_rows, geo.block_m), cdiv(n_cols, geo.block_n))


# ----------------------------------------------------------------------------- host launchers
def silu_mul_forward_kernel(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, act: Activation, geometry: str | None = None,
    col_stride: int = 1,
) -> torch.Tensor:
    """Launch the forward into ``out`` [rows, cols]; gate and up are 2-D views whose row r, column c
    lies at ``r * stride(0) + c * col_stride`` (1: unit column stride; 2: ``swiglu_pairs_forward_kernel``)."""
    n_rows, n_cols = out.shape
    if n_rows == 0 or n_cols == 0:
        return out
    geo = _geometry(n_cols, gate.device, geometry)
    _silu_mul_fwd_kernel[_grid(n_rows, n_cols, geo)](
        gate, up, out, n_rows, n_cols, gate.stride(0), up.stride(0), out.stride(0),
        act.kernel_limit, float(act.alpha),
        ACT=act.code, BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, COL_STRIDE=col_stride, num_warps=geo.num_warps,
    )
    return out


def swiglu_pairs_forward_kernel(gate_up: torch.Tensor, out: torch.Tensor, act: Activation) -> torch.Tensor:
    """out [M, F] = gate_factor(G) * up_factor(U) for ``gate_up`` [M, 2F] whose columns 2f, 2f + 1
    are (G, U) of feature f: ``x @ w13.T`` with the interleaved weight (``interleave_gate_up``).
    Rows may be strided, columns contiguous. The arithmetic of the forward kernel."""
    return silu_mul_forward_kernel(gate_up, gate_up[:, 1:], out, act, geometry="pairs", col_stride=2)


def silu_mul_backward_kernel(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, d_gate: torch.Tensor, d_up: torch.Tensor,
    act: Activation, geometry: str | None = None,
):
    """Launch the backward on 2-D views with unit column stride; writes ``d_gate`` and ``d_up``."""
    n_rows, n_cols = gate.shape
    if n_rows == 0 or n_cols == 0:
        return d_gate, d_up
    geo = _geometry(n_cols, gate.device, geometry)
    _silu_mul_bwd_kernel[_grid(n_rows, n_cols, geo)](
        grad, gate, up, d_gate, d_up, n_rows, n_cols,
        grad.stride(0), gate.stride(0), up.stride(0), d_gate.stride(0), d_up.stride(0),
        act.kernel_limit, float(act.alpha),
        ACT=act.code, BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, num_warps=geo.num_warps,
    )
    return d_gate, d_up
