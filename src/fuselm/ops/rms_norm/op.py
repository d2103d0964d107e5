"""``rms_norm`` and ``add_rms_norm``: checked host functions, autograd, ``torch.library`` ops, and
the module. Rounding modes and formulas: ``naive.py`` and ``kernels.py`` beside this file.

Eager calls go through ``autograd.Function``s, calls under ``torch.compile`` through the custom
ops (see ``fuselm/ops/silu_mul/op.py`` for why there are two entry points to one kernel pair).
"""

from __future__ import annotations

import torch
from torch import nn

from fuselm.ops.common.rows import MAX_COLS
from fuselm.ops.rms_norm.kernels import rms_norm_backward_kernel, rms_norm_forward_kernel
from fuselm.ops.rms_norm.naive import add_rms_norm_ref, rms_norm_backward_ref, rms_norm_ref
from fuselm.runtime import (
    as_rows, check_finite_float, check_match, check_out, check_same_device, check_tensor, needs_autograd, use_triton,
)


def _check_inputs(x, weight, eps, offset, residual=None) -> tuple[float, float]:
    check_tensor("x", x)
    check_tensor("weight", weight)
    if residual is not None:
        check_tensor("residual", residual)
    check_same_device(x=x, residual=residual, weight=weight)
    if x.dim() == 0:
        raise ValueError("x: must have at least one dimension")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match x's last dim ({x.shape[-1]},)")
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"x: last dim {x.shape[-1]} exceeds the {MAX_COLS} columns a program holds")
    if residual is not None:
        check_match("residual", residual, "x", x)
    return check_finite_float("eps", eps, nonnegative=True), check_finite_float("offset", offset)


def _forward(x, residual, weight, eps, offset, y, residual_out):
    if x.numel() == 0:
        return y, residual_out
    if not use_triton(x):
        if residual is None:
            return y.copy_(rms_norm_ref(x, weight, eps, offset)), None
        ref_y, ref_s = add_rms_norm_ref(x, residual, weight, eps, offset)
        return y.copy_(ref_y), residual_out.copy_(ref_s)
    n = x.shape[-1]
    rms_norm_forward_kernel(
        as_rows("x", x), None if residual is None else as_rows("residual", residual), weight,
        y.view(-1, n), None if residual_out is None else residual_out.view(-1, n), eps, offset,
    )
    return y, residual_out


def _backward(dy, x, weight, d_residual_out, eps, offset):
    if x.numel() == 0:
        return torch.zeros_like(x), torch.zeros_like(weight)
    if not use_triton(x):
        return rms_norm_backward_ref(dy, x, weight, eps, offset, d_residual_out)
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = rms_norm_backward_kernel(
        as_rows("grad", dy), as_rows("x", x), weight,
        None if d_residual_out is None else as_rows("grad", d_residual_out), dx.view(-1, n), eps, offset,
    )
    return dx, dw.to(weight.dtype)


# ----------------------------------------------------------------------------- checked host functions
def rms_norm_forward(x, weight, eps: float = 1e-6, offset: float = 0.0, *, out=None) -> torch.Tensor:
    """RMSNorm without autograd, into ``out`` if given (a contiguous buffer)."""
    eps, offset = _check_inputs(x, weight, eps, offset)
    return _forward(x, None, weight, eps, offset, check_out("out", out, x), None)[0]


def add_rms_norm_forward(x, residual, weight, eps: float = 1e-6, offset: float = 0.0, *, out=None, residual_out=None):
    """Fused add + RMSNorm without autograd, into ``out``/``residual_out`` if given."""
    eps, offset = _check_inputs(x, weight, eps, offset, residual)
    return _forward(x, residual, weight, eps, offset, check_out("out", out, x), check_out("residual_out", residual_out, x))


# ----------------------------------------------------------------------------- autograd (eager)
class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset = eps, offset
        return _forward(x, None, weight, eps, offset, torch.empty(x.shape, dtype=x.dtype, device=x.device), None)[0]

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return (*_backward(dy, x, weight, None, ctx.eps, ctx.offset), None, None)


