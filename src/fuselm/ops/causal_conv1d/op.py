"""``causal_conv1d_silu``: the Gated DeltaNet short convolution of a prefill chunk in two launches
(the conv + SiLU reading the [B, T, C] projection and the slot's state, then the new conv state),
in place of the PyTorch path's cat, transposes, conv1d, SiLU, gather, scatter and index_copy.
Inference only (no autograd); graph safe (no host sync, shapes only)."""

from __future__ import annotations

import torch

from fuselm.ops.causal_conv1d.kernels import causal_conv1d_silu_kernels
from fuselm.ops.causal_conv1d.naive import causal_conv1d_silu_ref
from fuselm.runtime import check_same_device, check_tensor, use_triton


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                       starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv1d) of a prefill chunk, continuing each row's conv state.

    Args:
        x: [B, T, C] (channels contiguous, row and token strides free: e.g. the conv slice of a
            wider projection), fp32/fp16/bf16; row b's first ``lengths[b]`` tokens are real.
        weight: [C, K] or [C, 1, K] (HF's conv1d.weight) in x's dtype.
        conv_state: [S, C, K] in x's dtype, contiguous, the state pool: slot s, column j holds the
            input at the latest position p with p % K == j (zeros for p < 0). Read for the
            positions before the chunk, then overwritten with the inputs at positions
            start + length - K .. start + length - 1 of each row's slot.
        slots: int64 [B] (any stride), the pool slot of each row (a repeated slot must come with
            identical rows).
        starts: int64 [B], the position of x[b, 0] (0: a fresh request, zero history).
        lengths: int64 [B], real tokens per row, 1 .. T (values not checked on a GPU).
    Returns:
        [B, T, C] in x's dtype, contiguous: the K products summed in fp32, rounded (the conv),
        SiLU in fp32, rounded (``naive.causal_conv1d_silu_ref``: HF's conv1d then silu).
        Positions past a row's length are meaningless.
    """
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_tensor("conv_state", conv_state)
    check_same_device(x=x, weight=weight, conv_state=conv_state, slots=slots, starts=starts, lengths=lengths)
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x: expected [B, T, C] with contiguous channels, got shape {tuple(x.shape)}")
    B, T, C = x.shape
    weight = weight.reshape(weight.shape[0], weight.shape[-1]) if weight.dim() == 3 and weight.shape[1] == 1 else weight
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight: expected [C, K] or [C, 1, K] with C = {C}, got {tuple(weight.shape)}")
    K = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, K) or not conv_state.is_contiguous():
        raise ValueError(f"conv_state: expected a contiguous [S, {C}, {K}] pool, got {tuple(conv_state.shape)}")
    for name, t in (("weight", weight), ("conv_state", conv_state)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from x's {x.dtype}")
    for name, t in (("slots", slots), ("starts", starts), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.shape != (B,):
            raise ValueError(f"{name}: expected an int64 tensor [B] = ({B},)")
    if not x.is_cuda and B and not bool(((lengths >= 1) & (lengths <= T)).all() & (starts >= 0).all()
                                         & ((slots >= 0) & (slots < conv_state.shape[0])).all()):
        raise ValueError(f"lengths, starts, slots: lengths in [1, {T}], starts >= 0, slots in [0, {conv_state.shape[0]})")
    if B == 0 or T == 0:
        return x.new_empty(B, T, C)
    if not use_triton(x):
        return causal_conv1d_silu_ref(x, weight, conv_state, slots, starts, lengths).contiguous()
    out = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    slots, starts, lengths = (t.contiguous() for t in (slots, starts, lengths))  # the kernels index them densely
    causal_conv1d_silu_kernels(x, weight.contiguous(), conv_state, slots, starts, lengths, out)
    return out
