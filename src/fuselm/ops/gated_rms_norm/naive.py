"""Plain-PyTorch reference for ``gated_rms_norm``: HF's ``Qwen3_5RMSNormGated`` (transformers 5.17),
the norm after Gated DeltaNet's recurrence, gated by SiLU of the z projection:

    n = round(x * rsqrt(mean(x^2) + eps))      (fp32, rounded to x's dtype)
    h = w * n                                  (in the promoted dtype: rounded when w has x's dtype)
    y = round(h * silu(float(gate)))           (fp32 product, rounded to x's dtype)

Shapes: x, gate [..., D]; weight [D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's forward, step by step (differentiable through autograd)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    h = weight * n
    return (h * F.silu(gate.to(torch.float32))).to(dtype)
