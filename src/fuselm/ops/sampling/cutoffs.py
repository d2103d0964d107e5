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
- otherwise (fp32 logits, or no Triton): the definition.
"""

from __future__ import annotations

import torch

from fuselm.ops.sampling.kernels import cutoffs_of_16_bit_logits
from fuselm.ops.sampling.naive import keep_thresholds
from fuselm.runtime import use_triton


def cutoffs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor | None = None) -> torch.Tensor:
    """``keep_thresholds(logits, temperature, top_k, top_p, min_p)`` [B] fp32, by the cheapest way
    that applies (module docstring)."""
    if use_triton(logits) and logits.dtype in (torch.bfloat16, torch.float16):
        return cutoffs_of_16_bit_logits(logits, temperature, top_k, top_p, min_p)
    return keep_thresholds(logits, temperature, top_k, top_p, min_p)
