"""Plain-PyTorch reference of ``decode_inputs``, the rotary table it reads (the model's prefill
gathers its rows too: ``rotary_cos_sin`` makes it), and the K/V write targets, which the prefill
shares.

Shapes: B cache rows, D hidden size, R rotary dims, L positions in the rotary table, P pages a slot,
S the page size."""

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
    """What every layer of a decode step needs, for one token per cache row (``decode_inputs``'s
    contract; inactive rows take token 0, the scratch page, no attention and no state slot):
    (x [B, D] = embed[token], cos [B, R], sin [B, R] = rotary[position], write_page [B] int64,
    write_column [B] int64, kv_lengths [B] int64 = position + 1 (0 inactive), state_slots [B] int32 =
    slots (-1 inactive)); the position of row n is ``lengths[n]``; a position outside the table
    gets zero rotary rows."""
    positions = lengths
    write_page, write_column = kv_write_targets(positions, block_table, active, page_size, scratch_page)
    x = F.embedding(torch.where(active, token_ids, 0), embed)
    in_table = (positions >= 0) & (positions < rotary.shape[0])  # (an inactive row's may not be)
    rows = torch.where(in_table[:, None, None], rotary[positions.clamp(0, rotary.shape[0] - 1)], 0)
    return (x, rows[:, 0], rows[:, 1], write_page, write_column, torch.where(active, positions + 1, 0),
            torch.where(active, slots, -1).to(torch.int32))
