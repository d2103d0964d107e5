"""The Triton kernel of ``decode_inputs``: one launch for what ~20 small PyTorch kernels did at the
start of every decode step (H100, 9B: NOTES 77)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_inputs_kernel(
    ids_ptr, lengths_ptr, active_ptr, slots_ptr, table_ptr, embed_ptr, rotary_ptr,
    x_ptr, cos_ptr, sin_ptr, page_ptr, column_ptr, kv_len_ptr, state_slot_ptr,
    VOCAB, D, L, PAGES, stride_table, stride_embed, scratch_page,
    PAGE_SIZE: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B, cdiv(D, BLOCK_D)): program (n, j) copies columns j BLOCK_D .. of row n's token
    embedding; program (n, 0) also writes the row's rotary rows and its scalars. Reads only (no
    program writes what another reads), so the grid needs no order."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    active = tl.load(active_ptr + n) != 0
    token = tl.where(active, tl.load(ids_ptr + n), 0)
    real = (token >= 0) & (token < VOCAB)  # the sampler's ids always are; others read as zeros
    cols = j * BLOCK_D + tl.arange(0, BLOCK_D)
    # scalar conditions folded into the masks' bounds
    row = tl.load(embed_ptr + token * stride_embed + cols, mask=cols < tl.where(real, D, 0), other=0.0)
    tl.store(x_ptr + n * D + cols, row, mask=cols < D)
    if j == 0:
        position = tl.load(lengths_ptr + n)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < tl.where((position >= 0) & (position < L), R, 0)
        rotary = rotary_ptr + position * 2 * R
        tl.store(cos_ptr + n * R + r, tl.load(rotary + r, mask=r_ok, other=0.0), mask=r < R)
        tl.store(sin_ptr + n * R + r, tl.load(rotary + R + r, mask=r_ok, other=0.0), mask=r < R)
        page_index = tl.minimum(position // PAGE_SIZE, PAGES - 1)
        page = tl.load(table_ptr + n * stride_table + page_index)
        tl.store(page_ptr + n, tl.where(active, page, scratch_page))
        tl.store(column_ptr + n, tl.where(active, position % PAGE_SIZE, 0))
        tl.store(kv_len_ptr + n, tl.where(active, position + 1, 0))
        tl.store(state_slot_ptr + n, tl.where(active, tl.load(slots_ptr + n), -1))
