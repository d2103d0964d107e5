"""Plain-PyTorch references for ``decode_linear``: the prologues and the whole op.

Each function follows the numerics contract in the input dtype (fp32 math, a rounding to the
dtype where PyTorch eager rounds). Given float64 tensors it is the exact function: every rounding
is then a no-op. Used by the tests, as the CPU fallback and for the paths the fused kernel does
not cover (a head_dim the prologue kernel cannot tile).

Prologues, for x and gate [..., K] in dtype ``dt``:
- ``"sigmoid_gate"`` (Qwen3.5 gated attention, ``attn * torch.sigmoid(gate)`` in eager):
  s = round(sigmoid(gate)); a = round(x * s).
- ``"gated_rms_norm"`` (HF ``Qwen3_5RMSNormGated`` per head of ``head_dim`` columns, z = gate):
  r = rsqrt(mean(x^2 over the head) + eps); n1 = round(x * r); n2 = round(norm_weight * n1);
  a = round(n2 * silu(z)). n2 is ``fuselm.ops.rms_norm`` at offset 0 (its reference is reused
  here, so the two agree bit for bit).
Then y = round(a @ weight.T) with an fp32 (float64 for float64) accumulator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuselm.ops.common.precision import work_dtype
from fuselm.ops.rms_norm.naive import rms_norm_ref

PROLOGUES = (None, "sigmoid_gate", "gated_rms_norm")


def sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` as PyTorch eager computes it in x's dtype: two roundings."""
    work = work_dtype(x)
    s = torch.sigmoid(gate.to(work)).to(x.dtype)
    return (x.to(work) * s.to(work)).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       head_dim: int) -> torch.Tensor:
    """HF ``Qwen3_5RMSNormGated`` over each head of ``head_dim`` columns of x [..., K], gate z
    [..., K], ``norm_weight`` [head_dim]: ``GatedDeltaNet.output`` before its out_proj."""
    heads = (x.shape[-1] // head_dim, head_dim)
    normed = rms_norm_ref(x.unflatten(-1, heads), norm_weight, eps, 0.0)
    work = work_dtype(x)
    return (normed.to(work) * F.silu(z.unflatten(-1, heads).to(work))).to(x.dtype).flatten(-2)


def prologue_ref(x: torch.Tensor, prologue: str | None = None, gate: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, head_dim: int | None = None) -> torch.Tensor:
    """The GEMV's input ``a`` [..., K] for ``prologue`` (``x`` itself when None)."""
    if prologue is None:
        return x
    if prologue == "sigmoid_gate":
        return sigmoid_gate_ref(x, gate)
    if prologue == "gated_rms_norm":
        return gated_rms_norm_ref(x, gate, norm_weight, eps, head_dim)
    raise ValueError(f"prologue: expected one of {PROLOGUES}, got {prologue!r}")


def decode_linear_ref(x: torch.Tensor, weight: torch.Tensor, prologue: str | None = None,
                      gate: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, head_dim: int | None = None) -> torch.Tensor:
    """``round(prologue(x) @ weight.T)``: [..., K] x [N, K] -> [..., N] in x's dtype."""
    work = work_dtype(x)
    a = prologue_ref(x, prologue, gate, norm_weight, eps, head_dim)
    return (a.to(work) @ weight.to(work).T).to(x.dtype)
