"""Triton kernel for ``decode_linear``: a weight-streaming GEMV (M <= 32 tokens) with an
elementwise prologue applied to the input rows on the fly.

Shapes: x, gate [M, K] (row strides free, unit column stride); weight [N, K] (nn.Linear layout,
unit column stride); norm_weight [HEAD_DIM]; out [M, N] (row stride free, unit column stride).

Design (as ``_decode_gemv_kernel`` in ``fuselm/ops/swiglu_mlp/kernels.py``): a program owns
BLOCK_N output features and streams their weight rows once, as the wide operand of the dot
(out.T = W_tile @ a.T, the token dimension padded to BLOCK_M = 16 or 32: ``decode_block_m``), so
the weight bytes are read exactly once and dominate the traffic. At each K step the program loads
the [BLOCK_M, BLOCK_K] tile of
x (and gate), computes the prologue's ``a`` tile in fp32 registers, rounds it to the input
dtype (the contract's rounding, also the dot's operand type) and feeds it to the dot. Every
program recomputes the prologue of the whole input: M * K elements, L2-resident and small next to
its BLOCK_N * K weight elements.

``gated_rms_norm`` needs each head's sum of squares inside one K tile: BLOCK_K is a multiple of
HEAD_DIM (a power of two), the tile is viewed as [BLOCK_M, BLOCK_K / HEAD_DIM, HEAD_DIM] and reduced
over the last axis. The host launcher only takes this path when the config allows it
(``fused_prologue_ok``); otherwise the op computes the prologue in PyTorch and runs the plain kernel.

One token (M = 1) takes ``_decode_linear_vector_kernel`` instead: CUDA-core products of ROWS
weight rows and the prologue's vector, fp32 sums, no token padding (a 16-row tensor-core tile
computes 15 rows of zeros and holds a [BLOCK_N, 16] accumulator for one useful column).

Numerics: the prologue in fp32 with the roundings of ``naive.py``; the dot accumulates in fp32
(ieee for fp32 inputs; the vector kernel's products are fp32 multiplies) and the result is
rounded once to the output dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fuselm.ops.common.matmul import decode_block_m, dot_acc  # the same token padding and dot as swiglu_mlp
from fuselm.ops.common.pdl import allow_next_kernel, wait_for_previous_kernel
from fuselm.ops.common.prologue import PROLOGUE_GATED_RMS_NORM, PROLOGUE_NONE, PROLOGUE_SIGMOID_GATE, prologue_tile
from fuselm.runtime import arch_major, cdiv, next_power_of_2, use_pdl

# Prologue codes, as the constexpr the kernel takes.
PROLOGUE_CODES = {None: PROLOGUE_NONE, "sigmoid_gate": PROLOGUE_SIGMOID_GATE, "gated_rms_norm": PROLOGUE_GATED_RMS_NORM}


@triton.jit
def _prologue_kernel(
    x_ptr, g_ptr, nw_ptr, a_ptr, M, K, stride_xm, stride_gm, stride_am, eps,
    PROLOGUE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """a [M, K] = the prologue of x (and gate), written once: a program per [BLOCK_M, BLOCK_K] tile."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < M) & (k < K)[None, :]
    nw = 0.0
    if PROLOGUE == 2:
        nw = tl.load(nw_ptr + k % HEAD_DIM).to(tl.float32)[None, :]
    xt = tl.load(x_ptr + rows * stride_xm + k[None, :], mask=ok, other=0.0)
    a = prologue_tile(xt, g_ptr + rows * stride_gm + k[None, :], ok, nw, eps, PROLOGUE, HEAD_DIM, BLOCK_M, BLOCK_K)
    tl.store(a_ptr + rows * stride_am + k[None, :], a, mask=ok)


