"""Triton kernels for the SwiGLU MLP: the gate/up GEMM with SwiGLU in its epilogue (prefill and
training), and the weight-streaming matrix-vector kernel for decode.

Shapes: x [M, D]; w13 [2F, D] with gate and up rows interleaved (row 2f = gate f, row 2f + 1 =
up f; nn.Linear layout); w2 [D, F]; h [M, F]; y [M, D].

``_gemm_swiglu_kernel``: a program owns a BLOCK_M x BLOCK_N tile of h, i.e. 2 * BLOCK_N rows of
w13, and accumulates one fp32 [BLOCK_M, 2 * BLOCK_N] product over the K loop (one wide dot: the x
tile is read from shared memory once per k-step). Interleaving puts each gate column next to its
up column, so the epilogue splits the accumulator into G and U within each thread's registers
(the MMA accumulator holds adjacent column pairs). The [M, 2F] product never reaches memory.
Forward epilogue: h = round(round(gate_factor(round(G))) * up_factor(round(U))), G and U rounded
to the input dtype first as an unfused GEMM would write them. Backward epilogue
(BACKWARD): loads dh and writes d_gate_up [M, 2F] in w13's interleaved column order, and h when
STORE_H, recomputing G and U instead of saving them.

``_gemm_swiglu_tma_kernel`` (Hopper, 16-bit forward): the same product and epilogue, operands
loaded by TMA descriptors (zero-filled past the edges, so no masks), h stored through one, and
persistent: min(tiles, SMs) programs walk the tiles, the tile loop flattened into the K loop so the
next tile's loads overlap this tile's epilogue. Same roundings as ``_gemm_swiglu_kernel``.

``_decode_gemv_kernel``: for M <= DECODE_MAX_M = 32. A program owns BLOCK_N output features and
streams their weight rows once, as the wide operand of the dot (out.T = W_tile @ x.T, M padded to
BLOCK_M = 16 or 32: ``decode_block_m``), so the
weight bytes dominate and are read exactly once. SWIGLU: the rows are interleaved gate/up pairs
(2 * BLOCK_N of them) and the epilogue applies SwiGLU; otherwise a plain x @ W.T (down).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fuselm.ops.common.activation import Activation, gate_factor, gate_factor_grad, up_factor, up_factor_grad
from fuselm.ops.common.matmul import decode_block_m, dot_acc, grouped_tile, load_k_step
from fuselm.runtime import arch_major, cdiv, num_sms


@triton.jit
def _gemm_swiglu_kernel(
    x_ptr, w_ptr, dh_ptr, out_ptr, h_ptr,
    M, F, D, stride_xm, stride_wn, stride_dhm, stride_om, stride_hm,
    limit, alpha, eps,
    ACT: tl.constexpr, BACKWARD: tl.constexpr, STORE_H: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(F, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    wrows = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # interleaved gate/up rows of w13
    k = tl.arange(0, BLOCK_K)
    # Out-of-range rows wrap to valid ones (their results are never stored), so the main loop
    # needs no row or column masks.
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm + k[None, :]
    w_ptrs = w_ptr + (wrows % (2 * F)).to(tl.int64)[None, :] * stride_wn + k[:, None]  # [BLOCK_K, 2 BLOCK_N] of w13.T
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        xt, w = load_k_step(x_ptrs, w_ptrs, k, D - k0, EVEN_K)
        acc = dot_acc(xt, w, acc, IEEE)
        if RMS:
            xf = xt.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    if RMS:
        # RMSNorm folded in: rms(x) @ W.T = rstd * (x @ (W * norm_weight).T), the norm weight
        # already multiplied into w13's columns by the caller.
        rstd = tl.rsqrt(sum_sq / D + eps)[:, None]
        g = g * rstd
        u = u * rstd
    # G and U rounded to the input dtype before the activation, as an unfused GEMM writes them
    # (HF's gate_proj / up_proj, vLLM's merged projection): the fused path then rounds where they do.
    g = g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(x_ptr.dtype.element_ty).to(tl.float32)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    a = gate_factor(g, ACT, limit, alpha).to(x_ptr.dtype.element_ty).to(tl.float32)
    uf = up_factor(u, ACT, limit)
    if BACKWARD:
        dh = tl.load(dh_ptr + rows64 * stride_dhm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d_gate = dh * uf * gate_factor_grad(g, ACT, limit, alpha)
        d_up = dh * a * up_factor_grad(u, ACT, limit)
        d_gu = tl.reshape(tl.join(d_gate, d_up), [BLOCK_M, 2 * BLOCK_N])  # back to interleaved order
        wcols = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        tl.store(out_ptr + rows64 * stride_om + wcols[None, :], d_gu.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & (wcols < 2 * F)[None, :])
        if STORE_H:
            tl.store(h_ptr + rows64 * stride_hm + cols[None, :], (a * uf).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + rows64 * stride_om + cols[None, :], (a * uf).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_swiglu_tma_kernel(
    x_desc, w_desc, h_desc, M, F, D, limit, alpha,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr,
):
    # Persistent: program p takes h tiles p, p + PROGRAMS, ... (grouped order); the tile loop is
    # flattened into the K loop so the next tile's TMA loads start under this tile's epilogue.
    # The descriptors zero-fill loads past M, 2F and D and clip stores past M and F: no masks.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(F, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            xt = x_desc.load([pid_m * BLOCK_M, k])
            w = w_desc.load([pid_n * 2 * BLOCK_N, k])  # 2 BLOCK_N interleaved gate/up rows
            acc = tl.dot(xt, w.T, acc)
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        dt = h_desc.dtype
        g = g.to(dt).to(tl.float32)  # rounded as _gemm_swiglu_kernel rounds them
        u = u.to(dt).to(tl.float32)
        a = gate_factor(g, ACT, limit, alpha).to(dt).to(tl.float32)
        h = (a * up_factor(u, ACT, limit)).to(dt)
        if SUBTILE:  # two half-width stores: half the epilogue's shared-memory staging
            h0, h1 = tl.split(tl.permute(tl.reshape(h, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))
            h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h0)
            h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], h1)
        else:
            h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h)


@triton.jit
def _decode_gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    limit, alpha,
    SWIGLU: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # SWIGLU: N output features read 2 * N interleaved weight rows.
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    wrows = tl.program_id(0) * W_ROWS + tl.arange(0, W_ROWS)
    rows = tl.arange(0, BLOCK_M)  # tokens, padded to BLOCK_M
    k = tl.arange(0, BLOCK_K)
    n_wrows = 2 * N if SWIGLU else N
    w_ptrs = w_ptr + (wrows % n_wrows).to(tl.int64)[:, None] * stride_wn + k[None, :]  # [W_ROWS, BLOCK_K]
    x_ptrs = x_ptr + rows[None, :] * stride_xm + k[:, None]  # [BLOCK_K, BLOCK_M] of x.T
    row_ok = (rows < M)[None, :]
    acc = tl.zeros([W_ROWS, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=row_ok, other=0.0)
        else:
            k_ok = k < K - k0
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=row_ok & k_ok[:, None], other=0.0)
        acc = dot_acc(w, xt, acc, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWIGLU:
        g, u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, BLOCK_M]), (0, 2, 1)))
        g = g.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as in _gemm_swiglu_kernel
        u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
        a = gate_factor(g, ACT, limit, alpha).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = a * up_factor(u, ACT, limit)
    mask = (cols < N)[:, None] & row_ok
    tl.store(out_ptr + rows[None, :] * stride_om + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- tuning tables
@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=64)
def gemm_config(arch: int, dtype: torch.dtype) -> GemmConfig:
    """Tile config of the fused gate/up GEMM. Hopper (9), 16-bit: 128 x 128 tiles of h (a
    128 x 256 tile of the [M, 2F] product), BLOCK_K 64, 8 warps, 3 stages: the best of the H100
    sweep at M=4096 (benchmarks/results/, mlp.md). The interpreter (0) and fp32 use small tiles."""
    if arch == 0 or dtype == torch.float32:
        return GemmConfig(32, 32, 32, 4, 4, 2)
    return GemmConfig(128, 128, 64, 8, 8, 3)


@dataclass(frozen=True)
class TmaGemmConfig(GemmConfig):
    """The TMA kernel's tile: ``GemmConfig``'s fields, then whether the epilogue stores h in two
    half-width tiles."""
    subtile: bool


# Hopper, 16-bit: H100 (benchmarks/gemm_swiglu_tma.py: CUDA graphs, 7 interleaved rounds; NOTES.md
# 61) at D 4096, F 12288 and 14336: 128 x 128 tiles of h (a 128 x 256 product), BLOCK_K 64, 3 stages,
# 8 warps, the epilogue stored in two halves, groups of 16 row blocks: 1.057-1.103x cuBLAS mm +
# silu_mul at M 1024-8192 (4 stages 1.045-1.088x, groups of 8 or 32 down to 1.008x; BLOCK_K 128 at
# 2 stages 0.82-0.84x in an earlier sweep).
TMA_HOPPER = TmaGemmConfig(128, 128, 64, 16, 8, 3, True)
TMA_INTERPRET = TmaGemmConfig(16, 16, 16, 4, 4, 1, True)


def tma_gemm_config(arch: int) -> TmaGemmConfig:
    """Tile config of the TMA gate/up GEMM (``gemm_swiglu_tma_kernel``): Hopper's, or the
    interpreter's small tiles (arch 0)."""
    return TMA_INTERPRET if arch == 0 else TMA_HOPPER


