"""The Triton kernel of ``decode_inputs``: one launch for what ~20 small PyTorch kernels did at the
start of every decode step (H100, 9B: NOTES 77), reading each row's slot through the row -> slot
table."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_inputs_kernel(
    ids_ptr, lengths_ptr, active_ptr, slots_ptr, table_ptr, embed_ptr, rotary_ptr,
    x_ptr, cos_ptr, sin_ptr, page_ptr, column_ptr, kv_len_ptr, state_slot_ptr, positions_ptr, pages_ptr,
    SLOTS, VOCAB, D, L, PAGES, stride_table, stride_embed, scratch_page,
    PAGE_SIZE: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Grid (B, cdiv(D, BLOCK_D)): program (n, j) copies columns j BLOCK_D .. of row n's token
    embedding; program (n, 0) also writes the row's rotary rows, its scalars and its block-table
    row. Row n reads slot ``slots[n]``'s token, length, flag and pages (a slot outside [0, SLOTS)
    reads as inactive). Reads only (no program writes what another reads), so the grid needs no
    order."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    held = (slot >= 0) & (slot < SLOTS)
    slot = tl.where(held, slot, 0)
    active = held & (tl.load(active_ptr + slot) != 0)
    token = tl.where(active, tl.load(ids_ptr + slot), 0)
    real = (token >= 0) & (token < VOCAB)  # the sampler's ids always are; others read as zeros
    cols = j * BLOCK_D + tl.arange(0, BLOCK_D)
    # scalar conditions folded into the masks' bounds
    row = tl.load(embed_ptr + token * stride_embed + cols, mask=cols < tl.where(real, D, 0), other=0.0)
    tl.store(x_ptr + n * D + cols, row, mask=cols < D)
    if j == 0:
        position = tl.where(held, tl.load(lengths_ptr + slot), 0)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < tl.where((position >= 0) & (position < L), R, 0)
        rotary = rotary_ptr + position * 2 * R
        tl.store(cos_ptr + n * R + r, tl.load(rotary + r, mask=r_ok, other=0.0), mask=r < R)
        tl.store(sin_ptr + n * R + r, tl.load(rotary + R + r, mask=r_ok, other=0.0), mask=r < R)
        page_index = tl.minimum(tl.maximum(position // PAGE_SIZE, 0), PAGES - 1)  # in the row, whatever the slot
        page = tl.load(table_ptr + slot * stride_table + page_index)
        tl.store(page_ptr + n, tl.where(active, page, scratch_page))
        tl.store(column_ptr + n, tl.where(active, position % PAGE_SIZE, 0))
        tl.store(kv_len_ptr + n, tl.where(active, position + 1, 0))
        tl.store(state_slot_ptr + n, tl.where(active, slot, -1).to(tl.int32))
        tl.store(positions_ptr + n, position)
        for p0 in range(0, PAGES, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            pages = tl.load(table_ptr + slot * stride_table + p, mask=p < tl.where(active, PAGES, 0),
                            other=scratch_page)
            tl.store(pages_ptr + n * PAGES + p, pages, mask=p < PAGES)
