"""Triton kernels for ``causal_conv1d_silu`` (Gated DeltaNet prefill's short convolution).

``_conv_kernel``: grid (B, T / BLOCK_T, C / BLOCK_C); a program reads x [BLOCK_T + K - 1, BLOCK_C]
straight from the [B, T, C] projection (channels contiguous: no transpose) as K shifted tiles, the
positions before the chunk (first tile only) from the slot's circular conv state (zeros before
position 0), and writes
round(silu(round(sum_j w[c, j] x[t - K + 1 + j, c]))) with the K products summed in fp32 (the
weight dtype's conv accumulates in fp32 and rounds once, then SiLU rounds: HF's two roundings).
``_state_kernel``: grid (B, C / BLOCK_C); the inputs at positions start + length - K ..
start + length - 1 into their circular columns of the slot. It runs after the conv (which read the
old state), and each program owns whole columns of its channels, so reads and writes never race.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselm.runtime import cdiv, next_power_of_2


@triton.jit
def _input_at(x_row, state_row, position, start, n_tokens, stride_t, channels, c_mask, K: tl.constexpr):
    """The conv input at ``position`` [BLOCK_T] for channels [BLOCK_C] (fp32): x where position is
    in the chunk, the slot's state column position % K before it (zeros before position 0; past
    the chunk, where nothing is stored, anything)."""
    in_chunk = (position >= start) & (position < start + n_tokens)
    t = tl.where(in_chunk, position - start, 0).to(tl.int64)
    from_x = tl.load(x_row + t[:, None] * stride_t + channels[None, :], mask=in_chunk[:, None] & c_mask[None, :],
                     other=0.0)
    column = tl.where(position >= 0, position % K, 0)
    from_state = tl.load(state_row + channels[None, :] * K + column[:, None],
                         mask=((position < start) & (position >= 0))[:, None] & c_mask[None, :], other=0.0)
    return tl.where(in_chunk[:, None], from_x, from_state).to(tl.float32)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, starts_ptr, out_ptr, T, C, stride_xb, stride_xt,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = channels < C
    start = tl.load(starts_ptr + b)
    x_row = x_ptr + b * stride_xb
    state_row = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * C * K
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if tl.program_id(1) * BLOCK_T >= K - 1:  # every input of the tile is in the chunk: plain shifted loads
        for j in tl.static_range(K):
            w = tl.load(w_ptr + channels * K + j, mask=c_mask, other=0.0).to(tl.float32)
            src = t - (K - 1) + j
            x = tl.load(x_row + src.to(tl.int64)[:, None] * stride_xt + channels[None, :],
                        mask=(src < T)[:, None] & c_mask[None, :], other=0.0)
            acc += x.to(tl.float32) * w[None, :]
    else:  # the chunk's first tokens also read the slot's state (or zeros before position 0)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + channels * K + j, mask=c_mask, other=0.0).to(tl.float32)
            acc += _input_at(x_row, state_row, start + t - (K - 1) + j, start, T, stride_xt, channels, c_mask,
                             K) * w[None, :]
    dtype = out_ptr.dtype.element_ty
    conv = acc.to(dtype).to(tl.float32)  # the conv's own rounding
    y = conv / (1.0 + tl.exp(-conv))
    tl.store(out_ptr + (b * T + t.to(tl.int64))[:, None] * C + channels[None, :], y.to(dtype),
             mask=(t < T)[:, None] & c_mask[None, :])


@triton.jit
def _state_kernel(x_ptr, state_ptr, slots_ptr, starts_ptr, lengths_ptr, T, C, stride_xb, stride_xt,
                  K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = channels < C
    start = tl.load(starts_ptr + b)
    end = start + tl.load(lengths_ptr + b)
    state_row = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * C * K
    i = tl.arange(0, BLOCK_K)
    position = end - K + i  # [BLOCK_K]
    values = _input_at(x_ptr + b * stride_xb, state_row, position, start, T, stride_xt, channels, c_mask, K)
    column = (position % K + K) % K  # Python's modulo for the negative positions (zeros) too
    tl.store(state_row + channels[None, :] * K + column[:, None], values.to(state_ptr.dtype.element_ty),
             mask=(i < K)[:, None] & c_mask[None, :])


# The conv's tile: BLOCK_T tokens x BLOCK_C channels a program, CONV_WARPS warps. H200 sweep
# (benchmarks/prefill_kernels_sweep.py, 9B: 8192 channels of the in_proj output): 16 x 64 on 2
# warps 7.26 us at 224 tokens (best), 137 us at 8192 (best 134); 32 x 128 on 4 warps 8.96 / 176.
CONV_BLOCK_T = 16
CONV_BLOCK_C = 64
CONV_WARPS = 2


def causal_conv1d_silu_kernels(x, weight, conv_state, slots, starts, lengths, out) -> None:
    B, T, C = x.shape
    K = weight.shape[-1]
    block_c = min(CONV_BLOCK_C, next_power_of_2(C))
    block_t = CONV_BLOCK_T
    _conv_kernel[(B, cdiv(T, block_t), cdiv(C, block_c))](
        x, weight, conv_state, slots, starts, out, T, C, x.stride(0), x.stride(1),
        K=K, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=CONV_WARPS)
    _state_kernel[(B, cdiv(C, block_c))](
        x, conv_state, slots, starts, lengths, T, C, x.stride(0), x.stride(1),
        K=K, BLOCK_K=next_power_of_2(K), BLOCK_C=block_c, num_warps=4)