@triton.jit
def _decode_linear_kernel(
    x_ptr, g_ptr, nw_ptr, w_ptr, out_ptr,
    M, N, K, stride_xm, stride_gm, stride_wn, stride_om, eps,
    PROLOGUE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    wrows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)  # tokens, padded to BLOCK_M
    k = tl.arange(0, BLOCK_K)
    # Out-of-range weight rows wrap to valid ones (never stored): no row mask on the weight.
    w_ptrs = w_ptr + (wrows % N).to(tl.int64)[:, None] * stride_wn + k[None, :]  # [BLOCK_N, BLOCK_K]
    rows64 = rows.to(tl.int64)[:, None]
    # x and gate tiles [BLOCK_M, BLOCK_K] as stored (row-major: loads coalesced along K); the dot
    # takes their transpose.
    x_ptrs = x_ptr + rows64 * stride_xm + k[None, :]
    g_ptrs = g_ptr + rows64 * stride_gm + k[None, :]
    row_ok = (rows < M)[:, None]
    nw = 0.0
    if PROLOGUE == 2:
        # Each tile starts on a head boundary (BLOCK_K % HEAD_DIM == 0): one load of the norm weight.
        nw = tl.load(nw_ptr + k % HEAD_DIM).to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            ok = row_ok
            w = tl.load(w_ptrs)
        else:
            ok = row_ok & (k < K - k0)[None, :]
            w = tl.load(w_ptrs, mask=(k < K - k0)[None, :], other=0.0)
        xt = prologue_tile(tl.load(x_ptrs, mask=ok, other=0.0), g_ptrs, ok, nw, eps, PROLOGUE, HEAD_DIM, BLOCK_M, BLOCK_K)
        acc = dot_acc(w, tl.trans(xt), acc, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K

    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols < N)[:, None] & (rows < M)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _decode_linear_vector_kernel(
    x_ptr, g_ptr, nw_ptr, w_ptr, out_ptr, N, stride_xm, stride_gm, stride_wn, stride_om, stride_gh, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HEAD_DIM: tl.constexpr, GATE_HEAD: tl.constexpr,
    UNROLL: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Token by token on CUDA cores (program axis 1: the token, x, gate and out rows stride_xm,
    stride_gm, stride_om apart; ``decode_linear`` at one token, the MoE router at a few): a program
    owns ROWS weight rows of one token; at each K step the fp32 products of the [ROWS, BLOCK_K]
    weight tile and the prologue's ``a`` [1, BLOCK_K] are added to a [ROWS, BLOCK_K] fp32 sum,
    reduced over K once at the end. A tensor-core tile would pad the token to 16 rows; here every
    loaded weight element is one FMA. UNROLL (K a few steps): the loop is unrolled, so every weight
    load of the program is in flight at once. USE_PDL (launched as a programmatic dependent): the
    first K step's weights are loaded before the wait for the kernel ahead (x and gate are its
    output), so with BLOCK_K >= K the whole weight stream can run while a short kernel ahead (the
    Gated DeltaNet step, attention's combine) still computes. GATE_HEAD: the gate's columns come in
    heads of GATE_HEAD, stride_gh apart (0: one contiguous row), as Qwen3.5 attention's gate
    interleaved with the query in its projection."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n = tl.program_id(1).to(tl.int64)
    x_ptr += n * stride_xm
    g_ptr += n * stride_gm
    out_ptr += n * stride_om
    k = tl.arange(0, BLOCK_K)[None, :]
    # Weight rows past N wrap to valid ones (never stored): no row mask on the weight.
    w_ptrs = w_ptr + (r % N).to(tl.int64)[:, None] * stride_wn + k  # [ROWS, BLOCK_K]
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    w_first = _vector_weight_tile(w_ptrs, k, K, EVEN_K)
    nw = 0.0
    if PROLOGUE == 2:
        nw = tl.load(nw_ptr + k % HEAD_DIM).to(tl.float32)  # each K tile starts on a head boundary
    wait_for_previous_kernel(USE_PDL)
    # The kernel after it, if a programmatic dependent too (the Gated DeltaNet step after an input
    # projection, the norm after an output projection), may begin now: it loads what the kernels
    # before this one wrote, then waits for out.
    allow_next_kernel(USE_PDL)
    acc = _vector_products(w_first, x_ptr, g_ptr, stride_gh, 0, k, K, nw, eps, PROLOGUE, HEAD_DIM, GATE_HEAD, EVEN_K,
                           BLOCK_K)
    if UNROLL:
        for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):
            w = _vector_weight_tile(w_ptrs + k0, k, K - k0, EVEN_K)
            acc += _vector_products(w, x_ptr, g_ptr, stride_gh, k0, k, K, nw, eps, PROLOGUE, HEAD_DIM, GATE_HEAD,
                                    EVEN_K, BLOCK_K)
    else:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = _vector_weight_tile(w_ptrs + k0, k, K - k0, EVEN_K)
            acc += _vector_products(w, x_ptr, g_ptr, stride_gh, k0, k, K, nw, eps, PROLOGUE, HEAD_DIM, GATE_HEAD,
                                    EVEN_K, BLOCK_K)
    tl.store(out_ptr + r, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=r < N)


