"""Plain-PyTorch reference for ``qk_norm_rope_kv_write``: the gated-attention decode "prep" of
Qwen3.5, written as the exact composition ``fuselm.models.qwen35.GatedAttention`` runs today
(``_project`` then the KV write of ``decode``), with the same rounding steps:

- split the projection [B, 1, 2 nH hd + 2 nKV hd] into q_gate, k, v; take each head's query half
  (q_gate per head is [query (hd), gate (hd)]);
- zero-centered RMSNorm of q and k per head: ``rms_norm(x, w, eps, 1.0)`` (fp32 statistics,
  ``(x_normed * (1 + w)).to(dtype)``, one rounding; see ``fuselm/ops/rms_norm/naive.py``);
- partial rotary embedding on the first rotary_dim dims (HF ``apply_rotary_pos_emb``,
  rotate-half pairing), in the model dtype: ``x_rot * cos`` rounded, ``cat(-x2, x1) * sin``
  rounded, their sum rounded; the other dims pass through;
- K (normed, rotated) and V (as projected) of row r written to column ``write_column[r]`` of
  row r of the static cache.

``rms_norm`` is fuselm's op, as in the model: on a GPU (or under the Triton interpreter) it is
the rms_norm kernel, otherwise its PyTorch reference.
"""

from __future__ import annotations

import torch

from fuselm.ops.decode_linear.naive import sigmoid_gate_ref
from fuselm.ops.rms_norm import rms_norm


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` on the first ``rotary_dim = cos.shape[-1]`` dims of
    x [..., head_dim] (partial rotary, rotate-half pairing), in the model dtype; the rest passes
    through. The model's prefill uses it too (``GatedAttention._project``)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    rotated = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, x_pass], dim=-1)


def qk_norm_rope_kv_write_ref(
    qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, write_column: torch.Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, write_row: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, num_heads, 1, head_dim] (normed, rotated; contiguous); writes row b's k and v into
    ``key_cache[r, :, write_column[b]]`` / ``value_cache[r, :, write_column[b]]``, r =
    ``write_row[b]`` (a paged cache's page; default b), and k into ``k_out`` [B, nKV, hd] if given.

    qkv: [B, 1, P] or [B, P] (P = 2 nH hd + 2 nKV hd); cos, sin: [B, rotary_dim] (or any
    [B, 1, ..., rotary_dim]); caches [rows, nKV, L, hd]; write_column, write_row: int [B].
    """
    B = qkv.shape[0]
    x = qkv.reshape(B, 1, qkv.shape[-1])
    q_size, kv_size = 2 * num_heads * head_dim, num_kv_heads * head_dim
    q_gate, k, v = x.split([q_size, kv_size, kv_size], -1)
    q, _gate = q_gate.view(B, 1, num_heads, 2 * head_dim).chunk(2, dim=-1)
    q = rms_norm(q, q_norm_weight, eps, 1.0)
    k = rms_norm(k.view(B, 1, num_kv_heads, head_dim), k_norm_weight, eps, 1.0)
    cos = cos.reshape(B, 1, 1, cos.shape[-1])  # the model's [B, 1, 1, rotary_dim]
    sin = sin.reshape(B, 1, 1, sin.shape[-1])
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    v = v.view(B, 1, num_kv_heads, head_dim)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rows = torch.arange(B, device=qkv.device) if write_row is None else write_row
    key_cache[rows, :, write_column] = k[:, :, 0]
    value_cache[rows, :, write_column] = v[:, :, 0]
    if k_out is not None:
        k_out.copy_(k[:, :, 0])
    return q.contiguous()


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged cache [pages, nKV, P, hd] as rows [B, nKV, pages_per_row * P, hd]: row b's column n
    is ``cache[block_table[b, n // P], :, n % P]``."""
    B, pages_per_row = block_table.shape
    _, kv_heads, page_size, head_dim = cache.shape
    return cache[block_table.long()].permute(0, 2, 1, 3, 4).reshape(B, kv_heads, pages_per_row * page_size, head_dim)


def decode_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         kv_lengths: torch.Tensor, scale: float, block_table: torch.Tensor | None = None,
                         gate: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over its cache row's first ``kv_lengths[r]`` columns, in fp32:
    ``softmax(q k^T scale) v`` with GQA (query head h reads kv head h // (nH / nKV)); a row
    with length 0 gets zeros. q [B, nH, hd]; caches [>= B, nKV, L, hd], or with ``block_table``
    [B, pages_per_row] pages [pages, nKV, P, hd] (``gather_pages``); returns [B, nH, hd] in q's
    dtype (one rounding), then with ``gate`` [B, nH, hd] ``sigmoid_gate_ref`` of it (two more)."""
    if block_table is not None:
        key_cache, value_cache = gather_pages(key_cache, block_table), gather_pages(value_cache, block_table)
    B, num_heads, _ = q.shape
    group = num_heads // key_cache.shape[1]
    keys = key_cache[:B].float().repeat_interleave(group, dim=1)  # [B, nH, L, hd]
    values = value_cache[:B].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys) * scale
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < kv_lengths.to(q.device)[:, None]
    weights = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    values = values.masked_fill(~visible[:, None, :, None], 0.0)  # columns past a row's length are never read
    out = torch.einsum("bhl,bhld->bhd", weights, values).to(q.dtype)
    return out if gate is None else sigmoid_gate_ref(out, gate)
