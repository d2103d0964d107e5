"""``qk_norm_rope_kv_write``: the gated-attention decode "prep" of Qwen3.5 in one launch.

After the qkv GEMM of a decode step (one token per cache row), the PyTorch path runs about 16
small kernels per attention layer: split, per-head query half, zero-centered q/k RMSNorm,
partial rotary embedding, transposes, the indexed K/V cache write. This op does all of it in one
Triton kernel (``kernels.py``), bit-identical to that composition (``naive.py``). Inference
only: no autograd.
"""

from __future__ import annotations

import torch

from fuselm.ops.attention_decode.kernels import qk_norm_rope_kv_write_kernel
from fuselm.ops.attention_decode.naive import qk_norm_rope_kv_write_ref
from fuselm.ops.common.rows import MAX_COLS
from fuselm.runtime import (
    check_finite_float, check_match, check_positive_int, check_same_device, check_tensor, use_triton,
)


def _rows(name: str, t: torch.Tensor, B: int) -> torch.Tensor:
    """[B, 1, ..., 1, N] as a [B, N] view (a copy only when the last dim is strided)."""
    if t.dim() < 2 or t.shape[0] != B or any(s != 1 for s in t.shape[1:-1]):
        raise ValueError(f"{name}: expected [B, N] or [B, 1, ..., N] with B = {B}, got {tuple(t.shape)}")
    t = t.reshape(B, t.shape[-1])  # a view: the middle dims have size 1
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _check(qkv, q_norm_weight, k_norm_weight, cos, sin, key_cache, value_cache, write_column,
           num_heads, num_kv_heads, head_dim, eps, q_out, write_row):
    num_heads = check_positive_int("num_heads", num_heads)
    num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim > MAX_COLS:
        raise ValueError(f"head_dim: {head_dim} exceeds the {MAX_COLS} columns a program holds")
    eps = check_finite_float("eps", eps, nonnegative=True)
    for name, t in (("qkv", qkv), ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight),
                    ("cos", cos), ("sin", sin), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, t)
    if not isinstance(write_column, torch.Tensor):
        raise TypeError(f"write_column: expected a torch.Tensor, got {type(write_column).__name__}")
    if q_out is not None:
        check_tensor("q_out", q_out)
    check_same_device(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos=cos, sin=sin,
                      key_cache=key_cache, value_cache=value_cache, write_column=write_column, q_out=q_out)
    dtype = qkv.dtype
    width = 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim
    if not (qkv.dim() == 2 or (qkv.dim() == 3 and qkv.shape[1] == 1)) or qkv.shape[-1] != width:
        raise ValueError(f"qkv: expected [B, 1, P] or [B, P] with P = 2 num_heads head_dim + 2 num_kv_heads "
                         f"head_dim = {width}, got {tuple(qkv.shape)}")
    B = qkv.shape[0]
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (head_dim,):
            raise ValueError(f"{name}: expected [head_dim] = ({head_dim},), got {tuple(w.shape)}")
    cos, sin = _rows("cos", cos, B), _rows("sin", sin, B)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != dtype:
            raise TypeError(f"{name}: dtype {t.dtype} does not match qkv {dtype}")
    check_match("sin", sin, "cos", cos, dtype=False)
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2:
        raise ValueError(f"cos: rotary_dim (last dim) must be even, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"cos: rotary_dim {rotary_dim} exceeds head_dim {head_dim}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        min_rows = B if write_row is None else 1
        if c.dim() != 4 or c.shape[0] < min_rows or c.shape[1] != num_kv_heads or c.shape[3] != head_dim or c.shape[2] < 1:
            raise ValueError(f"{name}: expected [rows >= {min_rows}, num_kv_heads = {num_kv_heads}, L, "
                             f"head_dim = {head_dim}], got {tuple(c.shape)}")
        if c.dtype != dtype:
            raise TypeError(f"{name}: dtype {c.dtype} does not match qkv {dtype}")
        if c.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (it is written in place)")
    check_match("value_cache", value_cache, "key_cache", key_cache, dtype=False)
    if write_column.shape != (B,) or write_column.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"write_column: expected an int64 (or int32) tensor [B] = ({B},), "
                         f"got {write_column.dtype} {tuple(write_column.shape)}")
    if write_column.device.type == "cpu" and B and not bool(
            ((write_column >= 0) & (write_column < key_cache.shape[2])).all()):  # free on the CPU; trusted on a GPU
        raise ValueError(f"write_column: every column must be in [0, L = {key_cache.shape[2]})")
    if write_row is not None:
        if not isinstance(write_row, torch.Tensor) or write_row.shape != (B,) or write_row.dtype not in (torch.int64,
                                                                                                       torch.int32):
            raise ValueError(f"write_row: expected None or an int64 (or int32) tensor [B] = ({B},)")
        check_same_device(qkv=qkv, write_row=write_row)
        if write_row.device.type == "cpu" and B and not bool(((write_row >= 0) & (write_row < key_cache.shape[0])).all()):
            raise ValueError(f"write_row: every row must be in [0, {key_cache.shape[0]}) (the cache's rows)")
    shape = (B, num_heads, 1, head_dim)
    if q_out is not None:
        if q_out.shape != shape:
            raise ValueError(f"q_out: expected [B, num_heads, 1, head_dim] = {shape}, got {tuple(q_out.shape)}")
        if q_out.dtype != dtype:
            raise TypeError(f"q_out: dtype {q_out.dtype} does not match qkv {dtype}")
        if not q_out.is_contiguous():
            raise ValueError("q_out: must be contiguous")
    else:
        q_out = torch.empty(shape, dtype=dtype, device=qkv.device)
    return cos, sin, eps, q_out


