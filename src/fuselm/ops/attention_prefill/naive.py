"""Plain-PyTorch reference for ``prefill_attention``: causal attention of a prompt chunk's queries
over their rows' paged K/V (the chunk's own K/V already written into the pages).

Shapes: q [B, nH, T, hd] (any strides); key_pages / value_pages [pages, nKV, P, hd];
block_table [B, pages_per_row] (row b's column n is ``pages[block_table[b, n // P], :, n % P]``,
``gather_pages``); starts, lengths [B] int. Query t of row b sits at position
p = starts[b] + t and attends to columns 0 .. p; query rows t >= lengths[b] (right padding) get
zeros. GQA: query head h reads kv head h // (nH / nKV) (``repeat_interleave``).

Numerics: fp32 scores, softmax and weighted sum (float64 for float64 inputs: the exact
function), one rounding to q's dtype. Columns a real query cannot see are zeroed before they
enter the sums, so NaN or garbage past a row's last real position (unused pages, the scratch
page) never reaches the result.
"""

from __future__ import annotations

import torch

from fuselm.ops.attention_decode import gather_pages
from fuselm.ops.common.precision import work_dtype


def prefill_attention_ref(q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                          block_table: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """[B, nH, T, hd] in q's dtype (contiguous): ``softmax(q k^T scale + causal mask) v`` per row
    over its gathered pages, zeros for padding queries (t >= lengths[b])."""
    B, num_heads, T, _ = q.shape
    dtype = work_dtype(q)
    group = num_heads // key_pages.shape[1]
    keys = gather_pages(key_pages, block_table).to(dtype).repeat_interleave(group, dim=1)  # [B, nH, L, hd]
    values = gather_pages(value_pages, block_table).to(dtype).repeat_interleave(group, dim=1)
    L = keys.shape[2]
    t = torch.arange(T, device=q.device)
    positions = starts.to(q.device, torch.int64)[:, None] + t[None, :]  # [B, T]
    real = t[None, :] < lengths.to(q.device, torch.int64)[:, None]  # [B, T]
    visible = (torch.arange(L, device=q.device)[None, None, :] <= positions[:, :, None]) & real[:, :, None]
    visible = visible[:, None]  # [B, 1, T, L]
    # Columns no real query sees (past the row's last real position) never enter the sums.
    seen = visible.any(dim=2)[..., None]  # [B, 1, L, 1]
    keys, values = keys.masked_fill(~seen, 0.0), values.masked_fill(~seen, 0.0)
    scores = torch.einsum("bhtd,bhld->bhtl", q.to(dtype), keys) * scale
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhtl,bhld->bhtd", weights, values)
    return out.to(q.dtype)