class _AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _forward(x, residual, weight, eps, offset, y, s)
        ctx.save_for_backward(s, weight)  # s = x + residual: the normalised input
        ctx.eps, ctx.offset = eps, offset
        return y, s

    @staticmethod
    def backward(ctx, dy, d_residual_out):
        s, weight = ctx.saved_tensors
        ds, dw = _backward(dy, s, weight, d_residual_out, ctx.eps, ctx.offset)
        return ds, ds, dw, None, None  # s = x + residual: both get ds


# ----------------------------------------------------------------------------- torch.library ops (compile)
@torch.library.custom_op("fuselm::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _forward(x, None, weight, eps, offset, torch.empty(x.shape, dtype=x.dtype, device=x.device), None)[0]


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fuselm::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _forward(x, residual, weight, eps, offset, y, s)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fuselm::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, d_residual_out: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, d_residual_out, eps, offset)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, d_residual_out, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_autograd(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x, weight, None, ctx.eps, ctx.offset)
    return dx, dw, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps, offset = inputs
    ctx.save_for_backward(output[1], weight)  # s = x + residual: the normalised input
    ctx.eps, ctx.offset = eps, offset


def _add_rms_norm_autograd(ctx, dy, d_residual_out):
    s, weight = ctx.saved_tensors
    ds, dw = _rms_norm_backward_op(dy, s, weight, d_residual_out, ctx.eps, ctx.offset)
    return ds, ds, dw, None, None  # s = x + residual: both get ds


torch.library.register_autograd("fuselm::rms_norm", _rms_norm_autograd, setup_context=_rms_norm_setup)
torch.library.register_autograd("fuselm::add_rms_norm", _add_rms_norm_autograd, setup_context=_add_rms_norm_setup)


# ----------------------------------------------------------------------------- public API
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim, differentiable in x and weight.

    Args:
        x: [..., N] fp16/bf16/fp32 (N <= 65536).
        weight: [N], any of those dtypes (read in fp32).
        eps: added to the mean square.
        offset: 0.0 for HF Llama rounding (``weight * x_normed.to(dtype)``); 1.0 for HF Qwen3.5
            zero-centered weights (``(x_normed * (1 + weight.float())).to(dtype)``).
    Returns:
        [..., N] in ``x.dtype``.
    """
    eps, offset = _check_inputs(x, weight, eps, offset)
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, eps, offset)
    if needs_autograd(x, weight):
        return _RMSNormFunction.apply(x, weight, eps, offset)
    return _forward(x, None, weight, eps, offset, torch.empty(x.shape, dtype=x.dtype, device=x.device), None)[0]


def add_rms_norm(x, residual, weight, eps: float = 1e-6, offset: float = 0.0):
    """``s = x + residual`` (rounded to ``x.dtype``) and ``rms_norm(s)`` in one pass.

    Args:
        x, residual: [..., N] of one shape and dtype.
        weight, eps, offset: as :func:`rms_norm`.
    Returns:
        ``(normed, new_residual)``, both [..., N] in ``x.dtype``; ``new_residual`` is ``s``, the
        residual stream for the next layer.
    """
    eps, offset = _check_inputs(x, weight, eps, offset, residual)
    if torch.compiler.is_compiling():
        return _add_rms_norm_op(x, residual, weight, eps, offset)
    if needs_autograd(x, residual, weight):
        return _AddRMSNormFunction.apply(x, residual, weight, eps, offset)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _forward(x, residual, weight, eps, offset, y, torch.empty(x.shape, dtype=x.dtype, device=x.device))


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight; ``forward(x, residual=None)`` returns ``normed`` alone, or
    ``(normed, new_residual)`` when a residual is given (the fused add).

    ``zero_centered=True`` is Qwen3.5's form: the weight starts at 0 and multiplies as (1 + w).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False, device=None, dtype=None):
        super().__init__()
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.offset = 1.0 if zero_centered else 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset)
        return add_rms_norm(x, residual, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"
