"""``decode_inputs``: the per-row inputs of a decode step (token embedding, rotary cos/sin, where the
token's K/V go, how far it attends, its state slot, position and block-table row), each row through
the row -> slot table, checked, in one Triton launch or the reference.

Numerics: copies and integer arithmetic only. The rotary values are rows of a table that
``rotary_table`` computes with the prefill's own function, so decode and prefill use the same bits.
"""

from __future__ import annotations

import torch

from fuselm.ops.decode_inputs.kernels import decode_inputs_kernel
from fuselm.ops.decode_inputs.naive import decode_inputs_ref
from fuselm.runtime import cdiv, check_positive_int, check_same_device, check_tensor, next_power_of_2, use_triton

BLOCK_D = 1024  # embedding columns a program copies
BLOCK_PAGES = 1024  # block-table entries a row's program copies at a time


def decode_inputs(token_ids: torch.Tensor, lengths: torch.Tensor, active: torch.Tensor, slots: torch.Tensor,
                  block_table: torch.Tensor, embed: torch.Tensor, rotary: torch.Tensor, *, page_size: int,
                  scratch_page: int):
    """One decode token for each row of a decode batch: what every layer of the step needs. Row n
    decodes cache slot ``slots[n]`` (the row -> slot table: a batch reads its requests' state
    where it lies, so a request that joins or leaves changes the table, and no state moves).

    Args:
        token_ids: [C] int64, each slot's next token (any value on an inactive slot).
        lengths: [C] int64, each slot's position (tokens already in its cache), < L on active slots.
        active: [C] bool, the slots that decode.
        slots: [B] int64, each row's slot: distinct, in [0, C) (one outside reads as inactive).
        block_table: [C, P] int64, each slot's K/V pages (page p // S holds position p).
        embed: [V, D] the embedding table (its dtype is the model's).
        rotary: [L, 2, R] in embed's dtype, ``rotary_table``'s cos and sin rows by position.
        page_size: S, a power of two; scratch_page: where inactive rows write their K/V.
    Returns:
        (x [B, D], cos [B, R], sin [B, R], write_page [B] int64, write_column [B] int64,
        kv_lengths [B] int64, state_slots [B] int32, positions [B] int64, pages [B, P] int64), each
        row's: ``decode_inputs_ref``'s contract. Inactive rows take token 0, the scratch page's
        column 0, kv_length 0, slot -1 and a block-table row of scratch pages; a position outside
        [0, L) gets zero rotary rows. No host sync, fixed shapes (CUDA-graph safe). An active
        slot's token id outside [0, V) (the sampler never gives one) reads a zero row in the
        kernel; the PyTorch path (CPU without the interpreter) raises.
    """
    for name, t in (("token_ids", token_ids), ("lengths", lengths), ("slots", slots), ("block_table", block_table)):
        check_tensor(name, t, (torch.int64,))
    check_tensor("active", active, (torch.bool,))
    check_tensor("embed", embed)
    check_tensor("rotary", rotary)
    check_same_device(token_ids=token_ids, lengths=lengths, active=active, slots=slots, block_table=block_table,
                      embed=embed, rotary=rotary)
    C = token_ids.shape[0] if token_ids.dim() == 1 else -1
    for name, t in (("token_ids", token_ids), ("lengths", lengths), ("active", active)):
        if t.shape != (max(C, 0),):
            raise ValueError(f"{name}: expected a [C] tensor (one per cache slot), C = token_ids' length, "
                             f"got {tuple(t.shape)}")
    if slots.dim() != 1:
        raise ValueError(f"slots: expected a [B] tensor (each row's slot), got {tuple(slots.shape)}")
    B = slots.shape[0]
    # read only: a strided [C] view is copied (a no-op for the model's contiguous tensors)
    token_ids, lengths, active, slots = (t.contiguous() for t in (token_ids, lengths, active, slots))
    if block_table.dim() != 2 or block_table.shape[0] != C or block_table.shape[1] < 1 or block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected [{C}, pages] with contiguous rows, got {tuple(block_table.shape)}")
    if embed.dim() != 2 or not embed.is_contiguous():
        raise ValueError(f"embed: expected a contiguous [vocab, hidden] table, got {tuple(embed.shape)}")
    if rotary.dim() != 3 or rotary.shape[1] != 2 or rotary.dtype != embed.dtype or not rotary.is_contiguous():
        raise ValueError(f"rotary: expected a contiguous [positions, 2, rotary_dim] table in {embed.dtype}, "
                         f"got {tuple(rotary.shape)} {rotary.dtype}")
    page_size = check_positive_int("page_size", page_size)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size: expected a power of two, got {page_size}")
    if not isinstance(scratch_page, int) or isinstance(scratch_page, bool) or scratch_page < 0:
        raise ValueError(f"scratch_page: expected a non-negative int, got {scratch_page!r}")
    if not use_triton(embed):
        return decode_inputs_ref(token_ids, lengths, active, slots, block_table, embed, rotary, page_size,
                                 scratch_page)
    D, R, P = embed.shape[1], rotary.shape[2], block_table.shape[1]
    x = torch.empty(B, D, dtype=embed.dtype, device=embed.device)
    cos = torch.empty(B, R, dtype=embed.dtype, device=embed.device)
    sin = torch.empty_like(cos)
    write_page, write_column, kv_lengths, positions = (torch.empty_like(slots) for _ in range(4))
    state_slots = torch.empty(B, dtype=torch.int32, device=slots.device)
    pages = torch.empty(B, P, dtype=torch.int64, device=slots.device)
    if B:
        block_d = min(BLOCK_D, next_power_of_2(D))
        decode_inputs_kernel[(B, cdiv(D, block_d))](
            token_ids, lengths, active, slots, block_table, embed, rotary,
            x, cos, sin, write_page, write_column, kv_lengths, state_slots, positions, pages,
            C, embed.shape[0], D, rotary.shape[0], P, block_table.stride(0), embed.stride(0),
            scratch_page, PAGE_SIZE=page_size, R=R, BLOCK_R=next_power_of_2(R), BLOCK_D=block_d,
            BLOCK_P=min(BLOCK_PAGES, next_power_of_2(P)))
    return x, cos, sin, write_page, write_column, kv_lengths, state_slots, positions, pages
