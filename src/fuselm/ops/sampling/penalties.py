"""``apply_penalties``: OpenAI's logit bias and repetition, frequency and presence penalties on a
batch's logits, vLLM's definitions, every parameter a device tensor (one CUDA graph serves any mix
of settings).

Each row reads its slot's token counts, ``counts`` [S, V] int32: for slot s and token v,
``counts[s, v] = c + PROMPT_BIT * in_prompt``, c the times v was generated so far (< PROMPT_BIT)
and ``in_prompt`` whether v is in the slot's prompt. For row r of ``logits`` [n, V], on slot
``slots[r]`` (default r), with x the logit in fp32 (exact):

    repetition (r_r, 1 is off): x = x / r_r if x > 0 else x * r_r,   v in the prompt or generated
    frequency  (f_r, 0 is off): x = x - f_r * c                      (vLLM: subtract f per occurrence)
    presence   (p_r, 0 is off): x = x - p_r                          v generated at least once

in that order (vLLM's ``apply_penalties``; HF's repetition penalty is the same over prompt and
output), after the logit bias when one is given (vLLM's order): x = x + b for the slot's listed
tokens (``bias_ids`` / ``bias_values`` [S, M], the first ``bias_counts[s]`` entries of slot s,
distinct ids); and, last, -inf over a slot's banned tokens while it is under its ban (``banned_ids``
[S, K], while ``positions[s] < banned_until[s]``: min_tokens keeps a request's stop ids out until it
has drawn that many). Numerics: fp32, each operation rounded once as separate PyTorch operations round it
(the kernel is built without fused multiply-adds), so the kernel and ``naive.apply_penalties_ref``
agree to the bit. A row with neutral values comes out exactly x, whatever its slot's counts hold.

One launch, a program per (row, BLOCK tokens): it reads the logits (16 or 32 bits) and the counts
(32 bits) once and writes fp32 [n, V]; with a logit bias or a ban, a second launch (a program per
row) computes the biased tokens again with their bias and writes them over, then the banned ones.
The penalised logits are the sampler's input; the raw ones stay as they were (log-probabilities are
the model's, as vLLM's default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.sampling.naive import PROMPT_BIT, apply_penalties_ref
from fuselm.runtime import cdiv, check_same_device, check_tensor, next_power_of_2, use_triton

_PROMPT_BIT: tl.constexpr = tl.constexpr(PROMPT_BIT)
BLOCK = 4096  # tokens a program


@triton.jit
def _apply_penalties_kernel(logits_ptr, counts_ptr, slots_ptr, repetition_ptr, frequency_ptr, presence_ptr, out_ptr,
                            n_vocab, stride_row, stride_counts, HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_vocab
    slot = row
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
    count = tl.load(counts_ptr + slot.to(tl.int64) * stride_counts + cols, mask=ok, other=0)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    x = _penalised(x, count, repetition, frequency, presence)
    tl.store(out_ptr + row.to(tl.int64) * n_vocab + cols, x, mask=ok)


@triton.jit
def _penalised(x, count, repetition, frequency, presence):
    """The penalties of the module docstring on fp32 ``x`` with its tokens' ``count`` entries."""
    generated = count & (_PROMPT_BIT - 1)
    x = tl.where(count != 0, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    x = x - frequency * generated.to(tl.float32)
    return x - tl.where(generated > 0, presence, 0.0)


@triton.jit
def _listed_tokens_kernel(logits_ptr, counts_ptr, slots_ptr, repetition_ptr, frequency_ptr, presence_ptr, out_ptr,
                          bias_ids_ptr, bias_values_ptr, bias_counts_ptr, banned_ids_ptr, banned_until_ptr,
                          positions_ptr, n_vocab, stride_row, stride_counts, stride_bias, stride_banned,
                          HAS_SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BAN: tl.constexpr,
                          BLOCK_BIAS: tl.constexpr, BLOCK_BAN: tl.constexpr):
    """Program per row: its slot's biased tokens, (x + b) penalised, written over the first
    kernel's values; then, while the slot is under its ban, -inf over its banned tokens."""
    row = tl.program_id(0)
    slot = row
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row)
    slot = slot.to(tl.int64)
    out_row = out_ptr + row.to(tl.int64) * n_vocab
    if HAS_BIAS:
        entries = tl.arange(0, BLOCK_BIAS)
        listed = entries < tl.load(bias_counts_ptr + slot)
        ids = tl.load(bias_ids_ptr + slot * stride_bias + entries, mask=listed, other=-1)
        listed &= (ids >= 0) & (ids < n_vocab)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=listed, other=0.0).to(tl.float32)
        x = x + tl.load(bias_values_ptr + slot * stride_bias + entries, mask=listed, other=0.0)
        count = tl.load(counts_ptr + slot * stride_counts + ids, mask=listed, other=0)
        x = _penalised(x, count, tl.load(repetition_ptr + row), tl.load(frequency_ptr + row),
                       tl.load(presence_ptr + row))
        tl.store(out_row + ids, x, mask=listed)
    if HAS_BAN:
        tl.debug_barrier()  # the bias's stores first: a banned token's -inf is its last write
        # under the ban, ids in [0, V) are banned; past it none is (an empty range)
        banned_below = tl.where(tl.load(positions_ptr + slot) < tl.load(banned_until_ptr + slot), n_vocab, 0)
        entries = tl.arange(0, BLOCK_BAN)
        in_use = entries < stride_banned
        ids = tl.load(banned_ids_ptr + slot * stride_banned + entries, mask=in_use, other=-1)
        in_use = in_use & (ids >= 0) & (ids < banned_below)
        tl.store(out_row + ids, tl.full([BLOCK_BAN], float("-inf"), tl.float32), mask=in_use)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor, slots: torch.Tensor | None = None, *,
                    bias_ids: torch.Tensor | None = None, bias_values: torch.Tensor | None = None,
                    bias_counts: torch.Tensor | None = None, banned_ids: torch.Tensor | None = None,
                    banned_until: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The penalised logits [n, V] fp32 (module docstring). No host sync, static shapes.

    Args:
        logits: [n, V] fp32/fp16/bf16, the last dim contiguous (any row stride).
        counts: [S, V] int32, each slot's generated-token counts plus PROMPT_BIT for prompt tokens.
        repetition, frequency, presence: [n] fp32 per row (1, 0, 0: off).
        slots: [n] int64, row r's slot (default r; then n <= S).
        bias_ids, bias_values, bias_counts: optional logit bias per slot: [S, M] int32 token ids,
            [S, M] fp32 biases, [S] int32 entries in use (all three or none).
        banned_ids, banned_until, positions: optional ban per slot (all three or none): [S, K]
            int64 token ids (-1 pads) that come out -inf while ``positions[s] < banned_until[s]``
            ([S] int64 each; min_tokens: a request's stop ids, its tokens drawn, its min_tokens).
        out: optional contiguous [n, V] fp32, fully written.
    Not checked (a device read): slots in [0, S), repetition > 0, a slot's biased ids distinct
    (ids outside [0, V) are skipped).
    """
    check_tensor("logits", logits)
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits: expected [n, V] with the last dim contiguous, got {tuple(logits.shape)} "
                         f"strides {tuple(logits.stride())}")
    n_rows, n_vocab = logits.shape
    check_tensor("counts", counts, (torch.int32,))
    if counts.dim() != 2 or counts.shape[1] != n_vocab or not counts.is_contiguous():
        raise ValueError(f"counts: expected a contiguous [S, V = {n_vocab}] tensor, got {tuple(counts.shape)}")
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check_tensor(name, t, (torch.float32,))
        if tuple(t.shape) != (n_rows,) or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous ({n_rows},) tensor, got {tuple(t.shape)}")
    if slots is None:
        if n_rows > counts.shape[0]:
            raise ValueError(f"logits: {n_rows} rows without slots need counts of as many slots, got "
                             f"{counts.shape[0]}")
    else:
        check_tensor("slots", slots, (torch.int64,))
        if tuple(slots.shape) != (n_rows,) or not slots.is_contiguous():
            raise ValueError(f"slots: expected a contiguous ({n_rows},) tensor, got {tuple(slots.shape)}")
    if out is None:
        out = torch.empty(n_rows, n_vocab, dtype=torch.float32, device=logits.device)
    else:
        check_tensor("out", out, (torch.float32,))
        if tuple(out.shape) != (n_rows, n_vocab) or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous ({n_rows}, {n_vocab}) tensor, got {tuple(out.shape)}")
    bias = (bias_ids, bias_values, bias_counts)
    if any(t is not None for t in bias):
        _check_bias(*bias, counts.shape[0])
    ban = (banned_ids, banned_until, positions)
    if any(t is not None for t in ban):
        _check_ban(*ban, counts.shape[0])
    check_same_device(logits=logits, counts=counts, repetition=repetition, frequency=frequency, presence=presence,
                      slots=slots, out=out, bias_ids=bias_ids, bias_values=bias_values, bias_counts=bias_counts,
                      banned_ids=banned_ids, banned_until=banned_until, positions=positions)
    if not use_triton(logits):
        return out.copy_(apply_penalties_ref(logits, counts, repetition, frequency, presence, slots, *bias, *ban))
    if n_rows and n_vocab:
        _apply_penalties_kernel[(n_rows, cdiv(n_vocab, BLOCK))](
            logits, counts, counts if slots is None else slots, repetition, frequency, presence, out,
            n_vocab, logits.stride(0), counts.stride(0), HAS_SLOTS=slots is not None, BLOCK=BLOCK,
            num_warps=8, enable_fp_fusion=False)
        has_bias = bias_ids is not None and bias_ids.shape[1] > 0
        has_ban = banned_ids is not None and banned_ids.shape[1] > 0
        if has_bias or has_ban:
            _listed_tokens_kernel[(n_rows,)](
                logits, counts, counts if slots is None else slots, repetition, frequency, presence, out,
                *(bias if has_bias else (counts,) * 3), *(ban if has_ban else (counts,) * 3),
                n_vocab, logits.stride(0), counts.stride(0), bias_ids.stride(0) if has_bias else 0,
                banned_ids.shape[1] if has_ban else 0, HAS_SLOTS=slots is not None, HAS_BIAS=has_bias,
                HAS_BAN=has_ban, BLOCK_BIAS=next_power_of_2(bias_ids.shape[1]) if has_bias else 1,
                BLOCK_BAN=next_power_of_2(banned_ids.shape[1]) if has_ban else 1, num_warps=4,
                enable_fp_fusion=False)
    return out


def _check_ban(banned_ids, banned_until, positions, n_slots: int) -> None:
    if banned_ids is None or banned_until is None or positions is None:
        raise ValueError("banned_ids, banned_until, positions: give all three or none")
    for name, t in (("banned_ids", banned_ids), ("banned_until", banned_until), ("positions", positions)):
        check_tensor(name, t, (torch.int64,))
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    if banned_ids.dim() != 2 or banned_ids.shape[0] != n_slots:
        raise ValueError(f"banned_ids: expected [S = {n_slots}, K], got {tuple(banned_ids.shape)}")
    for name, t in (("banned_until", banned_until), ("positions", positions)):
        if tuple(t.shape) != (n_slots,):
            raise ValueError(f"{name}: expected ({n_slots},), got {tuple(t.shape)}")


def _check_bias(bias_ids, bias_values, bias_counts, n_slots: int) -> None:
    if bias_ids is None or bias_values is None or bias_counts is None:
        raise ValueError("bias_ids, bias_values, bias_counts: give all three or none")
    check_tensor("bias_ids", bias_ids, (torch.int32,))
    check_tensor("bias_values", bias_values, (torch.float32,))
    check_tensor("bias_counts", bias_counts, (torch.int32,))
    if bias_ids.dim() != 2 or bias_ids.shape[0] != n_slots or not bias_ids.is_contiguous():
        raise ValueError(f"bias_ids: expected a contiguous [S = {n_slots}, M] tensor, got {tuple(bias_ids.shape)}")
    if tuple(bias_values.shape) != tuple(bias_ids.shape) or not bias_values.is_contiguous():
        raise ValueError(f"bias_values: expected a contiguous {tuple(bias_ids.shape)} tensor like bias_ids, got "
                         f"{tuple(bias_values.shape)}")
    if tuple(bias_counts.shape) != (n_slots,) or not bias_counts.is_contiguous():
        raise ValueError(f"bias_counts: expected a contiguous ({n_slots},) tensor, got {tuple(bias_counts.shape)}")
