"""The SwiGLU activation spec shared by every SwiGLU path (elementwise, GEMM epilogue, MLP).

A SwiGLU output is ``gate_factor(gate) * up_factor(up)``, elementwise:

=================  ==========================================  ================================
kind               gate_factor(g)                              up_factor(u)
=================  ==========================================  ================================
``silu``           g * sigmoid(g)                              u
``swiglu_limit``   c * sigmoid(c),  c = min(g, L)              clamp(u, -L, L)
``swiglu_oai``     c * sigmoid(alpha * c),  c = min(g, L)      clamp(u, -L, L) + 1
=================  ==========================================  ================================

``swiglu_limit`` is the DeepSeek-V4 clamp, ``swiglu_oai`` the gpt-oss one (L = 7, alpha = 1.702).

Numerics contract (every fuselm SwiGLU path): both factors are computed in fp32 from the inputs;
the gate factor is rounded to the input dtype (as Hugging Face's ``act_fn(gate)`` is, in the
model dtype), multiplied by the fp32 up factor, and the product rounded once to the input dtype.
Backward is computed in fp32 from (gate, up, grad_out) and rounded once per gradient:
``d_gate = grad * up_factor(u) * gate_factor'(g)`` and ``d_up = grad * round(gate_factor(g)) *
up_factor'(u)``; a clamp passes the gradient where its input lies inside [-L, L] (inclusive, as
``torch.clamp``) and stops it outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Activation kinds, as the constexpr the kernels take.
SILU = tl.constexpr(0)
SWIGLU_LIMIT = tl.constexpr(1)
SWIGLU_OAI = tl.constexpr(2)
_KIND_CODES = {"silu": 0, "swiglu_limit": 1, "swiglu_oai": 2}


@dataclass(frozen=True)
class Activation:
    """One SwiGLU variant: ``kind`` in {"silu", "swiglu_limit", "swiglu_oai"}, clamp ``limit``
    (the L above; unused by ``silu``) and the gate slope ``alpha`` (``swiglu_oai`` only)."""

    kind: str = "silu"
    limit: float = math.inf
    alpha: float = 1.0

    def __post_init__(self):
        if self.kind not in _KIND_CODES:
            raise ValueError(f"activation: unknown kind {self.kind!r} (use one of {sorted(_KIND_CODES)})")
        if self.kind == "silu":
            if self.limit != math.inf or self.alpha != 1.0:
                raise ValueError("activation: 'silu' takes no limit or alpha (use 'swiglu_limit' or 'swiglu_oai')")
            return
        if not (isinstance(self.limit, (int, float)) and math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"activation: {self.kind} needs a finite limit > 0, got {self.limit!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"activation: alpha must be finite and > 0, got {self.alpha!r}")
        if self.kind == "swiglu_limit" and self.alpha != 1.0:
            raise ValueError("activation: 'swiglu_limit' takes no alpha (use 'swiglu_oai')")

    @classmethod
    def swiglu_limit(cls, limit: float) -> "Activation":
        return cls("swiglu_limit", limit=limit)

    @classmethod
    def swiglu_oai(cls, limit: float = 7.0, alpha: float = 1.702) -> "Activation":
        return cls("swiglu_oai", limit=limit, alpha=alpha)

    @classmethod
    def parse(cls, spec: "Activation | str") -> "Activation":
        """Accepts an ``Activation`` or the name ``"silu"``."""
        if isinstance(spec, Activation):
            return spec
        if spec == "silu":
            return cls()
        if isinstance(spec, str) and spec in _KIND_CODES:
            raise ValueError(f"activation: {spec!r} needs a limit: pass Activation.{spec}(...)")
        raise ValueError(f"activation: expected an Activation or 'silu', got {spec!r}")

    @property
    def code(self) -> int:
        return _KIND_CODES[self.kind]

    @property
    def kernel_limit(self) -> float:
        """The limit as the kernels take it (a large finite number for plain silu)."""
        return 3.0e38 if self.kind == "silu" else float(self.limit)


# ----------------------------------------------------------------------------- reference (fp32)
def gate_factor_ref(g: torch.Tensor, act: Activation) -> torch.Tensor:
    """gate_factor on an fp32/fp64 tensor, in that precision."""
    if act.kind == "silu":
        return g * torch.sigmoid(g)
    c = torch.clamp(g, max=act.limit)
    return c * torch.sigmoid(act.alpha * c)


def up_factor_ref(u: torch.Tensor, act: Activation) -> torch.Tensor:
    """up_factor on an fp32/fp64 tensor, in that precision."""
    if act.kind == "silu":
        return u
    c = torch.clamp(u, -act.limit, act.limit)
    return c + 1.0 if act.kind == "swiglu_oai" else c


# ----------------------------------------------------------------------------- Triton (fp32 in registers)
@triton.jit
def gate_factor(g, ACT: tl.constexpr, limit, alpha):
    """gate_factor(g) for an fp32 block g."""
    if ACT == SILU:
        return g / (1.0 + tl.exp(-g))
    c = tl.where(g > limit, limit, g)  # min(g, L), NaN kept
    if ACT == SWIGLU_OAI:
        return c / (1.0 + tl.exp(-alpha * c))
    return c / (1.0 + tl.exp(-c))


@triton.jit
def up_factor(u, ACT: tl.constexpr, limit):
    """up_factor(u) for an fp32 block u."""
    if ACT == SILU:
        return u
    c = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    if ACT == SWIGLU_OAI:
        return c + 1.0
    return c


@triton.jit
def gate_factor_grad(g, ACT: tl.constexpr, limit, alpha):
    """d gate_factor / d g: s + a*c*s*(1 - s) with s = sigmoid(a*c), zero where g > L."""
    if ACT == SILU:
        s = 1.0 / (1.0 + tl.exp(-g))
        return s * (1.0 + g * (1.0 - s))
    c = tl.where(g > limit, limit, g)
    if ACT == SWIGLU_OAI:
        s = 1.0 / (1.0 + tl.exp(-alpha * c))
        d = s * (1.0 + alpha * c * (1.0 - s))
    else:
        s = 1.0 / (1.0 + tl.exp(-c))
        d = s * (1.0 + c * (1.0 - s))
    return tl.where(g > limit, 0.0, d)


@triton.jit
def up_factor_grad(u, ACT: tl.constexpr, limit):
    """d up_factor / d u: 1 inside [-L, L], 0 outside."""
    if ACT == SILU:
        return tl.full(u.shape, 1.0, tl.float32)
    return tl.where((u > limit) | (u < -limit), 0.0, 1.0)
