"""Row geometry of the kernels that hold whole rows in registers, and their row tile (``row_tile``):
the rms_norm and gated_rms_norm kernels and attention_decode's per-head q/k norm, which uses the
rms_norm forward's tile so that a head's sum of squares is reduced in the same order (bit-equal
to ``rms_norm`` on the head)."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from fuselm.runtime import next_power_of_2

# The widest row a program holds in registers (fp32): the kernels keep a whole row on chip.
MAX_COLS = 65536
"""The most columns a whole-row kernel takes (rms_norm's last dim, attention_decode's head_dim):
each program keeps its rows in fp32 registers, padded to a power of two. The ops reject wider
rows with a ValueError."""


# Forward: rows per program and warps by row width. At least 2048 elements per program (narrow
# rows, e.g. per-head q/k norms, share a program); a warp per 256 columns up to 8, a warp per 1024
# past 8192 columns (2 to 16). The H100 sweep at 8192 x 4096 bf16 (benchmarks/results/, sweep.md)
# put one row and 4 warps within 1% of the best, plain (90% of copy bandwidth) and fused with the
# add (96%); a decode step's one-row norms are latency, not bandwidth: at 2048 columns 8 warps
# (was 2) took the 35B-A3B step at batch 1 from 2.906 to 2.849 ms, at 4096 (was 4) the 9B's batch 8
# from 6.881 to 6.831 (NOTES 73).
@functools.lru_cache(maxsize=256)
def row_block_geometry(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of a program that normalises whole rows of ``n_cols``
    (<= MAX_COLS) columns: BLOCK_N = n_cols rounded up to a power of two, BLOCK_M =
    max(1, 2048 // BLOCK_N) rows, max(2, min(BLOCK_N // 256, 8), min(BLOCK_N // 1024, 16)) warps. The order in which
    ``tl.sum`` reduces a row depends on the tile's shape and warp count: kernels that must agree
    bit for bit on a row's sum of squares (rms_norm's forward, attention_decode's q/k norm) take
    the same geometry."""
    block_n = next_power_of_2(n_cols)
    block_m = max(1, 2048 // block_n)
    return block_m, block_n, max(2, min(block_n // 256, 8), min(block_n // 1024, 16))


@triton.jit
def row_tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's BLOCK_M whole rows of an [n_rows, n_cols] matrix: (int64 row indices
    [BLOCK_M, 1], columns [BLOCK_N], the column mask, the element mask [BLOCK_M, BLOCK_N])."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask[None, :]
    return rows.to(tl.int64)[:, None], cols, col_mask, mask
