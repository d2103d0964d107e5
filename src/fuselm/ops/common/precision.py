"""Precision pieces shared by the plain-PyTorch references (``ops/<op>/naive.py``)."""

from __future__ import annotations

import torch


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a reference computes in for an input in ``x.dtype``: float32 (the kernels' fp32
    register math) for fp32, bf16 and fp16; float64 for float64, where every rounding to
    ``x.dtype`` is then a no-op and the reference is the exact function."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
