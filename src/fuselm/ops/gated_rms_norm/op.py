"""``gated_rms_norm``: HF's ``Qwen3_5RMSNormGated`` (``naive.py``) in one Triton pass forward and one
backward (``kernels.py``), differentiable in x, gate and weight: checked host function, autograd,
``torch.library`` ops for ``torch.compile``.

Memory: autograd keeps x, gate and the weight (16-bit x and gate: 4 bytes an element), where HF's
eager forward keeps fp32 x, the rounded norm, the product with the weight, fp32 gate and fp32
silu(gate) (16 bytes an element).

Numerics: the forward is HF's, rounding for rounding (``naive.py``); the backward is in fp32 from
the inputs (r, h and silu recomputed), each gradient rounded once to its input's dtype (dw summed
over rows in fp32).
"""

from __future__ import annotations

import torch

from fuselm.ops.gated_rms_norm.kernels import gated_rms_norm_backward_kernel, gated_rms_norm_forward_kernel
from fuselm.ops.gated_rms_norm.naive import gated_rms_norm_ref
from fuselm.runtime import as_rows, check_finite_float, check_same_device, check_tensor, needs_autograd, use_triton

MAX_COLS = 16384  # one row in registers (Qwen3.5: 128)


def _round_h(x, weight) -> bool:
    """HF's ``weight * n`` lands in the promoted dtype: rounded when that is x's."""
    return torch.promote_types(weight.dtype, x.dtype) == x.dtype


def _forward(x, gate, weight, eps):
    x2d, g2d = as_rows("x", x), as_rows("gate", gate)
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    if x2d.shape[0]:
        gated_rms_norm_forward_kernel(x2d, g2d, weight, eps, out, _round_h(x, weight))
    return out.view(x.shape)


def _backward(dy, x, gate, weight, eps):
    dx, dg, dw = gated_rms_norm_backward_kernel(as_rows("dy", dy), as_rows("x", x), as_rows("gate", gate), weight, eps,
                                                _round_h(x, weight))
    return dx.view(x.shape), dg.view(gate.shape), dw.to(weight.dtype)


class _GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps
        return _forward(x, gate, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        return (*_backward(dy, x, gate, weight, ctx.eps), None)


@torch.library.custom_op("fuselm::gated_rms_norm", mutates_args=())
def _gated_rms_norm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _forward(x, gate, weight, eps)


@_gated_rms_norm_op.register_fake
def _(x, gate, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fuselm::gated_rms_norm_backward", mutates_args=())
def _gated_rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, x, gate, weight, eps)


@_gated_rms_norm_backward_op.register_fake
def _(dy, x, gate, weight, eps):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(gate.shape, dtype=gate.dtype,
            device=x.device), torch.empty_like(weight))


def _setup(ctx, inputs, output):
    x, gate, weight, eps = inputs
    ctx.save_for_backward(x, gate, weight)
    ctx.eps = eps


def _autograd(ctx, dy):
    x, gate, weight = ctx.saved_tensors
    return (*_gated_rms_norm_backward_op(dy, x, gate, weight, ctx.eps), None)


torch.library.register_autograd("fuselm::gated_rms_norm", _autograd, setup_context=_setup)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``round(weight * round(rms_norm(x)) * silu(gate))``, HF's ``Qwen3_5RMSNormGated``, differentiable.

    Args:
        x: [..., D] fp16/bf16/fp32 (D <= 16384), the rows to normalise.
        gate: x's shape and dtype (Qwen3.5: the z projection).
        weight: [D], fp16/bf16/fp32.
        eps: added to the mean square (finite, >= 0).
    Returns:
        [..., D] in x's dtype. Without Triton: ``gated_rms_norm_ref``.
    """
    check_tensor("x", x)
    check_tensor("gate", gate)
    check_tensor("weight", weight)
    check_same_device(x=x, gate=gate, weight=weight)
    if x.dim() == 0:
        raise ValueError("x: must have at least one dimension, [..., D]")
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"gate: expected x's shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(gate.shape)} "
                         f"{gate.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight: expected [{x.shape[-1]}], got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"x: last dim {x.shape[-1]} > {MAX_COLS}")
    eps = check_finite_float("eps", eps, nonnegative=True)
    if not use_triton(x):
        return gated_rms_norm_ref(x, gate, weight, eps)
    if torch.compiler.is_compiling():
        return _gated_rms_norm_op(x, gate, weight, eps)
    if needs_autograd(x, gate, weight):
        return _GatedRMSNormFunction.apply(x, gate, weight, eps)
    return _forward(x, gate, weight, eps)
