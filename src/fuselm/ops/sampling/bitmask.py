"""``apply_token_bitmask``: structured outputs' allowed-token masks on a batch's logits, in place.

A grammar (``fuselm.engine.structured_outputs``) says, before each draw of a constrained request,
which tokens may come next as a bitmask of int32 words: token v is allowed when bit v % 32 of word
v // 32 is set (the layout llguidance and xgrammar write). For mask i of ``bitmask`` [m, W] and
its row ``rows[i]`` of ``logits`` [n, V]:

    logits[rows[i], v] = -inf    where v is not allowed (tokens v >= 32 W are not)

and every other value, and every row not listed, stays as it was (exact: only -inf is written).
The sampler then draws among the allowed tokens (a row left with none would draw an arbitrary id:
the grammar always allows one, an eos id when it is complete).

One launch, a program per (mask, BLOCK tokens): it reads BLOCK / 32 words and writes the
disallowed tokens' logits. No host sync, static shapes (graph-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.sampling.naive import apply_token_bitmask_ref
from fuselm.runtime import KERNEL_DTYPES, cdiv, check_same_device, check_tensor, use_triton

BLOCK = 4096  # tokens a program


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, n_vocab, n_words, stride_row, stride_mask,
                                BLOCK: tl.constexpr):
    mask_index = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < n_vocab
    words = cols // 32
    word = tl.load(bitmask_ptr + mask_index.to(tl.int64) * stride_mask + words, mask=in_vocab & (words < n_words),
                   other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    row = tl.load(rows_ptr + mask_index).to(tl.int64)
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_row + cols, minus_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Set ``logits`` [n, V] (fp32/fp16/bf16, the last dim contiguous) to -inf in row ``rows[i]``
    ([m] int64, distinct, in [0, n)) wherever ``bitmask[i]`` ([m, W] int32, contiguous rows) does
    not allow the token (module docstring); in place, returns ``logits``. Not checked (a device
    read): rows in range and distinct."""
    check_tensor("logits", logits, KERNEL_DTYPES)
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits: expected [n, V] with the last dim contiguous, got {tuple(logits.shape)} "
                         f"strides {tuple(logits.stride())}")
    check_tensor("bitmask", bitmask, (torch.int32,))
    if bitmask.dim() != 2 or (bitmask.shape[1] > 1 and bitmask.stride(1) != 1):
        raise ValueError(f"bitmask: expected [m, W] int32 words with the last dim contiguous, got "
                         f"{tuple(bitmask.shape)}")
    check_tensor("rows", rows, (torch.int64,))
    if tuple(rows.shape) != (bitmask.shape[0],) or not rows.is_contiguous():
        raise ValueError(f"rows: expected a contiguous ({bitmask.shape[0]},) tensor (a row per mask), got "
                         f"{tuple(rows.shape)}")
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)
    n_masks, n_vocab = bitmask.shape[0], logits.shape[1]
    if not n_masks or not n_vocab:
        return logits
    if not use_triton(logits):
        return apply_token_bitmask_ref(logits, bitmask, rows)
    _apply_token_bitmask_kernel[(n_masks, cdiv(n_vocab, BLOCK))](
        logits, bitmask, rows, n_vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0), BLOCK=BLOCK,
        num_warps=4)
    return logits