@triton.jit
def _vector_weight_tile(w_ptrs, k, k_left, EVEN_K: tl.constexpr):
    """A K step's weight tile [ROWS, BLOCK_K] at ``w_ptrs``; without EVEN_K the columns at
    k >= ``k_left`` load as zeros."""
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=k < k_left, other=0.0)


@triton.jit
def _vector_products(w, x_ptr, g_ptr, stride_gh, k0, k, K, nw, eps, PROLOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     GATE_HEAD: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 products [ROWS, BLOCK_K] of the weight tile ``w`` of the K step at ``k0`` and
    ``a`` = the prologue of x (and gate) at columns ``k0 + k`` (``k`` [1, BLOCK_K]; without EVEN_K
    the columns at or past K are zeros)."""
    col = k0 + k
    ok = k < (BLOCK_K if EVEN_K else K - k0)
    xt = tl.load(x_ptr + col, mask=ok, other=0.0)
    if GATE_HEAD == 0:
        g_ptrs = g_ptr + col
    else:
        g_ptrs = g_ptr + (col // GATE_HEAD) * stride_gh + col % GATE_HEAD
    a = prologue_tile(xt, g_ptrs, ok, nw, eps, PROLOGUE, HEAD_DIM, 1, BLOCK_K)
    return w.to(tl.float32) * a.to(tl.float32)


# ----------------------------------------------------------------------------- tuning config
@dataclass(frozen=True)
class DecodeLinearConfig:
    """block_n: output features (weight rows) per program; block_k: the K step; num_warps,
    num_stages: as Triton's launch options. block_n and block_k powers of two >= 16."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Hopper (sm_90), 16-bit: H100 sweep at the Qwen3.5-9B output projections (N = K = 4096, bf16,
# M = 1 / 8 / 16, 20 calls per CUDA graph; scratch sweep of 2026-11-22, NOTES.md entry 16):
# BLOCK_N 16/32/64 x BLOCK_K 128/256/512 x 3/4/6 stages. Best, as % of copy bandwidth on the
# weight: plain 77% (32 x 256, 4 stages; cuBLAS 66-70%), gated_rms_norm 71% / 51% / 53% (32 x 256,
# 4 stages), sigmoid_gate 57% / 55% / 55%. The previous 32 x 512 x 3 fell to 26-27% at M = 8 with
# a prologue.
HOPPER_BLOCK_N = 32
HOPPER_BLOCK_K = 256
HOPPER_NUM_WARPS = 4
HOPPER_NUM_STAGES = 4
# fp32: half the K step and 3 stages (shared memory per stage doubles with the element size), as
# gemv_config does.
FP32_BLOCK_K_DIVISOR = 2
FP32_NUM_STAGES = 3
# The prologue is fused into the GEMV for at most this many rows (per prologue); more rows run it
# first on its own (``_prologue_kernel``, one small launch) and then the plain GEMV. Every GEMV
# program recomputes the prologue over the whole [BLOCK_M, K] input, which costs more than the
# extra launch except for gated_rms_norm at one row. H100 (decode_gemv.md, N = K = 4096, bf16,
# session 12), us per call fused / apart: gated_rms_norm 16.6 / 18.6 at 1 row, 22.5 / 18.8 at 2,
# 21.7 / 21.0 at 16, 34.5 / 21.3 at 32; sigmoid_gate 20.3 / 17.8 at 1 row, 21.0 / 19.0 at 16
# (fused past 16 rows its 64 x 256 tile does not fit in shared memory).
FUSED_PROLOGUE_MAX_M = {"sigmoid_gate": 0, "gated_rms_norm": 1}
# The standalone prologue kernel's tile: rows x columns per program (columns a multiple of the
# head for gated_rms_norm).
PROLOGUE_BLOCK_M = 8
PROLOGUE_BLOCK_K = 512
PROLOGUE_NUM_WARPS = 4
INTERPRET_PROLOGUE_BLOCK_K = 64
# Other GPUs: the Hopper values (untuned).
# The Triton interpreter (arch 0, the CPU test suite): small tiles, so that the tests' odd shapes
# have several programs and a K tail.
INTERPRET_BLOCK_N = 16
INTERPRET_BLOCK_K = 64
# gated_rms_norm: BLOCK_K is raised to head_dim when head_dim is larger (a whole head per tile),
# up to this; larger heads take the unfused path.
MAX_FUSED_HEAD_DIM = 1024


@dataclass(frozen=True)
class DecodeVectorConfig:
    """The one-token kernel's launch: rows (weight rows per program) and block_k (the K step),
    powers of two; num_warps as Triton's launch option."""
    rows: int
    block_k: int
    num_warps: int


# One token, Hopper, 16-bit (NOTES.md 71; H100, N 2048 and 4096, K 4096, weight copies beyond the
# L2 in one graph, each config alone: decode_vector_sweep.md): 2 rows a program, K steps of 2048 on
# 8 warps (7.7 / 13.7 us plain at N 2048 / 4096, against the tensor-core tile's 10.2 / 15.3); with
# gated_rms_norm, whose prologue every program recomputes, 4 rows, steps of 1024 on 4 warps (8.6 /
# 15.6 us, against 14.3 / 16.5). Alone, other tiles come within ~0.5 us; in the 35B-A3B decode
# step, where the first step's weights load before the dependent-launch wait, these beat one step
# of the whole K (3.079 against 3.109 ms a step).
VECTOR_ROWS = 2
VECTOR_BLOCK_K = 2048
VECTOR_NUM_WARPS = 8
GATED_VECTOR_ROWS = 4
GATED_VECTOR_BLOCK_K = 1024
GATED_VECTOR_NUM_WARPS = 4
# fp32: half the K step (the same bytes a step).
FP32_VECTOR_BLOCK_K = 1024
# The interpreter: several programs and a K tail at the tests' odd shapes, few enough programs that a tiny
# model's decode steps stay short (the interpreter's cost is per program and per op, not per element).
INTERPRET_VECTOR_ROWS = 16
INTERPRET_VECTOR_BLOCK_K = 64
# The K loop is unrolled up to this many steps (every load in flight); longer K runs it rolled.
VECTOR_MAX_UNROLL_STEPS = 8


@functools.lru_cache(maxsize=128)
def decode_vector_config(arch: int, dtype: torch.dtype, prologue: str | None = None,
                         head_dim: int | None = None) -> DecodeVectorConfig:
    """The one-token kernel's config for compute capability major ``arch`` (0 = interpreter; other
    GPUs take Hopper's, untuned); for ``gated_rms_norm`` block_k is raised to ``head_dim`` when it
    is larger (whole heads per K step)."""
    if arch == 0:
        cfg = DecodeVectorConfig(INTERPRET_VECTOR_ROWS, INTERPRET_VECTOR_BLOCK_K, 4)
    else:
        if prologue == "gated_rms_norm":
            cfg = DecodeVectorConfig(GATED_VECTOR_ROWS, GATED_VECTOR_BLOCK_K, GATED_VECTOR_NUM_WARPS)
        else:
            cfg = DecodeVectorConfig(VECTOR_ROWS, VECTOR_BLOCK_K, VECTOR_NUM_WARPS)
        if dtype == torch.float32:
            cfg = DecodeVectorConfig(cfg.rows, min(cfg.block_k, FP32_VECTOR_BLOCK_K), cfg.num_warps)
    if prologue == "gated_rms_norm" and head_dim is not None and _pow2(head_dim) and head_dim <= MAX_FUSED_HEAD_DIM:
        cfg = DecodeVectorConfig(cfg.rows, max(cfg.block_k, head_dim), cfg.num_warps)
    return cfg


@functools.lru_cache(maxsize=128)
def decode_linear_config(arch: int, dtype: torch.dtype, prologue: str | None = None,
                         head_dim: int | None = None) -> DecodeLinearConfig:
    """The launch config for compute capability major ``arch`` (0 = interpreter) and ``dtype``
    (the same for 16- and 32-row token tiles: the 24/32-row sweep's best plain tile is 16 rows'
    32 x 256 x 4 stages). For ``gated_rms_norm`` BLOCK_K is a multiple of ``head_dim`` whenever the fused path can
    take it (power-of-two head_dim <= MAX_FUSED_HEAD_DIM)."""
    if arch == 0:
        cfg = DecodeLinearConfig(INTERPRET_BLOCK_N, INTERPRET_BLOCK_K, 4, 1)
    else:
        cfg = DecodeLinearConfig(HOPPER_BLOCK_N, HOPPER_BLOCK_K, HOPPER_NUM_WARPS, HOPPER_NUM_STAGES)
        if dtype == torch.float32:
            cfg = DecodeLinearConfig(cfg.block_n, cfg.block_k // FP32_BLOCK_K_DIVISOR, cfg.num_warps, FP32_NUM_STAGES)
    if prologue == "gated_rms_norm" and head_dim is not None and _pow2(head_dim) and head_dim <= MAX_FUSED_HEAD_DIM:
        cfg = DecodeLinearConfig(cfg.block_n, max(cfg.block_k, head_dim), cfg.num_warps, cfg.num_stages)
    return cfg


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_config(cfg) -> DecodeLinearConfig | DecodeVectorConfig:
    """ValueError naming ``config`` unless it is a usable DecodeLinearConfig or DecodeVectorConfig."""
    if isinstance(cfg, DecodeVectorConfig):
        for name in ("rows", "block_k"):
            value = getattr(cfg, name)
            if not (isinstance(value, int) and _pow2(value)):
                raise ValueError(f"config: {name} must be a power of two, got {value!r}")
    elif isinstance(cfg, DecodeLinearConfig):
        for name in ("block_n", "block_k"):
            value = getattr(cfg, name)
            if not (isinstance(value, int) and _pow2(value) and value >= 16):
                raise ValueError(f"config: {name} must be a power of two >= 16, got {value!r}")
        if not (isinstance(cfg.num_stages, int) and cfg.num_stages >= 1):
            raise ValueError(f"config: num_stages must be an int >= 1, got {cfg.num_stages!r}")
    else:
        raise TypeError(f"config: expected a DecodeLinearConfig or DecodeVectorConfig, got {type(cfg).__name__}")
    if not (isinstance(cfg.num_warps, int) and _pow2(cfg.num_warps) and cfg.num_warps <= 32):
        raise ValueError(f"config: num_warps must be a power of two <= 32, got {cfg.num_warps!r}")
    return cfg


def fused_prologue_ok(prologue: str | None, head_dim: int | None, cfg: DecodeLinearConfig | DecodeVectorConfig) -> bool:
    """Whether the kernel can apply ``prologue`` itself under ``cfg``: always, except
    gated_rms_norm, which needs whole heads per K tile (power-of-two head_dim dividing BLOCK_K)."""
    if prologue != "gated_rms_norm":
        return True
    return _pow2(head_dim) and cfg.block_k % head_dim == 0


def prologue_kernel_ok(prologue: str | None, head_dim: int | None) -> bool:
    """Whether ``prologue_kernel`` takes ``prologue``: gated_rms_norm needs a power-of-two
    head_dim <= MAX_FUSED_HEAD_DIM (whole heads per tile)."""
    return prologue != "gated_rms_norm" or (_pow2(head_dim) and head_dim <= MAX_FUSED_HEAD_DIM)


# ----------------------------------------------------------------------------- host launcher
def decode_linear_kernel(x, weight, out, prologue: str | None = None, gate=None, norm_weight=None,
                         eps: float = 1e-6, head_dim: int | None = None, *, config: DecodeLinearConfig):
    """out [M, N] = prologue(x) @ weight.T for x (and gate) [M, K], M <= DECODE_MAX_M (32), weight
    [N, K]; all with unit column stride. No checks (``op.py`` does them); no allocation, no sync.
    The caller makes sure ``fused_prologue_ok(prologue, head_dim, config)``."""
    M, K = x.shape
    N = weight.shape[0]
    code = PROLOGUE_CODES[prologue]
    _decode_linear_kernel[(cdiv(N, config.block_n),)](
        x, gate if gate is not None else x, norm_weight if norm_weight is not None else x, weight, out,
        M, N, K, x.stride(0), gate.stride(0) if gate is not None else 0, weight.stride(0), out.stride(0), float(eps),
        PROLOGUE=code, HEAD_DIM=head_dim if code == PROLOGUE_GATED_RMS_NORM else 1,
        IEEE=x.dtype == torch.float32, EVEN_K=K % config.block_k == 0,
        BLOCK_M=decode_block_m(M), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def decode_linear_vector_kernel(x, weight, out, prologue: str | None = None, gate=None, norm_weight=None,
                                eps: float = 1e-6, head_dim: int | None = None, *, config: DecodeVectorConfig):
    """out [M, N] = prologue(x) @ weight.T for x [M, K] (each token its own programs), weight
    [N, K], all with unit column stride, and gate [M, K] or in strided heads [M, heads, head]
    (heads x head = K, unit column stride); out with unit column stride. No checks (``op.py`` and
    ``fuselm.ops.moe.decode.router_logits`` do them); no allocation, no sync. The caller makes sure
    ``fused_prologue_ok(prologue, head_dim, config)``."""
    M, K = x.shape
    strided_gate = gate is not None and gate.dim() == 3
    N = weight.shape[0]
    code = PROLOGUE_CODES[prologue]
    pdl = use_pdl(x.device)
    # No wider step than K needs (a power of two, so whole heads still tile it).
    block_k = min(config.block_k, max(next_power_of_2(K), head_dim if code == PROLOGUE_GATED_RMS_NORM else 1))
    _decode_linear_vector_kernel[(cdiv(N, config.rows), M)](
        x, gate if gate is not None else x, norm_weight if norm_weight is not None else x, weight, out,
        N, x.stride(0), gate.stride(0) if gate is not None else 0, weight.stride(0), out.stride(0),
        gate.stride(1) if strided_gate else 0, float(eps),
        K=K, PROLOGUE=code, HEAD_DIM=head_dim if code == PROLOGUE_GATED_RMS_NORM else 1,
        GATE_HEAD=gate.shape[2] if strided_gate else 0,
        UNROLL=cdiv(K, block_k) <= VECTOR_MAX_UNROLL_STEPS, ROWS=config.rows, BLOCK_K=block_k,
        USE_PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out


def prologue_kernel(x, prologue: str, gate, norm_weight=None, eps: float = 1e-6, head_dim: int | None = None,
                    out=None):
    """a [M, K] = prologue(x) for x and gate [M, K] (unit column stride), in x's dtype (into ``out``
    when given: [M, K], unit column stride, x itself allowed: each program reads its tile before it
    writes it): one launch, the roundings of ``naive.py``. No checks (``op.py`` does them); the
    caller makes sure ``prologue_kernel_ok(prologue, head_dim)``."""
    M, K = x.shape
    a = torch.empty((M, K), dtype=x.dtype, device=x.device) if out is None else out
    code = PROLOGUE_CODES[prologue]
    head = head_dim if code == PROLOGUE_GATED_RMS_NORM else 1
    block_k = max(INTERPRET_PROLOGUE_BLOCK_K if arch_major(x.device) == 0 else PROLOGUE_BLOCK_K, head)
    _prologue_kernel[(cdiv(M, PROLOGUE_BLOCK_M), cdiv(K, block_k))](
        x, gate, norm_weight if norm_weight is not None else x, a, M, K, x.stride(0), gate.stride(0), a.stride(0),
        float(eps), PROLOGUE=code, HEAD_DIM=head, BLOCK_M=PROLOGUE_BLOCK_M, BLOCK_K=block_k,
        num_warps=PROLOGUE_NUM_WARPS,
    )
    return a
