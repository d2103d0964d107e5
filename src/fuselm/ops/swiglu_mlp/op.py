"""Gate/up GEMM with SwiGLU (``gemm_swiglu``) and the whole MLP (``swiglu_mlp``): weight packing,
checks, the compute paths, autograd (eager) and ``torch.library`` ops (compile), and the module.

Paths by token count M (rows of x):
- M <= 32 (decode, ``DECODE_MAX_M``): ``_decode_gemv_kernel`` streams the gate/up weight once with
  SwiGLU in its epilogue, then the down weight once: two launches for the whole MLP.
- M >= TMA_MIN_ROWS (or from 512 rows when the tiles fill the last wave: ``tma_pays``), 16-bit,
  Hopper (prefill, training's forward): ``_gemm_swiglu_tma_kernel``,
  the gate/up GEMM with SwiGLU in its epilogue, operands through TMA descriptors, persistent over
  the h tiles: no [M, 2F] temporary; 1.06-1.10x cuBLAS mm + silu_mul at D 4096, F 12288 / 14336,
  M 1024-8192 (H100, benchmarks/results/.../gemm_swiglu_tma.md; NOTES.md 61).
- Otherwise past 32 rows (a server's mixed steps, short prompt chunks, fp32): ``torch.mm`` (cuBLAS) for
  the [M, 2F] gate/up product with the interleaved weight (G, U rounded to the dtype: the
  contract's roundings), then SwiGLU over its (G, U) column pairs in one elementwise kernel
  (``swiglu_pairs_forward_kernel``), CUBLAS_SWIGLU_ROWS rows at a time (the [rows, 2F]
  temporary: 403 MB at the 9B shape). Measured on the H100, 9B shape (D 4096, 2F 24576, ms):
  against the fused ``_gemm_swiglu_kernel`` (tensor cores, SwiGLU epilogue, no temporary)
  0.637 vs 0.623 at M = 2048, 1.30 vs 1.42 at 4096, 2.48 vs 2.80 at 8192, 4.98 vs 6.50 at 16384
  in 8192-row slices (5.25 in one); prefill 32 x 512 408 -> 388 ms (benchmarks/NOTES.md 56);
  at M = 256 0.099 against 0.112-0.125 for the fused kernel's tiles (mlp_small_m.md). The
  pointer-based fused kernel stays for the backward (below).
  fp32 follows torch's matmul settings here (ieee unless TF32 is allowed).
- Backward: the GEMM kernel recomputes G and U and writes dG, dU (and h for the down weight's
  gradient); only x and the weights are saved. dx and the weight gradients are cuBLAS GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn

from fuselm.ops.common.activation import Activation
from fuselm.ops.common.matmul import DECODE_MAX_M, tma_ok
from fuselm.ops.silu_mul.kernels import swiglu_pairs_forward_kernel
from fuselm.ops.swiglu_mlp.kernels import TMA_HOPPER, decode_gemv_kernel, gemm_swiglu_kernel, gemm_swiglu_tma_kernel
from fuselm.ops.swiglu_mlp.naive import gemm_swiglu_backward_ref, gemm_swiglu_ref
from fuselm.runtime import (arch_major, as_rows, cdiv, check_out, check_same_device, check_tensor, needs_autograd,
                             num_sms, use_triton)

# Rows of x per cuBLAS gate/up product in the forward (bounds its [rows, 2F] temporary; the H100
# took 4.98 ms at M = 16384 in 8192-row slices against 5.25 in one, 9B shape).
CUBLAS_SWIGLU_ROWS = 8192
# The forward's TMA kernel (16-bit, Hopper) from TMA_MIN_ROWS rows; from TMA_FULL_WAVE_ROWS rows when
# its h tiles fill at least TMA_LAST_WAVE of their last wave of programs; otherwise cuBLAS + the
# pairs kernel. H100 (gemm_swiglu_tma.md, D 4096): from 1024 rows 1.06-1.10x of cuBLAS + silu_mul
# at F 12288 and 14336; at 512 rows 1.05x at F 12288 (384 tiles: the third wave 91% full) but 0.95x
# at 14336 (448 tiles: the fourth 39% full); at 256 0.5x (NOTES.md 61, 64).
TMA_MIN_ROWS = 1024
TMA_FULL_WAVE_ROWS = 512
TMA_LAST_WAVE = 0.9


def tma_pays(m: int, f: int, programs: int) -> bool:
    """Whether the forward of m rows into f features takes the TMA kernel on ``programs``
    multiprocessors (given a device that has it and operands it can address)."""
    if m >= TMA_MIN_ROWS:
        return True
    if m < TMA_FULL_WAVE_ROWS:
        return False
    tiles = cdiv(m, TMA_HOPPER.block_m) * cdiv(f, TMA_HOPPER.block_n)
    return tiles / (cdiv(tiles, programs) * programs) >= TMA_LAST_WAVE


# ----------------------------------------------------------------------------- weight layout
def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The gate/up weight the kernels read: [2F, D], row 2f = w_gate[f], row 2f + 1 = w_up[f].

    Each [F, D] in the nn.Linear layout. A Hugging Face Llama/Qwen MLP loads with
    ``interleave_gate_up(mlp.gate_proj.weight, mlp.up_proj.weight)``; a vLLM-style merged
    ``gate_up_proj.weight`` [2F, D] (gate rows, then up rows) with ``interleave_gate_up(*w.chunk(2))``.
    """
    check_tensor("w_gate", w_gate)
    check_tensor("w_up", w_up)
    check_same_device(w_gate=w_gate, w_up=w_up)
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate, w_up: expected two [F, D] weights of one shape, got {tuple(w_gate.shape)} "
                         f"and {tuple(w_up.shape)}")
    if w_gate.dtype != w_up.dtype:
        raise TypeError(f"w_up: dtype {w_up.dtype} does not match w_gate {w_gate.dtype}")
    return torch.stack([w_gate.detach(), w_up.detach()], dim=1).reshape(-1, w_gate.shape[1])


