"""``silu_mul``: checked host functions, autograd, the ``torch.library`` ops, the module.

Two entry points share one forward and one backward: eager calls go through an
``autograd.Function`` (a few µs of host time), calls under ``torch.compile`` through the
``torch.library`` custom ops, which the compiler traces with their fake implementations. The
custom-op dispatch costs 11 µs more per call without grad and 30 µs more with grad than the
Function on our CPU (measured with tiny tensors), which is the whole kernel time at decode.
"""

from __future__ import annotations

import torch
from torch import nn

from fuselm.ops.common.activation import Activation
from fuselm.ops.silu_mul.kernels import silu_mul_backward_kernel, silu_mul_forward_kernel
from fuselm.ops.silu_mul.naive import silu_mul_backward_ref, silu_mul_ref
from fuselm.runtime import as_rows, check_match, check_out, check_same_device, check_tensor, needs_autograd, use_triton


def _check_inputs(gate, up) -> None:
    check_tensor("gate", gate)
    check_tensor("up", up)
    check_same_device(gate=gate, up=up)
    check_match("up", up, "gate", gate)


def _forward(gate, up, act: Activation, out, geometry=None) -> torch.Tensor:
    if gate.numel() == 0:
        return out
    if not use_triton(gate):
        return out.copy_(silu_mul_ref(gate, up, act))
    silu_mul_forward_kernel(as_rows("gate", gate), as_rows("up", up), out.view(-1, out.shape[-1]), act, geometry)
    return out


def _backward(grad, gate, up, act: Activation, d_gate, d_up, geometry=None):
    if gate.numel() == 0:
        return d_gate, d_up
    if not use_triton(gate):
        dg, du = silu_mul_backward_ref(grad, gate, up, act)
        return d_gate.copy_(dg), d_up.copy_(du)
    n = gate.shape[-1]
    silu_mul_backward_kernel(
        as_rows("grad", grad), as_rows("gate", gate), as_rows("up", up), d_gate.view(-1, n), d_up.view(-1, n), act, geometry
    )
    return d_gate, d_up


# ----------------------------------------------------------------------------- checked host functions
def silu_mul_forward(gate, up, activation="silu", *, out=None, geometry: str | None = None) -> torch.Tensor:
    """Forward without autograd, into ``out`` if given (a contiguous buffer, e.g. a CUDA-graph
    static output). ``geometry`` forces "row" or "tiled" launch geometry (tests); None chooses."""
    _check_inputs(gate, up)
    act = Activation.parse(activation)
    return _forward(gate, up, act, check_out("out", out, gate), geometry)


def silu_mul_backward(grad, gate, up, activation="silu", *, geometry: str | None = None):
    """(d_gate, d_up) of ``silu_mul`` for an upstream gradient ``grad``; no autograd."""
    _check_inputs(gate, up)
    check_tensor("grad", grad)
    check_same_device(grad=grad, gate=gate)
    check_match("grad", grad, "gate", gate)
    act = Activation.parse(activation)
    return _backward(grad, gate, up, act, torch.empty_like(gate, memory_format=torch.contiguous_format),
                     torch.empty_like(up, memory_format=torch.contiguous_format), geometry)


# ----------------------------------------------------------------------------- autograd (eager)
class _SiLUMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act: Activation):
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return _forward(gate, up, act, torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        return (*_backward(grad, gate, up, ctx.act, d_gate, d_up), None)


# ----------------------------------------------------------------------------- torch.library ops (compile)
@torch.library.custom_op("fuselm::silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor, kind: str, limit: float, alpha: float) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    return _forward(gate, up, Activation(kind, limit, alpha), out)


@_silu_mul_op.register_fake
def _(gate, up, kind, limit, alpha):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("fuselm::silu_mul_backward", mutates_args=())
def _silu_mul_backward_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str, limit: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    return _backward(grad, gate, up, Activation(kind, limit, alpha), d_gate, d_up)


@_silu_mul_backward_op.register_fake
def _(grad, gate, up, kind, limit, alpha):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _setup_context(ctx, inputs, output):
    gate, up, kind, limit, alpha = inputs
    ctx.save_for_backward(gate, up)
    ctx.act = (kind, limit, alpha)


def _autograd_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    d_gate, d_up = _silu_mul_backward_op(grad, gate, up, *ctx.act)
    return d_gate, d_up, None, None, None


torch.library.register_autograd("fuselm::silu_mul", _autograd_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API
def silu_mul(gate: torch.Tensor, up: torch.Tensor, activation: Activation | str = "silu") -> torch.Tensor:
    """SwiGLU elementwise: ``gate_factor(gate) * up_factor(up)``, differentiable.

    Args:
        gate, up: [..., F] tensors of one shape, dtype (fp16/bf16/fp32) and device. Rows may be
            strided (e.g. ``h[:, :F]`` and ``h[:, F:]`` of a [M, 2F] projection): no copy is made.
        activation: "silu", or an :class:`~fuselm.ops.common.activation.Activation` (swiglu_limit,
            swiglu_oai).
    Returns:
        [..., F] in ``gate.dtype``, rounded as the numerics contract in ``fuselm.ops.common.activation``.
    """
    _check_inputs(gate, up)
    act = Activation.parse(activation)
    if torch.compiler.is_compiling():
        return _silu_mul_op(gate, up, act.kind, act.limit, act.alpha)
    if needs_autograd(gate, up):
        return _SiLUMulFunction.apply(gate, up, act)
    return _forward(gate, up, act, torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


class SiLUMul(nn.Module):
    """``SiLUMul(activation)(gate, up)`` = ``silu_mul(gate, up, activation)``."""

    def __init__(self, activation: Activation | str = "silu"):
        super().__init__()
        self.activation = Activation.parse(activation)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate, up, self.activation)

    def extra_repr(self) -> str:
        return repr(self.activation)
