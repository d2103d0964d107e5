"""Triton kernels and host launchers for the two per-row passes over one vocab chunk of logits.

The op (``op.py``) forms the logits of every row for one chunk of the vocabulary, [N, C], with
one GEMM into a workspace; these kernels read each row of that chunk (all math in fp32 registers),
one program per row. Columns are the chunk's, vocab ids are ``v0 + column``.

``_chunk_stats_kernel`` (forward): merges the chunk into the row's running (max M, sum S):

    m = max_c x_c,  s = sum_c exp(x_c - m)        (online over blocks of BLOCK_V, lane-wise)
    M' = max(M, m),  S' = S e^{M - M'} + s e^{m - M'}
    target_r = x_{t - v0}   when the label t lies in this chunk

so that after the last chunk lse = M + log S and loss_r = lse - target_r.

``_chunk_grad_kernel`` (backward): overwrites the chunk with d loss_r / d logits,

    x_c <- round(scale_r * (exp(x_c - lse_r) - [v0 + c == t]))

scale_r is 1, or ``row_scale[r]`` (the upstream gradient of row r, reduction "none").

A row whose label is ``ignore_index`` reads nothing: its statistics stay (M, S) = (-inf, 0) and
its gradient row is written as exact zeros. A label outside [0, V) that is not ``ignore_index``
matches no column (no out-of-bounds access): its target stays NaN (loss NaN) and its gradient row
is NaN, the op's unchecked mode (``check_labels=False``) reporting bad labels on the device
without a host sync. A lane that has seen only -inf contributes 0 (a row of only -inf gets
lse = -inf and a NaN loss, as in torch). Logits are read once by each pass and written once by the
gradient pass, in their own dtype; the gradient is rounded once, to that dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.runtime import next_power_of_2


@triton.jit
def _chunk_stats_kernel(
    logits_ptr, labels_ptr, max_ptr, sum_ptr, target_ptr, n_cols, stride_row, v0, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    n_read = tl.where(ignored, 0, n_cols)  # an ignored row reads no logits
    lanes = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, n_read, BLOCK_V):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < n_read, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane of only -inf keeps s = 0
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    chunk_max = tl.max(m, axis=0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    chunk_sum = tl.sum(s * tl.exp(m - shift), axis=0)
    run_max, run_sum = tl.load(max_ptr + row), tl.load(sum_ptr + row)
    new_max = tl.maximum(run_max, chunk_max)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    tl.store(sum_ptr + row, run_sum * tl.exp(run_max - shift) + chunk_sum * tl.exp(chunk_max - shift))
    tl.store(max_ptr + row, new_max)
    col = label - v0
    here = (col >= 0) & (col < n_cols) & (label != ignore_index)
    target = tl.load(row_ptr + col, mask=here, other=0.0).to(tl.float32)
    tl.store(target_ptr + row, target, mask=here)


@triton.jit
def _chunk_grad_kernel(
    logits_ptr, labels_ptr, lse_ptr, row_scale_ptr, n_cols, stride_row, v0, n_vocab, ignore_index,
    HAS_ROW_SCALE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < n_vocab)
    n_read = tl.where(ignored, 0, n_cols)
    lse = tl.load(lse_ptr + row)
    scale = 1.0
    if HAS_ROW_SCALE:
        scale = tl.load(row_scale_ptr + row).to(tl.float32)
    scale = tl.where(in_range, scale, float("nan"))
    lanes = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < n_read, other=0.0).to(tl.float32)
        g = scale * (tl.exp(x - lse) - tl.where(cols + v0 == label, 1.0, 0.0))
        g = tl.where(ignored, 0.0, g)
        tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)


# ----------------------------------------------------------------------------- tuning constants
# Vocab block per loop step. Untuned: 4096 columns (16 fp32 per thread at 8 warps) keeps a lane's
# (max, sum) and one block of logits in registers; wider chunks loop.
MAX_BLOCK_V = 4096
NUM_WARPS = 8


def _block(n_cols: int, block_v: int | None) -> int:
    return block_v if block_v is not None else min(MAX_BLOCK_V, next_power_of_2(n_cols))


# ----------------------------------------------------------------------------- host launchers
def chunk_stats_kernel(logits: torch.Tensor, labels: torch.Tensor, v0: int, row_max: torch.Tensor,
                       row_sum: torch.Tensor, target: torch.Tensor, ignore_index: int,
                       block_v: int | None = None) -> None:
    """Merge the chunk ``logits`` [N, C] (unit column stride; vocab ids v0 .. v0 + C - 1) into the
    running ``row_max``, ``row_sum`` [N] fp32 (start: -inf, 0) and write ``target`` [N] fp32 for
    the rows whose label lies in the chunk. labels [N] int64, contiguous. ``block_v`` (a power of
    two) overrides the vocab block (tests)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    _chunk_stats_kernel[(n_rows,)](
        logits, labels, row_max, row_sum, target, n_cols, logits.stride(0), v0, ignore_index,
        BLOCK_V=_block(n_cols, block_v), num_warps=NUM_WARPS,
    )


def chunk_grad_kernel(logits: torch.Tensor, labels: torch.Tensor, v0: int, n_vocab: int, lse: torch.Tensor,
                      row_scale: torch.Tensor | None, ignore_index: int, block_v: int | None = None) -> None:
    """Overwrite the chunk ``logits`` [N, C] with d loss / d logits (``lse`` [N] fp32 the rows'
    log-sum-exp over all ``n_vocab`` columns), scaled by ``row_scale`` [N] fp32 when given."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    has_scale = row_scale is not None
    _chunk_grad_kernel[(n_rows,)](
        logits, labels, lse, row_scale if has_scale else lse, n_cols, logits.stride(0), v0, n_vocab, ignore_index,
        HAS_ROW_SCALE=has_scale, BLOCK_V=_block(n_cols, block_v), num_warps=NUM_WARPS,
    )
