"""``short_conv_silu``: the Gated DeltaNet short convolution for training, differentiable: y =
silu(causal depthwise conv1d(x)) over [B, T, C] sequences that start from zero history (HF's
``F.silu(conv1d(x)[..., :T])`` in ``Qwen3_5GatedDeltaNet``), read and written with channels
contiguous (no transposes), in place of PyTorch's transpose, conv (cuDNN), SiLU and their
backwards.

    conv[t, c] = sum_{j < K} w[c, j] x[t - K + 1 + j, c]      (x = 0 before t = 0)
    y = silu(conv)

Backward, from dy (two kernels):
    dconv = dy * silu'(conv),  silu'(u) = s (1 + u (1 - s)), s = sigmoid(u)   (conv recomputed)
    dw[c, j] = sum_{b, t} dconv[t, c] x[t - K + 1 + j, c]          (per time block, then summed)
    dx[t, c] = sum_j w[c, j] dconv[t + K - 1 - j, c]                (t + K - 1 - j < T)

Kernels: ``_forward_kernel`` grid (B, T / BLOCK_T, C / BLOCK_C); ``_dconv_kernel`` (same grid)
writes dconv in fp32 and each program's dw partial [K, BLOCK_C]; ``_dx_kernel`` (same grid) reads
dconv at the K later positions. Saved for the backward: x and the weight only (conv recomputed).
Eager calls go through an ``autograd.Function``, calls under ``torch.compile`` through the
``fuselm::short_conv_silu`` custom op (its backward ``fuselm::short_conv_silu_backward``).

Numerics: the K products summed in fp32 and rounded to x's dtype (the conv's output), SiLU in fp32
and rounded (HF's two roundings in the forward). Backward in fp32 throughout: dconv is not
rounded (HF's autograd rounds it to the model dtype), dx summed in fp32 and rounded once, dw
summed in fp32 over all tokens (each block's partial in fp32, the blocks added by torch in fp32)
and rounded once to the weight's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.causal_conv1d.naive import short_conv_silu_ref
from fuselm.runtime import cdiv, check_same_device, check_tensor, needs_autograd, next_power_of_2, use_triton

BLOCK_T = 64
WARPS = 4


@triton.jit
def _shifted(x_row, t, shift, T, stride_t, channels, c_mask):
    """x[t + shift, channels] in fp32 [BLOCK_T, BLOCK_C], zero outside [0, T)."""
    s = t + shift
    ok = (s >= 0) & (s < T)
    return tl.load(x_row + tl.where(ok, s, 0).to(tl.int64)[:, None] * stride_t + channels[None, :],
                   mask=ok[:, None] & c_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_at(x_row, w_ptr, t, T, stride_t, channels, c_mask, K: tl.constexpr, BLOCK_T: tl.constexpr,
             BLOCK_C: tl.constexpr):
    """conv[t, channels] in fp32, rounded to x's dtype (the conv's own rounding), then widened."""
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + channels * K + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += _shifted(x_row, t, j - (K - 1), T, stride_t, channels, c_mask) * w[None, :]
    return acc.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, y_ptr, T, C, stride_xb, stride_xt, K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = channels < C
    conv = _conv_at(x_ptr + b * stride_xb, w_ptr, t, T, stride_xt, channels, c_mask, K, BLOCK_T, BLOCK_C)
    y = conv / (1.0 + tl.exp(-conv))
    tl.store(y_ptr + (b * T + t.to(tl.int64))[:, None] * C + channels[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & c_mask[None, :])


@triton.jit
def _dconv_kernel(x_ptr, w_ptr, dy_ptr, dconv_ptr, dw_part_ptr, T, C, stride_xb, stride_xt, n_t_blocks,
                  K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = channels < C
    mask = (t < T)[:, None] & c_mask[None, :]
    x_row = x_ptr + b * stride_xb
    conv = _conv_at(x_row, w_ptr, t, T, stride_xt, channels, c_mask, K, BLOCK_T, BLOCK_C)
    offsets = (b * T + t.to(tl.int64))[:, None] * C + channels[None, :]
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-conv))
    dconv = tl.where(mask, dy * s * (1.0 + conv * (1.0 - s)), 0.0)
    tl.store(dconv_ptr + offsets, dconv, mask=mask)
    part = dw_part_ptr + (b * n_t_blocks + i_t) * K * C
    for j in tl.static_range(K):
        x = _shifted(x_row, t, j - (K - 1), T, stride_xt, channels, c_mask)
        tl.store(part + j * C + channels, tl.sum(dconv * x, axis=0), mask=c_mask)


@triton.jit
def _dx_kernel(dconv_ptr, w_ptr, dx_ptr, T, C, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = channels < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + channels * K + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += _shifted(dconv_ptr + b * T * C, t, K - 1 - j, T, C, channels, c_mask) * w[None, :]
    tl.store(dx_ptr + (b * T + t.to(tl.int64))[:, None] * C + channels[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & c_mask[None, :])


def _grid(B, T, C):
    block_c = min(128, next_power_of_2(C))
    return (B, cdiv(T, BLOCK_T), cdiv(C, block_c)), block_c


class _ShortConvSiluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _forward(x, weight)

    @staticmethod
    def backward(ctx, dy):
        return _backward(dy, *ctx.saved_tensors)


# ----------------------------------------------------------------------------- torch.library ops (compile)
@torch.library.custom_op("fuselm::short_conv_silu", mutates_args=())
def _short_conv_silu_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _forward(x, weight)


@_short_conv_silu_op.register_fake
def _(x, weight):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fuselm::short_conv_silu_backward", mutates_args=())
def _short_conv_silu_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight)


@_short_conv_silu_backward_op.register_fake
def _(dy, x, weight):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _autograd(ctx, dy):
    return _short_conv_silu_backward_op(dy, *ctx.saved_tensors)


torch.library.register_autograd("fuselm::short_conv_silu", _autograd, setup_context=_setup)


def _backward(dy, x, weight):
    """(dx [B, T, C] x's dtype, dw [C, K] weight's dtype) from dy (module docstring)."""
    B, T, C = x.shape
    K = weight.shape[1]
    grid, block_c = _grid(B, T, C)
    dy = dy.contiguous()
    dconv = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
    dw_part = torch.empty(B, grid[1], K, C, dtype=torch.float32, device=x.device)
    _dconv_kernel[grid](x, weight, dy, dconv, dw_part, T, C, x.stride(0), x.stride(1), grid[1],
                        K=K, BLOCK_T=BLOCK_T, BLOCK_C=block_c, num_warps=WARPS)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    _dx_kernel[grid](dconv, weight, dx, T, C, K=K, BLOCK_T=BLOCK_T, BLOCK_C=block_c, num_warps=WARPS)
    dw = dw_part.sum((0, 1)).t().contiguous().to(weight.dtype)  # [C, K]
    return dx, dw


def _forward(x, weight):
    B, T, C = x.shape
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    grid, block_c = _grid(B, T, C)
    _forward_kernel[grid](x, weight, y, T, C, x.stride(0), x.stride(1), K=weight.shape[1], BLOCK_T=BLOCK_T,
                          BLOCK_C=block_c, num_warps=WARPS)
    return y


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv1d) of whole sequences from zero history, differentiable (module
    docstring: math, kernels, numerics).

    Args:
        x: [B, T, C] fp32/fp16/bf16, channels contiguous (row and token strides free: e.g. the conv
            slice of a wider projection).
        weight: [C, K] or [C, 1, K] (HF's conv1d.weight), x's dtype; no bias.
    Returns:
        [B, T, C] in x's dtype, contiguous. Without Triton: ``short_conv_silu_ref``.
    """
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_same_device(x=x, weight=weight)
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x: expected [B, T, C] with contiguous channels, got shape {tuple(x.shape)}")
    C = x.shape[2]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [C, K] or [C, 1, K] with C = {C}, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from x's {x.dtype}")
    if x.numel() == 0:
        return x.clone()  # nothing to convolve (F.conv1d refuses T = 0)
    if not use_triton(x):
        return short_conv_silu_ref(x, weight)
    weight = weight.contiguous()
    if torch.compiler.is_compiling():
        return _short_conv_silu_op(x, weight)
    if needs_autograd(x, weight):
        return _ShortConvSiluFunction.apply(x, weight)
    return _forward(x, weight)
