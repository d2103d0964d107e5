"""Per-row top-k / top-p (and min-p) cut-offs without sorting the vocabulary: the values of
``naive.keep_thresholds`` (the definition, a sort of each row) by cheaper ways. Static shapes, no
host sync (CUDA-graph safe); ``sample_tokens`` runs ``cutoffs`` on the device.

- 16-bit logits (bf16 / fp16), any settings, where Triton runs: a count of the row's tokens per
  key, the 65,536 values a 16-bit logit can take (``naive.order_keys``: an order-preserving map of
  its bits). All tokens of a key share one logit, so the counts give the k-th largest key and each
  key's mass, count x exp((x - max) / T) in float64; top-p keeps the keys whose mass strictly
  above is < p x total, as the definition keeps tie groups (``kernels.cutoffs_of_16_bit_logits``:
  counts by atomic adds, per-block sums of 1,024 keys, then each row's cut from its block sums).
  Numerics: masses in float64, summed per key and per block rather than token by token, and keys
  with weights below 2^-60 left out of the total (< 2^-40 of it over the row); so a row whose
  p x total falls within that of a key's boundary may be cut one key apart. H200, bf16
  [B, 248320]: 29 / 62 / 182 µs at B = 1 / 8 / 32 (benchmarks/NOTES.md 98).
- rows whose top-k is at most a small ``max_top_k`` (a promise the caller makes, e.g. the
  engine for a step whose filtering requests all set top_k <= 64): ``small_top_k_thresholds``,
  from the row's ``max_top_k`` largest logits (``torch.topk``) and one count of the tokens tied
  with the k-th, no sort of the row: everything top-k keeps is among the candidates but for ties
  with the k-th, which all share its value. The penalised (fp32) logits' cut-offs take it.
- otherwise (fp32 logits, or no Triton): the definition.
"""

from __future__ import annotations

import torch

from fuselm.ops.sampling.kernels import cutoffs_of_16_bit_logits
from fuselm.ops.sampling.naive import keep_thresholds, with_min_p
from fuselm.runtime import use_triton


def cutoffs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor | None = None, max_top_k: int | None = None) -> torch.Tensor:
    """``keep_thresholds(logits, temperature, top_k, top_p, min_p)`` [B] fp32, by the cheapest way
    that applies (module docstring). ``max_top_k``: the caller's promise that every row with
    top_p < 1 has 1 <= top_k <= max_top_k (``small_top_k_thresholds``)."""
    if use_triton(logits) and logits.dtype in (torch.bfloat16, torch.float16):
        return cutoffs_of_16_bit_logits(logits, temperature, top_k, top_p, min_p)
    if max_top_k is not None:
        return small_top_k_thresholds(logits, temperature, top_k, top_p, min_p, max_top_k)
    return keep_thresholds(logits, temperature, top_k, top_p, min_p)


def small_top_k_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """``keep_thresholds``' cut-offs for rows with 1 <= top_k <= max_top_k or top_p = 1 (a row with
    top_p < 1 and top-k off or larger would be cut wrongly), without sorting the row: the ``max_top_k``
    largest logits in order (``torch.topk``) hold every token top-k keeps but for ties with the
    k-th value, counted by one pass (``logits >= kth``) and weighed at that value. Masses in
    float64 as the definition's; they are summed in another order, so a row whose p x total falls
    within float64 rounding of a token's boundary may be cut one token apart. Static shapes, no
    host sync."""
    n_vocab = logits.shape[-1]
    candidates = logits.topk(min(max_top_k, n_vocab), dim=-1).values  # [B, K], largest first
    k = top_k.long()
    k_on = (k > 0) & (k < n_vocab)
    kth = candidates.gather(-1, (k.clamp(1, candidates.shape[-1]) - 1)[:, None])  # [B, 1]
    t = torch.where(temperature > 0, temperature, 1.0).double()[:, None]
    top = candidates[:, :1].double()
    in_top_k = candidates >= kth
    weight = (candidates.double() - top).div_(t).exp_().mul_(in_top_k)
    ties_past = (logits >= kth).sum(dim=-1, keepdim=True) - in_top_k.sum(dim=-1, keepdim=True)  # all equal to kth
    total = weight.sum(dim=-1, keepdim=True) + ties_past * kth.double().sub(top).div(t).exp()
    mass_before = weight.cumsum(dim=-1) - weight
    p = top_p.double()[:, None]
    kept = in_top_k & ((mass_before < p * total) | (p >= 1))
    n_kept = kept.sum(dim=-1).clamp(min=1)
    cutoff = candidates.gather(-1, (n_kept - 1)[:, None]).squeeze(-1).float()
    return with_min_p(torch.where(k_on, cutoff, float("-inf")), top[:, 0], t[:, 0], min_p)
