"""``token_logprobs``: the drawn tokens' log-probabilities, ranks and the most likely tokens, in
two launches over the logits (``SamplingParams.logprobs``).

    logprob, rank, top, top_ids = token_logprobs(logits, ids, num_top)

Shapes: logits [B, V] (fp32 / fp16 / bf16, the last dim contiguous), ids [B] int64 (the drawn
ids) -> logprob [B] fp32, rank [B] int64, top [B, k] fp32 (descending), top_ids [B, k] int64,
k = min(num_top, V).

Kernels (a program per (row, split of SPLIT_BLOCK logits), then a program per row):
- ``_logprob_splits_kernel`` reads its split once: its max m_s and sum_s = sum exp(x - m_s), the
  count of its logits strictly above the drawn one's, and its TOP largest (value, id) by TOP
  rounds of max-and-remove over the split held in registers (TOP = k rounded up to a power of
  two, so a handful of compiled variants serve k = 0 .. 20);
- ``_logprob_combine_kernel`` folds a row's splits: lse = M + log(sum_s sum_s exp(m_s - M)),
  logprob = x_drawn - lse, rank = 1 + the counts' sum, and the k largest of the splits' candidates
  by k rounds of max-and-remove (ties to the lowest id: candidates are in id order within a value).

Numerics (``naive.token_logprobs_ref``'s contract): x = the logits upcast to fp32 (exact), the
log-normalizer accumulated in fp32 (split by split here, as one reduction there: equal up to fp32
rounding of the sum's order), logprob and top values x - lse rounded once in fp32; rank and the
top ids exact. Logits are assumed finite: a row with NaNs or -infs gets values that mean nothing
(NaN, or -inf's ids for the top) but every read and id stays in range.

H200, bf16 [B, 248320], graph replay (benchmarks/sampling.py, NOTES.md 106): 9.6 / 15.2 / 34.8 us
at B = 1 with 0 / 5 / 20 top, 15.1 / 41.1 / 119.3 us at B = 32 (the PyTorch reference: 53 / 126 /
127 and 183 / 328 / 331 us). The top rounds dominate past a few top tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.sampling.naive import token_logprobs_ref
from fuselm.runtime import cdiv, check_same_device, check_tensor, next_power_of_2, use_triton

SPLIT_BLOCK = 4096  # logits a program of the splits kernel (4 warps: 32 a thread)


@triton.jit
def _largest(values, positions, LAST: tl.constexpr):
    """(largest value, its position): the lowest position among ties; ``LAST`` (the last
    position) when no value equals the largest (NaNs), so the position is always in range."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, positions, LAST), axis=0)


@triton.jit
def _logprob_splits_kernel(logits_ptr, ids_ptr, max_ptr, sum_ptr, above_ptr, top_ptr, top_id_ptr,
                           V, stride_row, n_splits, BLOCK: tl.constexpr, TOP: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + b.to(tl.int64) * stride_row
    drawn = tl.load(row_ptr + tl.load(ids_ptr + b)).to(tl.float32)
    positions = tl.arange(0, BLOCK)
    cols = split * BLOCK + positions
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    out = b * n_splits + split
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.exp(x - m), axis=0))  # masked columns: exp(-inf) = 0
    tl.store(above_ptr + out, tl.sum((x > drawn).to(tl.int32), axis=0))
    for j in range(TOP):
        best, where = _largest(x, positions, BLOCK - 1)
        tl.store(top_ptr + out * TOP + j, best)
        tl.store(top_id_ptr + out * TOP + j, tl.minimum(split * BLOCK + where, V - 1))  # (past V: -inf padding)
        x = tl.where(positions == where, float("-inf"), x)