def qk_norm_rope_kv_write(
    qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, write_column: torch.Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, q_out: torch.Tensor | None = None,
    write_row: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated-attention decode prep (Qwen3.5): q/k zero-centered RMSNorm per head, partial RoPE,
    K/V cache write, in one launch; bit-identical to ``naive.qk_norm_rope_kv_write_ref`` (the
    PyTorch path of ``GatedAttention``).

    Args:
        qkv: [B, 1, P] or [B, P] (row stride allowed, last dim contiguous), the qkv projection,
            P = 2 nH hd + 2 nKV hd: q_gate (per head hd query values, then hd gate values),
            k (nKV hd), v (nKV hd). fp32/fp16/bf16, the model dtype. The gate half is not read.
        q_norm_weight, k_norm_weight: [head_dim], zero-centered (the norm multiplies by 1 + w).
        cos, sin: [B, rotary_dim] (or [B, 1, ..., rotary_dim]; row stride allowed) in qkv's
            dtype; rotary_dim even, <= head_dim: the first rotary_dim dims of each q/k head
            rotate (rotate-half pairing), the rest pass through.
        key_cache, value_cache: [rows, nKV, L, hd] in qkv's dtype (any strides, last dim
            contiguous), written in place: batch row b's k (normed, rotated) and v (as is) go to
            cache row ``write_row[b]`` (default b: then rows >= B), column ``write_column[b]``;
            nothing else changes. A paged cache passes its pages [pages, nKV, page_size, hd].
        write_column: int64 (or int32) [B], values in [0, L) (checked on the CPU only: no host
            sync on a GPU). Every row writes.
        num_heads, num_kv_heads, head_dim: nH, nKV, hd.
        eps: the RMSNorm epsilon.
        q_out: optional contiguous [B, nH, 1, hd] buffer in qkv's dtype for q (no allocation,
            CUDA-graph safe).
        write_row: optional int64 (or int32) [B], the cache row (page) of each batch row; values
            in [0, rows) (checked on the CPU only).
        k_out: optional contiguous [B, nKV, hd] buffer in qkv's dtype: also receives k (normed,
            rotated; every row, whatever its column), e.g. for a prompt chunk's attention within
            itself (a prefill runs this op over its tokens as rows).
    Returns:
        q [B, nH, 1, hd], contiguous, normed and rotated (``q_out`` when given).
    """
    cos, sin, eps, q_out = _check(qkv, q_norm_weight, k_norm_weight, cos, sin, key_cache, value_cache, write_column,
                                  num_heads, num_kv_heads, head_dim, eps, q_out, write_row)
    if k_out is not None:
        check_tensor("k_out", k_out)
        check_same_device(qkv=qkv, k_out=k_out)
        shape = (qkv.shape[0], num_kv_heads, head_dim)
        if k_out.shape != shape or k_out.dtype != qkv.dtype or not k_out.is_contiguous():
            raise ValueError(f"k_out: expected a contiguous {qkv.dtype} tensor [B, num_kv_heads, head_dim] = "
                             f"{shape}, got {k_out.dtype} {tuple(k_out.shape)}")
    B = qkv.shape[0]
    if B == 0:
        return q_out
    if not use_triton(qkv):
        with torch.no_grad():
            return q_out.copy_(qk_norm_rope_kv_write_ref(
                qkv, q_norm_weight, k_norm_weight, cos, sin, key_cache, value_cache, write_column,
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps, write_row=write_row,
                k_out=k_out))
    rows = _rows("qkv", qkv, B)  # [B, 1, P] -> [B, P]: a view
    qkv_norm_weights = [w.contiguous() for w in (q_norm_weight, k_norm_weight)]
    qk_norm_rope_kv_write_kernel(rows, *qkv_norm_weights, cos, sin, key_cache, value_cache, write_column, write_row,
                                 q_out, num_heads, num_kv_heads, head_dim, eps, k_out)
    return q_out
