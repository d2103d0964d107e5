"""Triton kernel and host launcher for the per-row cross-entropy of one chunk of logits.

The op (``op.py``) forms a chunk's logits [C, V] with one GEMM into a workspace; this kernel then
reads each row of that workspace and, per row r with label t (all math in fp32 registers):

    pass 1 (online over vocab blocks of BLOCK_V):  M = max_v x_v,  S = sum_v exp(x_v - M)
           lse = M + log(S),  loss_r = lse - x_t
    pass 2 (WRITE_GRAD):  x_v <- round(scale_r * (exp(x_v - lse) - [v == t]))   in place

scale_r is 1, or ``row_scale[r]`` (HAS_ROW_SCALE: the backward of reduction="none", the upstream
gradient of row r). A row whose label is ``ignore_index`` reads nothing: loss 0, gradient row 0
(exact zeros, whatever its logits hold). A row whose label lies outside [0, V) and is not
``ignore_index`` reads no target (no out-of-bounds access) and gets a NaN loss and a NaN gradient
row: the op's unchecked mode (``check_labels=False``) reports bad labels on the device this way,
without a host sync.

Pass 1 keeps a running (max, sum) per lane and combines the lanes once at the end; a lane that has
only seen -inf contributes 0 (a row of only -inf gets lse = -inf and a NaN loss, as in torch).
Logits are read twice (once per pass) and written once, in their own dtype; the gradient is
rounded once, to that dtype. Launch: one program per row of the chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.runtime import next_power_of_2


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, labels_ptr, loss_ptr, row_scale_ptr,
    n_vocab, stride_row, ignore_index,
    HAS_ROW_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < n_vocab)
    # An ignored row reads no logits: its loops see an empty vocabulary.
    n_read = tl.where(ignored, 0, n_vocab)
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: lane-wise online max / sum of exp.
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, n_read, BLOCK_V):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < n_read, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # A lane that has seen only -inf keeps s = 0 (shifting by 0 avoids -inf - -inf).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(s * tl.exp(m - shift), axis=0)
    lse = tl.where(ignored, 0.0, row_max + tl.log(tl.where(ignored, 1.0, total)))

    target = tl.load(row_ptr + label, mask=in_range & (label != ignore_index), other=0.0).to(tl.float32)
    loss = tl.where(ignored, 0.0, tl.where(in_range, lse - target, float("nan")))
    tl.store(loss_ptr + row, loss)

    if WRITE_GRAD:
        scale = 1.0
        if HAS_ROW_SCALE:
            scale = tl.load(row_scale_ptr + row).to(tl.float32)
        scale = tl.where(in_range, scale, float("nan"))
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + lanes
            col_mask = cols < n_vocab
            x = tl.load(row_ptr + cols, mask=cols < n_read, other=0.0).to(tl.float32)
            g = scale * (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0))
            g = tl.where(ignored, 0.0, g)
            tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------- tuning constants
# Vocab block per loop step. Untuned: 4096 columns (16 fp32 per thread at 8 warps) keeps a lane's
# (max, sum) and one block of logits in registers; rows wider than this loop.
MAX_BLOCK_V = 4096
NUM_WARPS = 8


# ----------------------------------------------------------------------------- host launcher
def cross_entropy_rows_kernel(
    logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, row_scale: torch.Tensor | None,
    ignore_index: int, write_grad: bool, block_v: int | None = None,
) -> torch.Tensor:
    """Launch on a [C, V] logits view (unit column stride), labels [C] int64 (contiguous), loss
    [C] fp32 (written). ``write_grad``: overwrite ``logits`` with d loss_r / d logits, scaled by
    ``row_scale`` [C] fp32 when given. ``block_v`` (a power of two) overrides the vocab block
    (tests). Returns ``loss``."""
    n_rows, n_vocab = logits.shape
    if n_rows == 0:
        return loss
    if block_v is None:
        block_v = min(MAX_BLOCK_V, next_power_of_2(n_vocab))
    has_scale = row_scale is not None
    _cross_entropy_rows_kernel[(n_rows,)](
        logits, labels, loss, row_scale if has_scale else loss,
        n_vocab, logits.stride(0), ignore_index,
        HAS_ROW_SCALE=has_scale, WRITE_GRAD=write_grad, BLOCK_V=block_v, num_warps=NUM_WARPS,
    )
    return loss
