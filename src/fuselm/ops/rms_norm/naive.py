"""Plain-PyTorch references for ``rms_norm`` and ``add_rms_norm``, in the two rounding modes.

- ``offset == 0`` (HF Llama): ``weight * x_normed.to(dtype)``: the normalised row is rounded to
  the input dtype, then multiplied by the weight and rounded again.
- ``offset != 0`` (HF Qwen3.5 / Gemma zero-centered, offset 1): ``(x_normed * (offset +
  weight.float())).to(dtype)``: one rounding at the end.

``x_normed = x * rsqrt(mean(x^2) + eps)`` with the mean taken in fp32 (fp64 for fp64 input).
``add_rms_norm`` first forms ``s = x + residual`` rounded to the input dtype (as HF's
``residual + hidden_states`` in the model dtype) and normalises that rounded sum.
"""

from __future__ import annotations

import torch

from fuselm.ops.common.precision import work_dtype


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim; output in ``x.dtype``. Differentiable (autograd of the math)."""
    work = work_dtype(x)
    xf = x.to(work)
    x_normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        # Rounding to x.dtype with a straight-through gradient, as the kernels differentiate it.
        x_rounded = x_normed + (x_normed.detach().to(x.dtype).to(work) - x_normed.detach())
        y = weight.to(work) * x_rounded
    else:
        y = x_normed * (offset + weight.to(work))
    return y.to(x.dtype)


def add_rms_norm_ref(x, residual, weight, eps: float = 1e-6, offset: float = 0.0):
    """(rms_norm(s), s) with ``s = (x + residual)`` rounded to ``x.dtype``."""
    work = work_dtype(x)
    s = (x.to(work) + residual.to(work)).to(x.dtype)
    return rms_norm_ref(s, weight, eps, offset), s


def rms_norm_backward_ref(dy, x, weight, eps: float = 1e-6, offset: float = 0.0, d_residual_out=None):
    """(dx, dw) of ``rms_norm_ref`` at ``x``, written out (runs inside a ``torch.library`` op).

    ``d_residual_out`` is added to dx: the backward of ``add_rms_norm`` at ``x = s``, whose
    dx is also d_residual.
    """
    work = work_dtype(x)
    xf, g_out = x.to(work), dy.to(work)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_normed = xf * rstd
    w = weight.to(work) + offset
    g = g_out * w
    dx = rstd * (g - x_normed * (g * x_normed).mean(-1, keepdim=True))
    if d_residual_out is not None:
        dx = dx + d_residual_out.to(work)
    if offset == 0.0:
        x_normed = x_normed.to(x.dtype).to(work)
    dw = (g_out * x_normed).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)