@triton.jit
def _logprob_combine_kernel(logits_ptr, ids_ptr, max_ptr, sum_ptr, above_ptr, top_ptr, top_id_ptr,
                            logprob_ptr, rank_ptr, out_top_ptr, out_top_id_ptr, stride_row, n_splits, k,
                            BLOCK_SPLITS: tl.constexpr, TOP: tl.constexpr, BLOCK_CANDIDATES: tl.constexpr):
    b = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    ok = splits < n_splits
    m = tl.load(max_ptr + b * n_splits + splits, mask=ok, other=float("-inf"))
    sums = tl.load(sum_ptr + b * n_splits + splits, mask=ok, other=0.0)
    largest = tl.max(m, axis=0)
    lse = largest + tl.log(tl.sum(tl.where(ok, sums * tl.exp(m - largest), 0.0), axis=0))
    drawn = tl.load(logits_ptr + b.to(tl.int64) * stride_row + tl.load(ids_ptr + b)).to(tl.float32)
    tl.store(logprob_ptr + b, drawn - lse)
    above = tl.sum(tl.load(above_ptr + b * n_splits + splits, mask=ok, other=0), axis=0)
    tl.store(rank_ptr + b, above.to(tl.int64) + 1)
    if TOP > 0:
        positions = tl.arange(0, BLOCK_CANDIDATES)
        candidates = tl.load(top_ptr + b * n_splits * TOP + positions, mask=positions < n_splits * TOP,
                             other=float("-inf"))
        for j in range(k):
            best, where = _largest(candidates, positions, BLOCK_CANDIDATES - 1)
            tl.store(out_top_ptr + b * k + j, best - lse)
            top_id = tl.load(top_id_ptr + b * n_splits * TOP + where, mask=where < n_splits * TOP, other=0)
            tl.store(out_top_id_ptr + b * k + j, top_id.to(tl.int64))
            candidates = tl.where(positions == where, float("-inf"), candidates)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor,
                   num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob [B] fp32, rank [B] int64, top logprobs [B, k] fp32, top ids [B, k] int64), k =
    min(num_top, V): the drawn ``ids`` [B] int64's log-probabilities under logits [B, V] (the
    raw distribution: log_softmax of the fp32 logits, no temperature or filters), their rank (1 +
    the logits strictly greater: ties share the better rank) and the k most likely tokens in
    descending order (ties to the lower id). Module docstring: kernels and numerics. Two launches,
    no host sync; on a CPU without TRITON_INTERPRET the reference ``token_logprobs_ref``. ids
    outside [0, V) are not checked (that would read device memory)."""
    check_tensor("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected [B, V] with V >= 1, got shape {tuple(logits.shape)}")
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"logits: the last dim must be contiguous (stride 1), got strides {tuple(logits.stride())}")
    check_tensor("ids", ids, (torch.int64,))
    if tuple(ids.shape) != (logits.shape[0],) or not ids.is_contiguous():
        raise ValueError(f"ids: expected a contiguous ({logits.shape[0]},) = (B,) tensor, got {tuple(ids.shape)}")
    if not isinstance(num_top, int) or isinstance(num_top, bool) or num_top < 0:
        raise ValueError(f"num_top: expected an int >= 0, got {num_top!r}")
    check_same_device(logits=logits, ids=ids)
    if not use_triton(logits):
        return token_logprobs_ref(logits, ids, num_top)
    B, V = logits.shape
    k = min(num_top, V)
    device = logits.device
    logprob = torch.empty(B, dtype=torch.float32, device=device)
    rank = torch.empty(B, dtype=torch.int64, device=device)
    top = torch.empty(B, k, dtype=torch.float32, device=device)
    top_ids = torch.empty(B, k, dtype=torch.int64, device=device)
    if B == 0:
        return logprob, rank, top, top_ids
    block = min(SPLIT_BLOCK, next_power_of_2(V))
    n_splits = cdiv(V, block)
    top_per_split = 0 if k == 0 else next_power_of_2(k)
    split_max = torch.empty(B, n_splits, dtype=torch.float32, device=device)
    split_sum = torch.empty_like(split_max)
    split_above = torch.empty(B, n_splits, dtype=torch.int32, device=device)
    split_top = torch.empty(B, n_splits, max(top_per_split, 1), dtype=torch.float32, device=device)
    split_top_ids = torch.empty(B, n_splits, max(top_per_split, 1), dtype=torch.int32, device=device)
    _logprob_splits_kernel[(B, n_splits)](logits, ids, split_max, split_sum, split_above, split_top, split_top_ids,
                                          V, logits.stride(0), n_splits, BLOCK=block, TOP=top_per_split, num_warps=4)
    _logprob_combine_kernel[(B,)](logits, ids, split_max, split_sum, split_above, split_top, split_top_ids,
                                  logprob, rank, top, top_ids, logits.stride(0), n_splits, k,
                                  BLOCK_SPLITS=next_power_of_2(n_splits), TOP=top_per_split,
                                  BLOCK_CANDIDATES=next_power_of_2(n_splits * max(top_per_split, 1)), num_warps=4)
    return logprob, rank, top, top_ids
