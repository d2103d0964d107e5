"""``SwiGLUMoE``: the Qwen3.5-MoE sparse block (router, routed SwiGLU experts, the gated shared
expert) as a module built from HF's block. Today it computes the contract of ``naive.py`` with
PyTorch ops (every path: GPU and CPU); the fused routing and grouped-GEMM kernels of issue 19
will replace that body, with this module's interface. Inference only."""

from __future__ import annotations

import torch
from torch import nn

from fuselm.ops.common.activation import Activation
from fuselm.ops.moe.naive import swiglu_moe_ref


class SwiGLUMoE(nn.Module):
    """Routed SwiGLU experts + a gated shared expert. Weights: ``router`` [E, H], ``gate_up``
    [E, 2F, H] (gate rows then up rows per expert), ``down`` [E, H, F], ``shared_gate`` /
    ``shared_up`` [F_s, H], ``shared_down`` [H, F_s], ``shared_expert_gate`` [1, H]."""

    def __init__(self, router: torch.Tensor, top_k: int, gate_up: torch.Tensor, down: torch.Tensor,
                 shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                 shared_expert_gate: torch.Tensor, activation: Activation | str = "silu"):
        super().__init__()
        E, H = router.shape
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
            raise ValueError(f"top_k: expected an int in [1, {E}] (the number of experts), got {top_k!r}")
        if gate_up.dim() != 3 or gate_up.shape[0] != E or gate_up.shape[2] != H or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up: expected [E = {E}, 2F, H = {H}], got {tuple(gate_up.shape)}")
        F_ = gate_up.shape[1] // 2
        if down.shape != (E, H, F_):
            raise ValueError(f"down: expected [E, H, F] = {(E, H, F_)}, got {tuple(down.shape)}")
        F_s = shared_gate.shape[0]
        for name, t, shape in (("shared_gate", shared_gate, (F_s, H)), ("shared_up", shared_up, (F_s, H)),
                               ("shared_down", shared_down, (H, F_s)), ("shared_expert_gate", shared_expert_gate, (1, H))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected {shape}, got {tuple(t.shape)}")
        tensors = (router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate)
        if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
            raise ValueError("weights: expected one dtype and one device for every tensor")
        self.top_k = top_k
        self.activation = Activation.parse(activation)
        names = ("router", "gate_up", "down", "shared_gate", "shared_up", "shared_down", "shared_expert_gate")
        for name, t in zip(names, tensors):
            setattr(self, name, nn.Parameter(t.detach().contiguous(), requires_grad=False))

    @classmethod
    def from_hf(cls, block: nn.Module, activation: Activation | str | None = None) -> "SwiGLUMoE":
        """From an HF ``Qwen3_5MoeSparseMoeBlock`` (its tensors copied; ``activation`` default silu,
        HF's ``hidden_act``; ``Activation.swiglu_limit(L)`` clamps routed and shared experts alike)."""
        for name in ("gate", "experts", "shared_expert", "shared_expert_gate"):
            if not hasattr(block, name):
                raise TypeError(f"block: expected an HF Qwen3_5MoeSparseMoeBlock (no {name!r}), got "
                                f"{type(block).__name__}")
        shared = block.shared_expert
        return cls(block.gate.weight, block.gate.top_k, block.experts.gate_up_proj, block.experts.down_proj,
                   shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight,
                   block.shared_expert_gate.weight, activation or "silu")

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] in the weights' dtype and device -> [..., H]."""
        if not isinstance(x, torch.Tensor) or x.shape[-1] != self.router.shape[1]:
            raise ValueError(f"x: expected [..., H = {self.router.shape[1]}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype != self.router.dtype or x.device != self.router.device:
            raise ValueError(f"x: expected {self.router.dtype} on {self.router.device}, got {x.dtype} on {x.device}")
        return swiglu_moe_ref(x, self.router, self.top_k, self.gate_up, self.down, self.shared_gate, self.shared_up,
                              self.shared_down, self.shared_expert_gate, self.activation)