def deinterleave_gate_up(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_gate_up`: (w_gate, w_up), strided views of ``w13``."""
    _check_w13(w13, None)
    return w13[0::2], w13[1::2]


# ----------------------------------------------------------------------------- checks
def _check_w13(w13, x) -> None:
    check_tensor("w13", w13)
    if w13.dim() != 2 or w13.shape[0] % 2:
        raise ValueError(f"w13: expected the [2F, D] interleaved gate/up weight from "
                         f"interleave_gate_up(w_gate, w_up), got shape {tuple(w13.shape)}")
    if w13.stride(-1) != 1:
        raise ValueError("w13: rows must be contiguous (last-dim stride 1); pass w13.contiguous() once at load")
    if x is not None:
        if w13.shape[1] != x.shape[-1]:
            raise ValueError(f"w13: in-features {w13.shape[1]} do not match x's last dim {x.shape[-1]}")
        if w13.dtype != x.dtype:
            raise TypeError(f"w13: dtype {w13.dtype} does not match x {x.dtype}")


def _check_inputs(x, w13, w2=None) -> None:
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: must have at least one dimension")
    _check_w13(w13, x)
    if w2 is not None:
        check_tensor("w2", w2)
        if w2.shape != (w13.shape[1], w13.shape[0] // 2):
            raise ValueError(f"w2: expected the down weight [D, F] = {(w13.shape[1], w13.shape[0] // 2)}, "
                             f"got {tuple(w2.shape)}")
        if w2.dtype != x.dtype:
            raise TypeError(f"w2: dtype {w2.dtype} does not match x {x.dtype}")
        if w2.stride(-1) != 1:
            raise ValueError("w2: rows must be contiguous (last-dim stride 1)")
    check_same_device(x=x, w13=w13, w2=w2)


# ----------------------------------------------------------------------------- compute (2-D x)
def _empty_h(x, w13):
    return torch.empty((x.shape[0], w13.shape[0] // 2), dtype=x.dtype, device=x.device)


def _empty_y(x, w2):
    return torch.empty((x.shape[0], w2.shape[0]), dtype=x.dtype, device=x.device)


def _gemm_swiglu(x: torch.Tensor, w13: torch.Tensor, act: Activation, out: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return out.copy_(gemm_swiglu_ref(x, w13, act))
    if x.shape[0] == 0:
        return out
    if x.shape[0] <= DECODE_MAX_M:
        return decode_gemv_kernel(x, w13, out, act)
    if arch_major(x.device) == 9 and tma_pays(x.shape[0], out.shape[1], num_sms(x.device)) and tma_ok(x, w13, out):
        return gemm_swiglu_tma_kernel(x, w13, act, out)
    for s in range(0, x.shape[0], CUBLAS_SWIGLU_ROWS):
        rows = slice(s, s + CUBLAS_SWIGLU_ROWS)
        swiglu_pairs_forward_kernel(torch.mm(x[rows], w13.T), out[rows], act)
    return out


def _swiglu_mlp(x, w13, w2, act: Activation, out: torch.Tensor) -> torch.Tensor:
    h = _gemm_swiglu(x, w13, act, _empty_h(x, w13))
    if use_triton(x) and 0 < x.shape[0] <= DECODE_MAX_M:
        return decode_gemv_kernel(h, w2, out)
    return torch.matmul(h, w2.T, out=out)


def _gemm_swiglu_backward(x, w13, dh, act: Activation, want_h: bool):
    """(d_gate_up [M, 2F], h [M, F] or None) with G, U recomputed."""
    if not use_triton(x):
        d_gu, h = gemm_swiglu_backward_ref(x, w13, dh, act)
        return d_gu, h if want_h else None
    M, F = x.shape[0], w13.shape[0] // 2
    d_gu = torch.empty((M, 2 * F), dtype=x.dtype, device=x.device)
    h = torch.empty((M, F), dtype=x.dtype, device=x.device) if want_h else None
    if M > 0:
        gemm_swiglu_kernel(x, w13, act, d_gu, dh=dh, h=h)
    return d_gu, h


def _gemm_swiglu_grads(x, w13, dh, act: Activation):
    """(dx, dw13) of ``gemm_swiglu`` for upstream dh [M, F]."""
    d_gu, _ = _gemm_swiglu_backward(x, w13, dh.contiguous(), act, want_h=False)
    return d_gu @ w13, d_gu.T @ x  # d_gu's columns are in w13's interleaved row order


def _swiglu_mlp_grads(x, w13, w2, dy, act: Activation):
    """(dx, dw13, dw2) of ``swiglu_mlp`` for upstream dy [M, D]. Intermediates are dropped as
    soon as they are used: the peak is dh + d_gate_up + h, [M, 4F] in all."""
    dh = dy @ w2
    d_gu, h = _gemm_swiglu_backward(x, w13, dh, act, want_h=True)
    del dh
    dw2 = dy.T @ h
    del h
    return d_gu @ w13, d_gu.T @ x, dw2


# ----------------------------------------------------------------------------- checked host functions
def gemm_swiglu_forward(x, w13, activation="silu", *, out=None) -> torch.Tensor:
    """``gemm_swiglu`` without autograd for 2-D x [M, D], into ``out`` [M, F] if given."""
    _check_inputs(x, w13)
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, D], got shape {tuple(x.shape)}")
    return _gemm_swiglu(as_rows("x", x), w13, Activation.parse(activation), check_out("out", out, _empty_h(x, w13)))


def swiglu_mlp_forward(x, w13, w2, activation="silu", *, out=None) -> torch.Tensor:
    """``swiglu_mlp`` without autograd for 2-D x [M, D], into ``out`` [M, D] if given."""
    _check_inputs(x, w13, w2)
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, D], got shape {tuple(x.shape)}")
    return _swiglu_mlp(as_rows("x", x), w13, w2, Activation.parse(activation), check_out("out", out, _empty_y(x, w2)))


# ----------------------------------------------------------------------------- autograd (eager)
class _GemmSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, act):
        ctx.save_for_backward(x, w13)
        ctx.act = act
        return _gemm_swiglu(x, w13, act, _empty_h(x, w13))

    @staticmethod
    def backward(ctx, dh):
        x, w13 = ctx.saved_tensors
        return (*_gemm_swiglu_grads(x, w13, dh, ctx.act), None)


class _SwiGLUMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, act):
        ctx.save_for_backward(x, w13, w2)
        ctx.act = act
        return _swiglu_mlp(x, w13, w2, act, _empty_y(x, w2))

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2 = ctx.saved_tensors
        return (*_swiglu_mlp_grads(x, w13, w2, dy.contiguous(), ctx.act), None)


# ----------------------------------------------------------------------------- torch.library ops (compile)
@torch.library.custom_op("fuselm::gemm_swiglu", mutates_args=())
def _gemm_swiglu_op(x: torch.Tensor, w13: torch.Tensor, kind: str, limit: float, alpha: float) -> torch.Tensor:
    return _gemm_swiglu(x, w13, Activation(kind, limit, alpha), _empty_h(x, w13))


@_gemm_swiglu_op.register_fake
def _(x, w13, kind, limit, alpha):
    return x.new_empty((x.shape[0], w13.shape[0] // 2))


@torch.library.custom_op("fuselm::gemm_swiglu_backward", mutates_args=())
def _gemm_swiglu_backward_op(
    x: torch.Tensor, w13: torch.Tensor, dh: torch.Tensor, kind: str, limit: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _gemm_swiglu_grads(x, w13, dh, Activation(kind, limit, alpha))


@_gemm_swiglu_backward_op.register_fake
def _(x, w13, dh, kind, limit, alpha):
    return torch.empty_like(x), torch.empty_like(w13)


@torch.library.custom_op("fuselm::swiglu_mlp", mutates_args=())
def _swiglu_mlp_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kind: str, limit: float, alpha: float) -> torch.Tensor:
    return _swiglu_mlp(x, w13, w2, Activation(kind, limit, alpha), _empty_y(x, w2))


@_swiglu_mlp_op.register_fake
def _(x, w13, w2, kind, limit, alpha):
    return x.new_empty((x.shape[0], w2.shape[0]))


@torch.library.custom_op("fuselm::swiglu_mlp_backward", mutates_args=())
def _swiglu_mlp_backward_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, dy: torch.Tensor, kind: str, limit: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _swiglu_mlp_grads(x, w13, w2, dy.contiguous(), Activation(kind, limit, alpha))


@_swiglu_mlp_backward_op.register_fake
def _(x, w13, w2, dy, kind, limit, alpha):
    return torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2)


def _save_inputs(ctx, inputs, output):
    *tensors, kind, limit, alpha = inputs
    ctx.save_for_backward(*tensors)
    ctx.act = (kind, limit, alpha)


def _gemm_swiglu_autograd(ctx, dh):
    x, w13 = ctx.saved_tensors
    return (*_gemm_swiglu_backward_op(x, w13, dh, *ctx.act), None, None, None)


def _swiglu_mlp_autograd(ctx, dy):
    x, w13, w2 = ctx.saved_tensors
    return (*_swiglu_mlp_backward_op(x, w13, w2, dy, *ctx.act), None, None, None)


torch.library.register_autograd("fuselm::gemm_swiglu", _gemm_swiglu_autograd, setup_context=_save_inputs)
torch.library.register_autograd("fuselm::swiglu_mlp", _swiglu_mlp_autograd, setup_context=_save_inputs)


# ----------------------------------------------------------------------------- public API
def gemm_swiglu(x: torch.Tensor, w13: torch.Tensor, activation: Activation | str = "silu") -> torch.Tensor:
    """``act(x @ w_gate.T) * (x @ w_up.T)`` without writing the [M, 2F] product; differentiable.

    Args:
        x: [..., D] fp16/bf16/fp32.
        w13: [2F, D] from :func:`interleave_gate_up`, x's dtype.
        activation: "silu" or an :class:`~fuselm.ops.common.activation.Activation`.
    Returns:
        h: [..., F] in x's dtype (numerics: ``fuselm/ops/swiglu_mlp/naive.py``).
    """
    _check_inputs(x, w13)
    act = Activation.parse(activation)
    x2 = as_rows("x", x)
    if torch.compiler.is_compiling():
        h = _gemm_swiglu_op(x2, w13, act.kind, act.limit, act.alpha)
    elif needs_autograd(x, w13):
        h = _GemmSwiGLUFunction.apply(x2, w13, act)
    else:
        h = _gemm_swiglu(x2, w13, act, _empty_h(x2, w13))
    return h.view(*x.shape[:-1], w13.shape[0] // 2)


def swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: Activation | str = "silu") -> torch.Tensor:
    """The SwiGLU MLP ``down(act(gate(x)) * up(x))``; differentiable.

    Args:
        x: [..., D] fp16/bf16/fp32.
        w13: [2F, D] from :func:`interleave_gate_up`; w2: [D, F] (``down_proj.weight``); x's dtype.
        activation: "silu" or an :class:`~fuselm.ops.common.activation.Activation`.
    Returns:
        y: [..., D]. Decode (<= 32 rows) is two weight-streaming launches; prefill is the fused
        gate/up GEMM then a cuBLAS down GEMM.
    """
    _check_inputs(x, w13, w2)
    act = Activation.parse(activation)
    x2 = as_rows("x", x)
    if torch.compiler.is_compiling():
        y = _swiglu_mlp_op(x2, w13, w2, act.kind, act.limit, act.alpha)
    elif needs_autograd(x, w13, w2):
        y = _SwiGLUMLPFunction.apply(x2, w13, w2, act)
    else:
        y = _swiglu_mlp(x2, w13, w2, act, _empty_y(x2, w2))
    return y.view(*x.shape[:-1], w2.shape[0])


class SwiGLUMLP(nn.Module):
    """A gated MLP on fuselm kernels: ``w13`` [2F, D] (gate/up interleaved) and ``w2`` [D, F] (down)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: Activation | str = "silu",
                 device=None, dtype=None):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(hidden_size, intermediate_size, device=device, dtype=dtype))
        self.activation = Activation.parse(activation)
        bound = hidden_size ** -0.5
        nn.init.uniform_(self.w13, -bound, bound)
        nn.init.uniform_(self.w2, -intermediate_size ** -0.5, intermediate_size ** -0.5)

    @classmethod
    def from_hf(cls, mlp: nn.Module, activation: Activation | str = "silu") -> "SwiGLUMLP":
        """From a Hugging Face Llama/Qwen MLP (``gate_proj``, ``up_proj``, ``down_proj``, no bias)."""
        w_gate, w_up, w_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        module = cls(w_gate.shape[1], w_gate.shape[0], activation, device="meta")
        module.w13 = nn.Parameter(interleave_gate_up(w_gate, w_up))
        module.w2 = nn.Parameter(w_down.detach().contiguous())
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.w13, self.w2, self.activation)

    def extra_repr(self) -> str:
        return f"hidden={self.w13.shape[1]}, intermediate={self.w13.shape[0] // 2}, {self.activation}"