@functools.lru_cache(maxsize=64)
def gemv_config(arch: int, dtype: torch.dtype, swiglu: bool) -> GemvConfig:
    """Decode GEMV config: output features per program, the K step, warps, stages. Hopper,
    16-bit, from the H100 sweep at M=1 and 16 (benchmarks/results/, mlp.md): gate/up 64 features
    (128 weight rows) x 128, 4 stages; down 32 x 512, 3 stages. The same at 17-32 rows (32-row
    token tile; decode_gemv_sweep.md, 9B shapes: gate/up 87% of copy, cuBLAS 85%; down 78%, as
    cuBLAS; the best configs there within 2%). fp32 halves BLOCK_K (shared memory); the
    interpreter uses small tiles."""
    if arch == 0:
        return GemvConfig(16, 64, 4, 1)
    cfg = GemvConfig(64, 128, 4, 4) if swiglu else GemvConfig(32, 512, 4, 3)
    if dtype == torch.float32:
        cfg = GemvConfig(cfg.block_n // 2, cfg.block_k // 2, cfg.num_warps, 3)
    return cfg


# ----------------------------------------------------------------------------- host launchers
def gemm_swiglu_kernel(x, w13, act: Activation, out, dh=None, h=None, config: GemmConfig | None = None,
                       rms_eps: float | None = None):
    """Forward (dh None): out = h [M, F]. Backward: out = d_gate_up [M, 2F], and h if given.
    ``rms_eps``: forward only, RMSNorm of x folded in (w13 must carry the norm weight)."""
    M, D = x.shape
    F = w13.shape[0] // 2
    cfg = config or gemm_config(arch_major(x.device), x.dtype)
    grid = (cdiv(M, cfg.block_m) * cdiv(F, cfg.block_n),)
    backward = dh is not None
    _gemm_swiglu_kernel[grid](
        x, w13, dh if backward else x, out, h if h is not None else out,
        M, F, D, x.stride(0), w13.stride(0),
        dh.stride(0) if backward else 0, out.stride(0), h.stride(0) if h is not None else 0,
        act.kernel_limit, float(act.alpha), 0.0 if rms_eps is None else float(rms_eps),
        ACT=act.code, BACKWARD=backward, STORE_H=h is not None, IEEE=x.dtype == torch.float32,
        EVEN_K=D % cfg.block_k == 0, RMS=rms_eps is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def gemm_swiglu_tma_kernel(x, w13, act: Activation, out, config: TmaGemmConfig | None = None):
    """out = h [M, F] from x [M, D] and the interleaved w13 [2F, D] through TMA descriptors, one
    persistent launch of min(tiles, SMs) programs (SMs: 4 in the interpreter). The caller makes sure
    ``tma_ok(x, w13, out)`` and that the device has TMA (sm_90) or the interpreter runs it."""
    M, D = x.shape
    F = w13.shape[0] // 2
    cfg = config or tma_gemm_config(arch_major(x.device))
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w13, [2 * cfg.block_n, cfg.block_k])
    h_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n // 2 if cfg.subtile else cfg.block_n])
    programs = min(cdiv(M, cfg.block_m) * cdiv(F, cfg.block_n), num_sms(x.device))
    _gemm_swiglu_tma_kernel[(programs,)](
        x_desc, w_desc, h_desc, M, F, D, act.kernel_limit, float(act.alpha),
        ACT=act.code, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PROGRAMS=programs, SUBTILE=cfg.subtile, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def decode_gemv_kernel(x, w, out, act: Activation | None = None, config: GemvConfig | None = None):
    """out [M, N] = x [M, K] @ w.T for w [N, K]; or, with ``act``, w = w13 [2N, K] (interleaved)
    and out = SwiGLU(x @ w_gate.T, x @ w_up.T). M <= DECODE_MAX_M (32)."""
    M, K = x.shape
    swiglu = act is not None
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    cfg = config or gemv_config(arch_major(x.device), x.dtype, swiglu)
    act = act or Activation()
    _decode_gemv_kernel[(cdiv(N, cfg.block_n),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        act.kernel_limit, float(act.alpha),
        SWIGLU=swiglu, ACT=act.code, IEEE=x.dtype == torch.float32, EVEN_K=K % cfg.block_k == 0,
        BLOCK_M=decode_block_m(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
