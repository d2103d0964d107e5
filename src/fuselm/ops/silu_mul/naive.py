"""Plain-PyTorch reference for ``silu_mul``: the numerics contract of
``fuselm.ops.common.activation``, written out. Used by the tests and as the CPU fallback."""

from __future__ import annotations

import torch

from fuselm.ops.common.activation import Activation, gate_factor_ref, up_factor_ref
from fuselm.ops.common.precision import work_dtype


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor, act: Activation = Activation()) -> torch.Tensor:
    """``round(round(gate_factor(gate)) * up_factor(up))`` in ``gate.dtype``; math in fp32.

    With ``gate``/``up`` in float64 this is the exact function (no intermediate rounding).
    """
    work = work_dtype(gate)
    a = gate_factor_ref(gate.to(work), act).to(gate.dtype).to(work)
    return (a * up_factor_ref(up.to(work), act)).to(gate.dtype)


def silu_mul_backward_ref(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: Activation = Activation()):
    """(d_gate, d_up) as the contract defines them: fp32 math from (grad, gate, up), one rounding each.

    Written out rather than through autograd, so it also runs inside a ``torch.library`` op.
    """
    work = work_dtype(gate)
    g, u, dy = gate.to(work), up.to(work), grad.to(work)
    alpha = act.alpha
    c = g if act.kind == "silu" else torch.clamp(g, max=act.limit)
    s = torch.sigmoid(alpha * c)
    d_gate_factor = s * (1.0 + alpha * c * (1.0 - s))
    d_up_factor = torch.ones_like(u)
    if act.kind != "silu":
        d_gate_factor = torch.where(g > act.limit, 0.0, d_gate_factor)
        d_up_factor = ((u >= -act.limit) & (u <= act.limit)).to(work)
    a = gate_factor_ref(g, act).to(gate.dtype).to(work)
    d_gate = dy * up_factor_ref(u, act) * d_gate_factor
    d_up = dy * a * d_up_factor
    return d_gate.to(gate.dtype), d_up.to(up.dtype)
