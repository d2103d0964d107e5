"""``prefill_attention``: causal GQA attention of a prompt chunk over its rows' paged K/V.

The gated-attention layer of Qwen3.5 writes a chunk's K/V into its rows' pages first, then
attends: query t of row b (position starts[b] + t) to the row's columns 0 .. starts[b] + t,
earlier chunks' and its own. The PyTorch path gathers the whole block-table row of every row
(``gather_pages``) and runs SDPA with a [B, 1, T, pages * P] boolean mask; this op reads each
row's pages in place, only up to its last real position (``kernels.py``), fresh chunks
(starts 0) and continued ones alike. Inference only: no autograd.

Padding queries (t >= lengths[b], right padding) get zeros. ``naive.prefill_attention_ref`` is
the fp32 reference and the CPU fallback (CPU tensors without the Triton interpreter).
"""

from __future__ import annotations

import torch

from fuselm.ops.attention_prefill.kernels import MAX_HEAD_DIM, prefill_attention_kernel
from fuselm.ops.attention_prefill.naive import prefill_attention_ref
from fuselm.runtime import check_finite_float, check_same_device, check_tensor, use_triton

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(name: str, t, shape: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected an int32/int64 tensor {shape}, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32/int64 tensor {shape}, got dtype {t.dtype}")


def prefill_attention(q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                      block_table: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of T chunk queries per row over the row's paged cache columns.

    Args:
        q: [B, nH, T, hd], fp32/fp16/bf16, any strides with a contiguous last dim (the model's
            ``[B, T, nH, hd].transpose(1, 2)`` is read in place). hd <= 256.
        key_pages, value_pages: [pages, nKV, P, hd] in q's dtype, last dim contiguous; P a power
            of two >= 16; nH a multiple of nKV (query head h reads kv head h // (nH / nKV)). The
            chunk's own K/V must already be in the pages.
        block_table: int32/int64 [B, pages_per_row]: row b's column n is at page
            ``block_table[b, n // P]``, slot n % P. Entries holding only columns at or past
            starts[b] + lengths[b] are never read (they may point at a scratch page); values
            in [0, pages) otherwise (not checked: read on the device).
        starts: int32/int64 [B]: tokens of the row already in the cache before this chunk.
        lengths: int32/int64 [B]: real tokens of the row in this chunk, in [0, T] (rows are
            right-padded to T; a row of length 0 gets zeros).
            starts[b] + lengths[b] <= pages_per_row * P. The values are checked on the host
            for CPU tensors only (no sync on a GPU).
        scale: on q k^T.
    Returns:
        [B, nH, T, hd] in q's dtype: query t (t < lengths[b]) attends to columns
        0 .. starts[b] + t; padding queries (t >= lengths[b]) are zeros. The tensor is the
        transposed view of a contiguous [B, T, nH, hd] buffer (``out.transpose(1, 2)`` is
        contiguous). fp32 softmax, one rounding of the output (``kernels.py``). CUDA-graph safe.
    """
    for name, t in (("q", q), ("key_pages", key_pages), ("value_pages", value_pages)):
        check_tensor(name, t)
    _check_index("block_table", block_table, "[B, pages_per_row]")
    _check_index("starts", starts, "[B]")
    _check_index("lengths", lengths, "[B]")
    check_same_device(q=q, key_pages=key_pages, value_pages=value_pages, block_table=block_table, starts=starts,
                      lengths=lengths)
    scale = check_finite_float("scale", scale)
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, nH, T, hd], got {tuple(q.shape)}")
    B, num_heads, T, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {head_dim} exceeds {MAX_HEAD_DIM}")
    if key_pages.dim() != 4 or key_pages.shape[3] != head_dim or key_pages.shape[0] < 1:
        raise ValueError(f"key_pages: expected [pages, nKV, P, {head_dim}] (head_dim of q), got "
                         f"{tuple(key_pages.shape)}")
    if value_pages.shape != key_pages.shape:
        raise ValueError(f"value_pages: shape {tuple(value_pages.shape)} differs from key_pages "
                         f"{tuple(key_pages.shape)}")
    num_kv_heads, page = key_pages.shape[1], key_pages.shape[2]
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} heads is not a multiple of the pages' {num_kv_heads} kv heads")
    if page < 16 or page & (page - 1):
        raise ValueError(f"key_pages: the page size (dim 2) must be a power of two >= 16, got {page}")
    for name, t in (("key_pages", key_pages), ("value_pages", value_pages)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    for name, t in (("q", q), ("key_pages", key_pages), ("value_pages", value_pages)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name}: the last dim must be contiguous")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table: expected [B = {B}, pages_per_row], got {tuple(block_table.shape)}")
    for name, t in (("starts", starts), ("lengths", lengths)):
        if t.shape != (B,):
            raise ValueError(f"{name}: expected [B] = ({B},), got {tuple(t.shape)}")
    columns = block_table.shape[1] * page
    if not q.is_cuda:  # host checks only where they cost no sync
        if not bool(((lengths >= 0) & (lengths <= T)).all()):
            raise ValueError(f"lengths: values must be in [0, T = {T}]")
        if not bool(((starts >= 0) & (starts + lengths <= columns)).all()):
            raise ValueError(f"starts: values must be >= 0 with starts + lengths <= {columns} "
                             "(the block table's columns)")
    if B == 0 or T == 0 or num_heads == 0 or head_dim == 0:
        return torch.empty(B, T, num_heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    if not use_triton(q):  # the reference, in the kernel's output layout
        out = torch.empty(B, T, num_heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        return out.copy_(prefill_attention_ref(q, key_pages, value_pages, block_table, starts, lengths, scale))
    starts, lengths = starts.contiguous(), lengths.contiguous()  # the kernel indexes them densely
    return prefill_attention_kernel(q, key_pages, value_pages, block_table, starts, lengths, scale)
