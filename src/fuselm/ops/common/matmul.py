"""Matmul pieces shared by the GEMM and GEMV kernels (swiglu_mlp, decode_linear, swap_ffn, moe): the
accumulating dot, one K step's operand loads, the grouped tile order of a GEMM grid, the decode
path's token padding and what a TMA descriptor can address."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Decode path for M <= DECODE_MAX_M tokens: the dot's token dimension is padded to 16 or 32.
DECODE_MAX_M = 32
"""The most tokens (rows of x) a decode GEMV kernel takes (swiglu_mlp's ``_decode_gemv_kernel``,
decode_linear): the kernels pad the token dimension of the dot to ``decode_block_m(M)`` and stream
the weight once for all of them (a decode batch of up to 32 rows). Larger M goes to the GEMM
(swiglu_mlp) or the PyTorch path (decode_linear)."""


def decode_block_m(m: int) -> int:
    """The token tile of a decode GEMV for m <= DECODE_MAX_M rows: 16 (the smallest ``tl.dot``
    tile) up to 16 rows, else 32. The weight is read once either way; the wider tile doubles the
    x tile and the accumulator, not the weight traffic."""
    return 16 if m <= 16 else 32


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, accumulated in acc's dtype (fp32 in every caller). IEEE: full fp32 products
    (``input_precision="ieee"``), which the callers pass for fp32 operands; otherwise Triton's
    default precision (tf32 for fp32 operands on tensor cores; 16-bit operands multiply exactly
    into the fp32 accumulator either way)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def load_k_step(a_ptrs, b_ptrs, k, k_left, EVEN_K: tl.constexpr):
    """One K step's operands: A [M, BLOCK_K] at ``a_ptrs`` and B [BLOCK_K, N] at ``b_ptrs``, K
    offsets ``k`` [BLOCK_K]; with ``EVEN_K`` False the columns at k >= ``k_left`` (past K) load as
    zeros, so they add nothing to the dot."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        k_ok = k < k_left
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
    return a, b


@triton.jit
def grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of tile number ``tile``: GROUP_M row blocks walk the same weight
    columns together, so a weight tile is fetched into L2 once per group."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    in_group = tile % (GROUP_M * num_n)
    return first_m + in_group % group_rows, in_group // group_rows


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these 2-D tensors: unit last stride, 16-byte aligned
    base and row stride, 16-bit elements (the TMA kernels' operand type)."""
    return all(t.dim() == 2 and t.dtype in (torch.float16, torch.bfloat16) and t.stride(1) == 1
               and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)
