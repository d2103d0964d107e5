"""One decode token of a Qwen3.5 Gated DeltaNet layer, from its input projection to the recurrence
output, in one launch: causal depthwise conv update + SiLU, q/k l2-norm, gates from the raw
projections, and the gated delta rule on a state pool (``fused_recurrent.py``'s math).

Inputs per row n (one token each), with key heads H x K, value heads HV x V, conv kernel KW:
- ``proj`` [N, P], the layer's in_proj output, columns (HF's in_proj_qkv, in_proj_z, in_proj_b,
  in_proj_a): x = (q, k, v) [conv_dim = 2 H K + HV V], z [HV V] (unused here), b [HV], a [HV].
- ``conv_state`` [P, conv_dim, KW] pool, circular: column j holds the input at the latest position p
  with p % KW == j. The token at position t (``positions[n]``) convolves the inputs at t - KW + 1
  .. t - 1 (columns (t + 1 .. t + KW - 1) % KW) with x, then writes x to column t % KW. No
  program reads the column it writes, so the many programs of a row share the state without a
  race, and nothing shifts.
- ``state`` [P, HV, K, V] pool (fp32, or bf16 / fp16 as vLLM keeps it by default). Row n's slot in
  both pools is ``state_slots[n]`` (a decode batch reads its requests' state where it lies: rows
  are a table into the pools, nothing moves); a negative slot (an inactive row) reads zeros and
  writes neither the state nor the conv state.

Numerics (as HF's torch path): conv accumulated in fp32 and rounded to the model dtype (F.conv1d),
SiLU in fp32 rounded again; g = -exp(A_log) softplus(a + dt_bias) in fp32; beta = sigmoid(b)
rounded to the model dtype (HF's ``b.sigmoid()``); the recurrence in fp32 (a 16-bit pool's row
read into fp32, the new state rounded once into the pool); o rounded once. With a
norm weight (the model's decode at 2+ rows), the output is HF's gated RMSNorm of o's heads with z
(``decode_linear``'s gated_rms_norm prologue, the same tile function: ``ops/common/prologue.py``),
one program a whole head, so the out projection runs plain (H100, 9B batch 8: 6.830 -> 6.750 ms a
step with the attention combine's gate, NOTES 75).

Grid: (V / BLOCK_V, N * HV) (BLOCK_V = V with the norm); the programs of one value head recompute
the q/k conv of their key head (2 K channels x KW taps: a few hundred bytes); the first of them
writes its conv state.

On Hopper the kernel is a programmatic dependent launch (``fuselm/ops/common/pdl.py``): while the
input projection ahead of it still runs, each program loads its slice of the recurrent state, the
conv history (and sums the KW - 1 earlier taps) and the gates' parameters; after the wait only the
projection. So ``state``, ``conv_state`` and the weights must not be written by the kernel right
before the call (FUSELM_PDL=0 turns it off). The conv's fp32 sum is the earlier taps in order, then
this token's (F.conv1d leaves its order unspecified). The 35B-A3B decode step at batch 1: 2.853 ms
with this kernel launched plainly, 2.814 as a dependent (NOTES 73).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.fused_recurrent import _gated_delta_step, decode_block_v, decode_num_warps, softplus
from fuselm.ops.gated_delta_rule.naive import gated_delta_rule_decode_step_ref
from fuselm.ops.common.pdl import allow_next_kernel, wait_for_previous_kernel
from fuselm.ops.common.prologue import PROLOGUE_GATED_RMS_NORM, PROLOGUE_NONE, prologue_tile
from fuselm.ops.decode_linear.naive import gated_rms_norm_ref
from fuselm.runtime import (cdiv, check_finite_float, check_same_device, check_tensor, next_power_of_2, use_pdl,
                            use_triton)


@triton.jit
def _conv_history(conv, conv_w_ptr, ch, mask, position, KW: tl.constexpr):
    """The conv of channels ``ch`` without this token's input, from the conv state (read before the
    dependent-launch wait): (sum over the KW - 1 earlier inputs of input * weight in fp32, in tap
    order, and this token's tap weight w[KW - 1] in fp32)."""
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for i in tl.static_range(KW - 1):  # tap i reads the input at position - (KW - 1) + i
        column = (position + 1 + i) % KW
        history = tl.load(conv + ch * KW + column, mask=mask, other=0.0).to(tl.float32)
        acc += history * tl.load(conv_w_ptr + ch * KW + i, mask=mask, other=0.0).to(tl.float32)
    return acc, tl.load(conv_w_ptr + ch * KW + (KW - 1), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _causal_conv_silu(proj, ch, mask, history):
    """(silu(conv) in fp32 after the model-dtype roundings, the current input x) for channels ch:
    the ``_conv_history`` sum plus x w[KW - 1] (fp32), rounded to the model dtype."""
    x = tl.load(proj + ch, mask=mask, other=0.0)
    earlier, w_last = history
    c = (earlier + x.to(tl.float32) * w_last).to(x.dtype).to(tl.float32)
    return (c * tl.sigmoid(c)).to(x.dtype).to(tl.float32), x


@triton.jit
def _decode_step_kernel(
    proj_ptr, conv_ptr, conv_w_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, positions_ptr, norm_w_ptr, o_ptr,
    stride_proj, stride_conv, scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KW: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1) // HV
    i_hv = tl.program_id(1) % HV
    i_h = i_hv // (HV // H)
    KEY_DIM: tl.constexpr = H * K
    CONV_DIM: tl.constexpr = 2 * H * K + HV * V
    kk = tl.arange(0, BLOCK_K)
    vv = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < K
    v_ok = vv < V
    # Before the dependent-launch wait, everything but the projection (the kernel ahead's output):
    # the state (the long load), the conv history and weights, the gates' parameters.
    slot = tl.load(slots_ptr + i_n).to(tl.int64)
    active = slot >= 0
    state_offs = i_hv * K * V + kk[:, None] * V + vv[None, :]
    state_mask = (kk < tl.where(active, K, 0))[:, None] & v_ok[None, :]
    S = tl.load(state_ptr + slot * HV * K * V + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr + i_n)
    proj = proj_ptr + i_n.to(tl.int64) * stride_proj
    conv = conv_ptr + tl.maximum(slot, 0) * stride_conv
    q_ch = i_h * K + kk
    k_ch = KEY_DIM + i_h * K + kk
    v_ch = 2 * KEY_DIM + i_hv * V + vv
    k_held = kk < tl.where(active, K, 0)  # an inactive row has no conv state: its history reads zeros
    v_held = vv < tl.where(active, V, 0)
    q_history = _conv_history(conv, conv_w_ptr, q_ch, k_held, position, KW)
    k_history = _conv_history(conv, conv_w_ptr, k_ch, k_held, position, KW)
    v_history = _conv_history(conv, conv_w_ptr, v_ch, v_held, position, KW)
    neg_A = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    norm_w = 0.0
    if PROLOGUE:  # the gated RMSNorm's weight
        norm_w = tl.load(norm_w_ptr + vv, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    wait_for_previous_kernel(USE_PDL)
    # The out projection after it (a programmatic dependent) may begin now: it loads its weights,
    # then waits for o.
    allow_next_kernel(USE_PDL)

    q, x_q = _causal_conv_silu(proj, q_ch, k_ok, q_history)
    k, x_k = _causal_conv_silu(proj, k_ch, k_ok, k_history)
    v, x_v = _causal_conv_silu(proj, v_ch, v_ok, v_history)

    b = tl.load(proj + CONV_DIM + HV * V + i_hv)
    g = neg_A * softplus(tl.load(proj + CONV_DIM + HV * V + HV + i_hv).to(tl.float32) + dt_bias)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)

    S, o = _gated_delta_step(S, q, k, v, g, beta, scale, True)  # q/k l2-norm in the step
    o = o.to(o_ptr.dtype.element_ty)
    if PROLOGUE:  # the whole head (BLOCK_V = V): HF's gated RMSNorm with z, as decode_linear's prologue
        z_ptrs = proj + CONV_DIM + i_hv * V + vv[None, :]
        o = tl.reshape(prologue_tile(o[None, :], z_ptrs, v_ok[None, :], norm_w, eps, PROLOGUE, V, 1, BLOCK_V),
                       [BLOCK_V])
    tl.store(o_ptr + (i_n * HV + i_hv).to(tl.int64) * V + vv, o, mask=v_ok)
    tl.store(state_ptr + slot * HV * K * V + state_offs, S.to(state_ptr.dtype.element_ty), mask=state_mask)

    # this token's input, for the next KW - 1 tokens (masks as index bounds: a scalar condition
    # folded into the bound, as for the state rows above)
    column = position % KW
    tl.store(conv + v_ch * KW + column, x_v, mask=v_held)
    writes_qk = active & (i_hv % (HV // H) == 0) & (i_v == 0)  # the first program of the key head
    tl.store(conv + q_ch * KW + column, x_q, mask=kk < tl.where(writes_qk, K, 0))
    tl.store(conv + k_ch * KW + column, x_k, mask=kk < tl.where(writes_qk, K, 0))


# At least 2 warps a program (fused_recurrent's 1 is its best alone): in the 35B-A3B decode step at
# batch 1 (16 value columns a program), 2.849 -> 2.830 ms a step, before the dependent launch (NOTES 73).
MIN_NUM_WARPS = 2


def _check(proj, conv_state, conv_weight, A_log, dt_bias, state, state_slots, positions, H, K, HV, V):
    for name, t in (("proj", proj), ("conv_state", conv_state), ("conv_weight", conv_weight), ("A_log", A_log),
                    ("dt_bias", dt_bias), ("state", state)):
        check_tensor(name, t)
    for name, t in (("state_slots", state_slots), ("positions", positions)):
        check_tensor(name, t, (torch.int32, torch.int64))
    conv_dim = 2 * H * K + HV * V
    if HV % H:
        raise ValueError(f"num_v_heads: {HV} is not a multiple of num_k_heads {H}")
    if proj.dim() != 2 or proj.shape[1] != conv_dim + HV * V + 2 * HV or proj.stride(1) != 1:
        raise ValueError(f"proj: expected [N, {conv_dim + HV * V + 2 * HV}] (qkv, z, b, a) with contiguous rows, "
                         f"got {tuple(proj.shape)}")
    N = proj.shape[0]
    if state.dim() != 4 or state.shape[1:] != (HV, K, V) or not state.is_contiguous():  # dtype: check_tensor
        raise ValueError(f"state: expected a contiguous pool [P, {HV}, {K}, {V}] in fp32, bf16 or fp16, got "
                         f"{tuple(state.shape)} {state.dtype}")
    if conv_weight.dim() != 3 or conv_weight.shape[:2] != (conv_dim, 1) or not conv_weight.is_contiguous():
        raise ValueError(f"conv_weight: expected a contiguous [{conv_dim}, 1, kernel], got {tuple(conv_weight.shape)}")
    KW = conv_weight.shape[2]
    P = state.shape[0]
    if conv_state.shape != (P, conv_dim, KW) or conv_state.stride()[1:] != (KW, 1) or conv_state.dtype != proj.dtype:
        raise ValueError(f"conv_state: expected a pool of state's slots [P, conv_dim, kernel] = {(P, conv_dim, KW)} "
                         f"in {proj.dtype} with contiguous rows, got {tuple(conv_state.shape)} {conv_state.dtype}")
    if conv_weight.dtype != proj.dtype:
        raise TypeError(f"conv_weight: dtype {conv_weight.dtype} differs from proj's {proj.dtype}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (HV,):
            raise ValueError(f"{name}: expected [HV] = ({HV},), got {tuple(t.shape)}")
    for name, t in (("state_slots", state_slots), ("positions", positions)):
        if t.shape != (N,):
            raise ValueError(f"{name}: expected [N] = ({N},), got {tuple(t.shape)}")
    check_same_device(proj=proj, conv_state=conv_state, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
                      state=state, state_slots=state_slots, positions=positions)


def gated_delta_rule_decode_step(
    proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor, positions: torch.Tensor, *,
    num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, scale: float | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row through the conv, the gates and the gated delta rule (see the module doc).

    Args:
        proj: [N, conv_dim + HV V + 2 HV] in_proj output (rows may be strided).
        conv_state: [P, conv_dim, kernel] pool of circular conv states, updated in place at
            ``state_slots`` (active rows).
        conv_weight: [conv_dim, 1, kernel]; A_log, dt_bias: [HV].
        state: pool [P, HV, K, V] (fp32, or bf16 / fp16: read into fp32, the new state rounded once
            into it), updated in place at ``state_slots`` (negative: inactive row).
        positions: [N] int, each row's token position (the conv state's clock).
        scale: on q; default K ** -0.5.
        norm_weight: optional [V] (proj's dtype or fp32): the output is then HF's gated RMSNorm of
            each head of o with z (proj's z columns) and this weight, ``decode_linear``'s
            gated_rms_norm prologue (one program a whole head; V a power of two), so the out
            projection after it runs plain.
        eps: the gated RMSNorm's epsilon (with ``norm_weight``).
        out: optional [N, HV, V] output (no allocation: CUDA-graph friendly).
    Returns:
        o [N, HV, V] in proj's dtype (normed and gated with ``norm_weight``). No host sync; no
        backward (inference only).
    """
    H, K, HV, V = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    _check(proj, conv_state, conv_weight, A_log, dt_bias, state, state_slots, positions, H, K, HV, V)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight)
        check_same_device(proj=proj, norm_weight=norm_weight)
        if V & (V - 1) or norm_weight.shape != (V,) or norm_weight.dtype not in (proj.dtype, torch.float32):
            raise ValueError(f"norm_weight: expected [head_v_dim] = ({V},) in {proj.dtype} or float32 with a "
                             f"power-of-two head_v_dim (one program a head), got {tuple(norm_weight.shape)} "
                             f"{norm_weight.dtype}")
        eps = check_finite_float("eps", eps, nonnegative=True)
    N = proj.shape[0]
    scale = K ** -0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty(N, HV, V, dtype=proj.dtype, device=proj.device)
    elif out.shape != (N, HV, V) or out.dtype != proj.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{N}, {HV}, {V}] {proj.dtype} tensor")
    if not use_triton(proj):
        o = gated_delta_rule_decode_step_ref(proj, conv_state, conv_weight, A_log, dt_bias, state, state_slots,
                                             positions, H, K, HV, V, scale)
        if norm_weight is not None:
            z = proj[:, 2 * H * K + HV * V:2 * H * K + 2 * HV * V].unflatten(-1, (HV, V))
            o = gated_rms_norm_ref(o, z, norm_weight, eps, V)
        return out.copy_(o)
    if N == 0:
        return out
    # the geometry of fused_recurrent's sweep; a whole head a program for the norm
    block_v = V if norm_weight is not None else decode_block_v(N * HV, V, proj.device)
    pdl = use_pdl(proj.device)
    KW = conv_weight.shape[2]
    _decode_step_kernel[(cdiv(V, block_v), N * HV)](
        proj, conv_state, conv_weight, A_log, dt_bias, state, state_slots, positions,
        proj if norm_weight is None else norm_weight, out, proj.stride(0), conv_state.stride(0), scale, float(eps),
        H=H, HV=HV, K=K, V=V, KW=KW, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v,
        PROLOGUE=PROLOGUE_NONE if norm_weight is None else PROLOGUE_GATED_RMS_NORM,
        USE_PDL=pdl, num_warps=max(MIN_NUM_WARPS, decode_num_warps(next_power_of_2(K), block_v)), launch_pdl=pdl,
    )
    return out
