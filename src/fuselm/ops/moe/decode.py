"""The decode path of the Qwen3.5-MoE sparse block (issue 19): a few tokens, each pair's expert
weights streamed by matrix-vector kernels, no pair sort, and the down GEMM, the routing weight and
the top-k sum in one launch.

At decode few tokens share an expert, so the grouped GEMMs' 16-row tiles held one real row,
their grids had few programs (9 blocks x 8 feature tiles at one token), and the combine was a
launch of its own. Here a program owns one pair's (or one token's) few output features and
streams their weight rows once; the expert ids are read from ``Routing.experts`` directly, so the
routing skips its sort (``route(..., sort=False)``). Per block: router GEMM, routing,
``pair_gate_up``, ``down_combine``: four launches.

Shapes: x [N, H]; w13 [E_total, 2F, H] with each expert's gate and up rows interleaved (row 2f =
gate f, row 2f + 1 = up f); w2 [E_total, H, F]; experts [N, S] int32, ids in [0, E_total) (the
routing's, trusted as the grouped GEMMs trust the pair list); weights [N, S] fp32;
h [N * S, F] in x's dtype, row p = n * S + j token n's slot j; out [N, H].

- ``pair_gate_up``: a program owns pair p and BLOCK_F features of h: the 2 BLOCK_F interleaved
  rows of w13[experts[p]] times x[p // S], K-step by K-step, products accumulated in fp32 (a
  [2 BLOCK_F, BLOCK_K] tile summed once at the end; a tensor-core dot on x padded to 16 columns
  was never faster in the H200 sweep), then the dense kernel's epilogue: G and U rounded to x's
  dtype, the gate factor rounded, the product rounded once.
- ``down_combine``: a program owns token n and BLOCK_H output features: for each slot j in order,
  y = round(h[n S + j] @ w2[e]^T) (fp32 sum, rounded to h's dtype as HF's down_proj output), then
  acc = fma(weights[n, j], y, acc) in fp32; out[n] = acc rounded once. The grouped path's
  ``expert_down`` + ``combine`` with no y in memory.

Numerics: ``grouped_gemm``'s contract (``naive.swiglu_moe_ref``: products rounded to the model
dtype, the weighted slots summed in fp32 in slot order, one rounding); only the fp32 summation
order inside each dot differs.

Bytes: a pair reads its expert's 3 F H weights once; tokens that share an expert (the shared
expert always) read it once each, at about the same time (the grid runs pairs fastest): L2 hits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselm.ops.common.activation import Activation, gate_factor, up_factor
from fuselm.ops.moe.grouped_gemm import (_check_out, _check_tensor, combine_ref, expert_down_ref,  # the same checks
                                         expert_gate_up_ref)
from fuselm.ops.moe.routing import sort_pairs_ref
from fuselm.runtime import cdiv, parse_dtype, use_triton


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _gemv_k_step(w_ptrs, v_ptrs, k, k_left, EVEN_K: tl.constexpr):
    """One K step of a matrix-vector product: the fp32 products of the weight tile [ROWS, BLOCK_K]
    at ``w_ptrs`` and the vector [BLOCK_K] at ``v_ptrs`` (K offsets ``k``; with ``EVEN_K`` False the
    columns at k >= ``k_left`` load as zeros), to be added to the caller's [ROWS, BLOCK_K] sums."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        v = tl.load(v_ptrs)
    else:
        k_ok = k < k_left
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=k_ok, other=0.0)
    return w.to(tl.float32) * v.to(tl.float32)[None, :]


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, experts_ptr, h_ptr,
    SLOTS, F, H, stride_xm, stride_we, stride_wn, stride_hm,
    limit, alpha,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)  # the pair: token p // S, slot p % S
    e = tl.load(experts_ptr + p).to(tl.int64)
    wrows = tl.program_id(1) * 2 * BLOCK_F + tl.arange(0, 2 * BLOCK_F)  # interleaved gate/up rows
    k = tl.arange(0, BLOCK_K)
    # Rows past 2F wrap to valid ones (never stored).
    w_ptrs = w_ptr + e * stride_we + (wrows % (2 * F)).to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + (p // SLOTS) * stride_xm + k
    acc = tl.zeros([2 * BLOCK_F, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc += _gemv_k_step(w_ptrs, x_ptrs, k, H - k0, EVEN_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gu = tl.sum(acc, axis=1)  # [2 BLOCK_F]: gate f at 2f, up f at 2f + 1
    g, u = tl.split(tl.reshape(gu, [BLOCK_F, 2]))
    # The dense kernel's roundings: G and U to x's dtype, the gate factor, the product once.
    g = g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(x_ptr.dtype.element_ty).to(tl.float32)
    a = gate_factor(g, ACT, limit, alpha).to(x_ptr.dtype.element_ty).to(tl.float32)
    hv = a * up_factor(u, ACT, limit)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    tl.store(h_ptr + p * stride_hm + cols, hv.to(h_ptr.dtype.element_ty), mask=cols < F)


@triton.jit
def _down_combine_kernel(
    h_ptr, w_ptr, experts_ptr, weights_ptr, out_ptr,
    H, stride_hm, stride_we, stride_wn, stride_om,
    SLOTS: tl.constexpr, F: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # output features: rows of w2[e]
    k = tl.arange(0, BLOCK_K)
    w_offs = (rows % H).to(tl.int64)[:, None] * stride_wn + k[None, :]  # rows past H wrap, never stored
    out = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Both loops unrolled (SLOTS and F are constexpr): no load waits on an earlier slot's sum, so
    # every slot's weight tiles can be in flight at once (a rolled loop kept one 16 KB tile in
    # flight a program: 12.5 us for 18.9 MB at one token on the H200).
    for j in tl.static_range(SLOTS):  # slot order: deterministic
        p = n * SLOTS + j
        e = tl.load(experts_ptr + p).to(tl.int64)
        w_ptrs = w_ptr + e * stride_we + w_offs
        h_ptrs = h_ptr + p * stride_hm + k
        acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, F, BLOCK_K):
            acc += _gemv_k_step(w_ptrs, h_ptrs, k, F - k0, EVEN_K)
            w_ptrs += BLOCK_K
            h_ptrs += BLOCK_K
        # The product rounded to h's dtype (HF's down_proj output), then weighted: one fma.
        y = tl.sum(acc, axis=1).to(h_ptr.dtype.element_ty).to(tl.float32)
        out = tl.fma(tl.load(weights_ptr + p), y, out)
    tl.store(out_ptr + n * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)


# ----------------------------------------------------------------------------- tile configs
@dataclass(frozen=True)
class PairGemvConfig:
    """Output features per program (``block``: h features for gate/up, so 2 * block rows of w13;
    hidden features for down), the K step, warps and stages (Triton's launch options)."""

    block: int
    block_k: int
    num_warps: int
    num_stages: int


# H200 sweeps (moe.py --sweep-decode, session 19, moe_decode_sweep.md; graph replays: the kernel +
# ~6 us of replay). gate/up: 8 features, K step 256, 4 warps first or within 1% at 1, 4, 8, 16
# tokens (18.5 / 43.3 / 71.7 / 115.7 us); a tensor-core dot variant (x padded to 16 columns) never
# among the first six, so it went; stages change nothing (Triton does not pipeline these plain
# loads). down_combine, loops unrolled: 4 features, K step 256 at <= 2 tokens (14.6 us at one token against 15.4 at 8
# features; 2 tokens 19.4 / 19.5), 8 features past that (4 tokens 26.8 against 30.0, 8 tokens
# 44.2 against 47.7, 16 tokens 70.9 against 72.2).
PAIR_GATE_UP_TILE = PairGemvConfig(8, 256, 4, 1)
DOWN_COMBINE_TILE = PairGemvConfig(8, 256, 4, 1)
DOWN_COMBINE_FEW_TILE, DOWN_COMBINE_FEW_TOKENS = PairGemvConfig(4, 256, 4, 1), 2
# The interpreter (CPU tests): small tiles, so odd shapes have several programs and a K tail.
INTERPRET_TILE = PairGemvConfig(8, 16, 4, 1)


def pair_gemv_config(kind: str, dtype: torch.dtype, device: torch.device, num_tokens: int) -> PairGemvConfig:
    """The tile of ``kind`` in {"gate_up", "down"} for ``dtype`` operands and ``num_tokens`` tokens
    (fp32: half the K step)."""
    if device.type != "cuda":
        return INTERPRET_TILE
    if kind == "gate_up":
        tile = PAIR_GATE_UP_TILE
    else:
        tile = DOWN_COMBINE_FEW_TILE if num_tokens <= DOWN_COMBINE_FEW_TOKENS else DOWN_COMBINE_TILE
    if dtype == torch.float32:
        return dataclasses.replace(tile, block_k=tile.block_k // 2)
    return tile


# ----------------------------------------------------------------------------- checks
def _check_weights(name, w, x_name, x, k_dim: int) -> None:
    _check_tensor(name, w, 3)
    if w.dtype != x.dtype:
        raise ValueError(f"{name}: dtype {w.dtype} does not match {x_name} {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"{name}: on {w.device}, {x_name} on {x.device}")
    if w.shape[2] != k_dim:
        raise ValueError(f"{name}: expected its last dimension = {k_dim} ({x_name}'s features), got {tuple(w.shape)}")


def _check_experts(experts, num_tokens: int, device) -> int:
    _check_tensor("experts", experts, 2, (torch.int32,))
    if experts.shape[0] != num_tokens or experts.shape[1] < 1 or not experts.is_contiguous():
        raise ValueError(f"experts: expected a contiguous [N = {num_tokens}, S >= 1] tensor, "
                         f"got {tuple(experts.shape)}")
    if experts.device != device:
        raise ValueError(f"experts: on {experts.device}, expected {device}")
    return experts.shape[1]


# ----------------------------------------------------------------------------- host functions
def pair_gate_up(x: torch.Tensor, w13: torch.Tensor, experts: torch.Tensor, activation: Activation, *,
                 out: torch.Tensor | None = None, config: PairGemvConfig | None = None) -> torch.Tensor:
    """h [N * S, F] in x's dtype: row n * S + j = the activation of x[n] through expert
    w13[experts[n, j]] (gate/up rows interleaved), as ``expert_gate_up`` computes it. One launch."""
    _check_tensor("x", x, 2)
    _check_weights("w13", w13, "x", x, x.shape[1])
    if w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E_total, 2F, H] (gate/up rows interleaved), got {tuple(w13.shape)}")
    if not isinstance(activation, Activation):
        raise ValueError(f"activation: expected an Activation, got {activation!r}")
    (N, H), F = x.shape, w13.shape[1] // 2
    S = _check_experts(experts, N, x.device)
    h = _check_out("out", out, (N * S, F), x.dtype, x.device)
    if not use_triton(x):
        return h.copy_(pair_gate_up_ref(x, w13, experts, activation))
    if N == 0 or F == 0:
        return h
    cfg = config or pair_gemv_config("gate_up", x.dtype, x.device, N)
    _pair_gate_up_kernel[(N * S, cdiv(F, cfg.block))](
        x, w13, experts, h,
        S, F, H, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        activation.kernel_limit, float(activation.alpha),
        ACT=activation.code, EVEN_K=H % cfg.block_k == 0, BLOCK_F=cfg.block, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return h


def down_combine(h: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 out_dtype: torch.dtype | str, *, out: torch.Tensor | None = None,
                 config: PairGemvConfig | None = None) -> torch.Tensor:
    """[N, H] in ``out_dtype``: out[n] = sum_j weights[n, j] * round(h[n S + j] @ w2[experts[n, j]]^T),
    in slot order as fp32 fused multiply-adds, rounded once: ``expert_down`` then ``combine`` in
    one launch. h [N * S, F], w2 [E_total, H, F] in h's dtype, experts [N, S] int32, weights [N, S]
    fp32."""
    _check_tensor("h", h, 2)
    _check_weights("w2", w2, "h", h, h.shape[1])
    _check_tensor("weights", weights, 2, (torch.float32,))
    N = weights.shape[0]
    S = _check_experts(experts, N, h.device)
    if tuple(weights.shape) != tuple(experts.shape) or not weights.is_contiguous() or weights.device != h.device:
        raise ValueError(f"weights: expected a contiguous {tuple(experts.shape)} tensor on {h.device} "
                         f"(experts' shape), got {tuple(weights.shape)} on {weights.device}")
    if h.shape[0] != N * S:
        raise ValueError(f"h: expected N * S = {N * S} rows, got shape {tuple(h.shape)}")
    out_dtype = parse_dtype(out_dtype, "out_dtype")
    H, F = w2.shape[1], h.shape[1]
    o = _check_out("out", out, (N, H), out_dtype, h.device)
    if not use_triton(h):
        return o.copy_(down_combine_ref(h, w2, experts, weights, out_dtype))
    if N == 0 or H == 0:
        return o
    cfg = config or pair_gemv_config("down", h.dtype, h.device, N)
    _down_combine_kernel[(N, cdiv(H, cfg.block))](
        h, w2, experts, weights, o,
        H, h.stride(0), w2.stride(0), w2.stride(1), o.stride(0),
        SLOTS=S, F=F, EVEN_K=F % cfg.block_k == 0, BLOCK_H=cfg.block, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o


# ----------------------------------------------------------------------------- references
def _pair_list(experts: torch.Tensor, num_experts_total: int):
    """The grouped path's pair list of [N, S] expert ids (16-row blocks): the references reuse its
    references, so both paths share one contract."""
    return (*sort_pairs_ref(experts, num_experts_total, 16), 16)


def pair_gate_up_ref(x, w13, experts, activation: Activation) -> torch.Tensor:
    """``pair_gate_up`` in plain PyTorch (``expert_gate_up_ref``: the dense contract per expert)."""
    return expert_gate_up_ref(x, w13, *_pair_list(experts, w13.shape[0])[:2], experts.shape[1], activation, 16)


def down_combine_ref(h, w2, experts, weights, out_dtype: torch.dtype) -> torch.Tensor:
    """``down_combine`` in plain PyTorch: ``expert_down_ref`` then ``combine_ref``."""
    return combine_ref(expert_down_ref(h, w2, *_pair_list(experts, w2.shape[0])), weights, out_dtype)
