"""Plain-PyTorch reference of ``decode_inputs``, the rotary table it reads (the model's prefill
gathers its rows too: ``rotary_cos_sin`` makes it), and the K/V write targets, which the prefill
shares.

Shapes: B decode rows, C cache slots, D hidden size, R rotary dims, L positions in the rotary table,
P pages a slot, S the page size."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., R] for integer positions [...] and ``inv_freq`` [R / 2] fp32. The angle is one
    fp32 product (as HF's fp32 ``inv_freq @ position_ids``), cos/sin in fp32, then rounded to
    ``dtype`` as HF's ``Qwen3_5TextRotaryEmbedding`` returns them. Text-only M-RoPE: the T/H/W
    position rows are equal, so the section interleaving changes nothing."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_table(length: int, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[L, 2, R]: ``rotary_cos_sin`` of positions 0 .. L - 1 (row p holds p's cos, then its sin), so
    prefill and decode steps gather their rows' values instead of computing them (the same bits)."""
    cos, sin = rotary_cos_sin(torch.arange(length, device=inv_freq.device), inv_freq, dtype)
    return torch.stack([cos, sin], dim=1)


def kv_write_targets(positions: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor, page_size: int,
                     scratch_page: int):
    """(page, column) of each token's K/V: slot p % S of its row's page p // S (clamped to the
    last of the row's P pages), the page from ``pages`` (block-table rows [rows, P]), for
    ``positions`` [rows] or [rows, T]; ``scratch_page``, column 0, where ``valid`` (like positions)
    is False. Device ops only (no host sync)."""
    page_index = (positions // page_size).clamp(max=pages.shape[1] - 1)
    page = pages.gather(1, page_index.view(pages.shape[0], -1)).view(positions.shape)
    return torch.where(valid, page, scratch_page), torch.where(valid, positions % page_size, 0)


def decode_inputs_ref(token_ids, lengths, active, slots, block_table, embed, rotary, page_size, scratch_page):
    """What every layer of a decode step needs, for one token per row n of slot ``slots[n]``
    (``decode_inputs``'s contract; ``token_ids``, ``lengths``, ``active`` [C] and ``block_table``
    [C, P] per slot; an inactive row, or a slot outside [0, C), takes token 0, the scratch page,
    no attention and no state slot): (x [B, D] = embed[token], cos [B, R], sin [B, R] =
    rotary[position], write_page [B] int64, write_column [B] int64, kv_lengths [B] int64 =
    position + 1 (0 inactive), state_slots [B] int32 = slots (-1 inactive), positions [B] int64 =
    the slot's length (0 outside [0, C)), pages [B, P] int64 = the slot's block-table row (all
    scratch_page inactive)); a position outside the rotary table gets zero rotary rows."""
    held = (slots >= 0) & (slots < lengths.shape[0])
    slot = torch.where(held, slots, 0).long()
    active = held & active[slot]
    positions = torch.where(held, lengths[slot], 0)
    pages = torch.where(active[:, None], block_table[slot], scratch_page)
    write_page, write_column = kv_write_targets(positions, pages, active, page_size, scratch_page)
    x = F.embedding(torch.where(active, token_ids[slot], 0), embed)
    in_table = (positions >= 0) & (positions < rotary.shape[0])  # (an inactive row's may not be)
    rows = torch.where(in_table[:, None, None], rotary[positions.clamp(0, rotary.shape[0] - 1)], 0)
    return (x, rows[:, 0], rows[:, 1], write_page, write_column, torch.where(active, positions + 1, 0),
            torch.where(active, slot, -1).to(torch.int32), positions, pages)
