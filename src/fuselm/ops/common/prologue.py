"""The elementwise prologues of Qwen3.5's output projections, as Triton tile functions: the
attention output's sigmoid gate and the Gated DeltaNet output's gated RMSNorm. ``decode_linear``
applies them to its input tiles; the kernels that produce those outputs (attention's split-K
decode combine, the Gated DeltaNet decode step and chunk output kernels) apply them before they
store, so the projection after them runs plain. One function each, so every place rounds as ``decode_linear/naive.py``
says, in the same operations.

Prologue codes (a kernel's constexpr argument: a jit function cannot read these module globals on a
GPU): 0 none, 1 sigmoid gate, 2 gated RMSNorm.
"""

from __future__ import annotations

import triton
import triton.language as tl

PROLOGUE_NONE = 0
PROLOGUE_SIGMOID_GATE = 1
PROLOGUE_GATED_RMS_NORM = 2


@triton.jit
def prologue_tile(xt, g_ptrs, ok, nw, eps, PROLOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The prologue of an x tile ``xt`` [BLOCK_M, BLOCK_K] (entries outside ``ok`` loaded as 0), in
    x's dtype; the gate tile is loaded at ``g_ptrs``; ``nw`` [1, BLOCK_K] is the norm weight per
    column (gated RMSNorm; the tile starts on a head boundary and holds whole heads of HEAD_DIM,
    a power of two)."""
    dt = xt.dtype
    if PROLOGUE == 1:
        # s = round(sigmoid(gate)); a = round(x * s)
        gf = tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32)
        s = (1.0 / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
        xt = (xt.to(tl.float32) * s).to(dt)
    elif PROLOGUE == 2:
        # r = rsqrt(mean(x^2 over the head) + eps); n1 = round(x r); n2 = round(w n1);
        # a = round(n2 silu(z)). Masked entries (padding rows, the K tail) are zeros, whose
        # r may be inf (eps = 0): they are forced back to 0.
        xf = xt.to(tl.float32)
        zf = tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.reshape(xf, [BLOCK_M, BLOCK_K // HEAD_DIM, HEAD_DIM])
        r = tl.rsqrt(tl.sum(x3 * x3, axis=2) / HEAD_DIM + eps)  # [BLOCK_M, heads]
        n1 = tl.reshape((x3 * r[:, :, None]).to(dt), [BLOCK_M, BLOCK_K]).to(tl.float32)
        n2 = (nw * n1).to(dt).to(tl.float32)
        a = (n2 * (zf / (1.0 + tl.exp(-zf)))).to(dt)
        xt = tl.where(ok, a, 0.0).to(dt)
    return xt
