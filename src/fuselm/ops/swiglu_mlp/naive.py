"""Plain-PyTorch references for the gate/up GEMM with SwiGLU and the whole SwiGLU MLP.

Weight layout: ``w13`` is [2F, D] with the gate and up projections' rows interleaved: row 2f
is gate row f, row 2f + 1 is up row f (nn.Linear layout [out_features, in_features];
``interleave_gate_up`` builds it). ``w2`` is the down projection, [D, F].

Numerics contract of the fused path: the gate and up GEMMs accumulate in fp32 and are rounded
to the input dtype, as HF's gate_proj / up_proj outputs are (so the fused MLP matches HF Llama /
Qwen3.5 and vLLM's merged projection up to summation order); the activation then follows the
SwiGLU contract of ``fuselm.ops.common.activation`` (gate factor rounded to the input dtype,
times the up factor, one final rounding).
"""

from __future__ import annotations

import torch

from fuselm.ops.common.activation import Activation, gate_factor_ref, up_factor_ref
from fuselm.ops.common.precision import work_dtype


def _gate_up(xw: torch.Tensor, w13: torch.Tensor, dtype: torch.dtype):
    """G, U = xw @ w_gate.T, xw @ w_up.T in xw's precision, each rounded to ``dtype`` (the contract)."""
    work = xw.dtype
    return ((xw @ w13[i::2].to(work).T).to(dtype).to(work) for i in (0, 1))


def gemm_swiglu_ref(x: torch.Tensor, w13: torch.Tensor, act: Activation = Activation()) -> torch.Tensor:
    """``act(x @ w_gate.T) * (x @ w_up.T)`` per the contract above: [..., D] -> [..., F]."""
    work = work_dtype(x)
    xw = x.to(work)
    g, u = _gate_up(xw, w13, x.dtype)
    a = gate_factor_ref(g, act).to(x.dtype).to(work)
    return (a * up_factor_ref(u, act)).to(x.dtype)


def swiglu_mlp_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Activation = Activation()) -> torch.Tensor:
    """``gemm_swiglu_ref(x) @ w2.T``, the hidden activation rounded to x's dtype, fp32 accumulation."""
    h = gemm_swiglu_ref(x, w13, act)
    return (h.to(work_dtype(x)) @ w2.to(work_dtype(x)).T).to(x.dtype)


def gemm_swiglu_backward_ref(x, w13, dh, act: Activation = Activation()):
    """(d_gate_up [..., 2F] in w13's interleaved order, h [..., F]) from the recomputed
    pre-activations, in fp32."""
    work = work_dtype(x)
    xw = x.to(work)
    g, u = _gate_up(xw, w13, x.dtype)
    dh = dh.to(work)
    c = g if act.kind == "silu" else torch.clamp(g, max=act.limit)
    s = torch.sigmoid(act.alpha * c)
    d_gate_factor = s * (1.0 + act.alpha * c * (1.0 - s))
    d_up_factor = torch.ones_like(u)
    if act.kind != "silu":
        d_gate_factor = torch.where(g > act.limit, 0.0, d_gate_factor)
        d_up_factor = ((u >= -act.limit) & (u <= act.limit)).to(work)
    a = gate_factor_ref(g, act).to(x.dtype).to(work)
    uf = up_factor_ref(u, act)
    d_gu = torch.stack([dh * uf * d_gate_factor, dh * a * d_up_factor], dim=-1).flatten(-2)
    return d_gu.to(x.dtype), (a * uf).to(x.dtype)
