"""Per-row top-k / top-p cut-offs without sorting the vocabulary: the values of
``naive.keep_thresholds`` (the definition, a sort of each row) by cheaper ways. Static shapes, no
host sync (CUDA-graph safe); ``sample_tokens`` runs ``cutoffs`` on the device.

- ``candidates`` (a host promise: every row with top-p on has a top-k in 1 .. candidates): the
  ``candidates`` largest logits of each row (``torch.topk``) hold every kept token; tokens tied
  with the k-th largest past them are counted in by one pass. Same values as the definition.
  The cut-off from the candidates is one Triton launch (``kernels.cutoffs_of_candidates_kernel``)
  where Triton runs, else ``naive.cutoffs_of_ordered`` (its reference). H200, bf16 [32, 248320],
  T 0.6 / top-k 20 / top-p 0.95: topk 127 µs, the cut-off from its 1024 candidates 195 µs as
  PyTorch kernels (benchmarks/sampling.py --candidates).
- 16-bit logits (bf16 / fp16), any settings: a histogram over the 65,536 values a logit can take.
  Each logit's bits map to an order-preserving key; per row, one ``scatter_add`` counts the
  tokens of each key and another sums their weights exp((x - max) / T) as integers in units of
  2^-40 (exact, order-free sums: the same cut-offs on every run). Suffix sums over the keys give,
  for each key, how many tokens and how much weight lie strictly above it: the k-th largest key is
  the largest key with count(>= key) >= k, and top-p keeps the keys whose weight strictly above is
  < p x total, as the definition keeps tie groups. The cut-off is the smallest logit at a kept key.
  Numerics: the weights are rounded to 2^-40 (the definition sums them in float64), so a row whose
  p x total falls within about V x 2^-40 of a boundary between two keys may be cut one value apart.
- otherwise (fp32 logits without candidates): the definition.
"""

from __future__ import annotations

import torch

from fuselm.ops.sampling.kernels import cutoffs_of_candidates_kernel
from fuselm.ops.sampling.naive import cutoffs_of_ordered, exclusive_prefix_sums, keep_thresholds
from fuselm.runtime import use_triton

KEYS = 1 << 16  # the values of a 16-bit float
MAX_KERNEL_CANDIDATES = 1024  # candidates the cut-off kernel holds in one program (the engine asks 1024)
WEIGHT_UNIT = 2.0 ** 40  # weights (<= 1) as int64 multiples of 2^-40; a 248K row sums below 2^58


def cutoffs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            candidates: int | None = None) -> torch.Tensor:
    """``keep_thresholds(logits, temperature, top_k, top_p)`` [B] fp32, by the cheapest way that
    applies (module docstring). ``candidates``: the host promise of ``sample_tokens``."""
    n_vocab = logits.shape[-1]
    if candidates is not None and candidates < n_vocab:
        ordered = logits.topk(candidates, dim=-1).values  # [B, C], largest first
        if use_triton(logits) and candidates <= MAX_KERNEL_CANDIDATES:
            return cutoffs_of_candidates_kernel(ordered, logits, temperature, top_k, top_p)
        return cutoffs_of_ordered(ordered, logits, temperature, top_k, top_p)
    if logits.dtype in (torch.bfloat16, torch.float16):
        return _cutoffs_by_histogram(logits, temperature, top_k, top_p)
    return keep_thresholds(logits, temperature, top_k, top_p)


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^16) of 16-bit logits, in the logits' order (equal logits, -0 and +0
    included, get equal keys): positive x -> bits + 2^15, negative x -> 2^16 - 1 - bits."""
    bits = (logits + 0.0).view(torch.int16).long() & (KEYS - 1)  # + 0.0 turns -0 into +0
    return torch.where(bits >= KEYS // 2, KEYS - 1 - bits, bits + KEYS // 2)


def _suffix_sums_above(per_key: torch.Tensor) -> torch.Tensor:
    """[B, KEYS] -> [B, KEYS]: entry j is the sum over keys > j."""
    return exclusive_prefix_sums(per_key.flip(-1)).flip(-1)


def _cutoffs_by_histogram(logits, temperature, top_k, top_p):
    n_rows, n_vocab = logits.shape
    key = order_keys(logits)  # [B, V]
    keys = torch.arange(KEYS, device=logits.device)
    counts = torch.zeros(n_rows, KEYS, dtype=torch.int64, device=logits.device).scatter_add_(
        1, key, torch.ones_like(key))
    # top-k: the k-th largest key is the largest key with count(>= key) >= k (k off: every token).
    k = top_k.long()
    k_on = (k > 0) & (k < n_vocab)
    k = torch.where(k_on, k, n_vocab)
    count_at_or_above = _suffix_sums_above(counts) + counts
    kth_key = (count_at_or_above >= k[:, None]).sum(dim=-1) - 1  # [B]
    in_top_k = key >= kth_key[:, None]
    # top-p over the top-k tokens: integer weights, exact sums.
    t = torch.where(temperature > 0, temperature, 1.0).double()[:, None]
    top = logits.amax(dim=-1, keepdim=True).double()
    weight = ((logits.double() - top) / t).exp_().mul_(WEIGHT_UNIT).round_().long() * in_top_k
    mass = torch.zeros(n_rows, KEYS, dtype=torch.int64, device=logits.device).scatter_add_(1, key, weight)
    above = _suffix_sums_above(mass)  # [B, KEYS]: weight strictly above each key
    p = top_p.double()[:, None]
    kept = (keys[None, :] >= kth_key[:, None]) & ((above.double() < p * mass.sum(dim=-1, keepdim=True).double())
                                                  | (p >= 1))
    # Kept keys are the top ones; the cut is the lowest kept key, at most the row's largest (the most
    # likely token is always kept).
    cut_key = torch.minimum(KEYS - kept.sum(dim=-1), key.amax(dim=-1))
    cutoff = torch.where(key >= cut_key[:, None], logits.float(), float("inf")).amin(dim=-1)
    return torch.where(k_on | (top_p < 1), cutoff, float("-inf"))
