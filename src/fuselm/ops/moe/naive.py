"""Plain-PyTorch reference for the Qwen3.5-MoE sparse block (HF ``Qwen3_5MoeSparseMoeBlock``):
the routing, the routed experts and the gated shared expert, the numerics the fused kernels will
keep (issue 19). Shapes: x [N, H]; router [E, H]; experts' gate_up [E, 2F, H] (each expert's gate
rows, then its up rows: HF's ``experts.gate_up_proj``) and down [E, H, F]; the shared expert's
gate, up [F_s, H] and down [H, F_s], and its gate vector [1, H] (``shared_expert_gate``).

Numerics contract:
- routing as HF: logits = x router^T in the model dtype, softmax in fp32 over all E experts, the
  top-k (ties: torch.topk's order), renormalised to sum 1 in fp32, rounded to the model dtype;
- each expert e on its tokens, as a SwiGLU MLP: gate/up products rounded to the model dtype (HF's
  linear), ``silu_mul_ref`` (the activation's contract: one rounding), the down product rounded;
- the shared expert the same way, scaled by sigmoid(x w_sg^T) (the gate logit rounded, the sigmoid
  in fp32);
- the block output: the k weighted expert outputs and the scaled shared output summed in fp32,
  rounded once. (HF adds each expert's weighted output into a model-dtype buffer, expert by
  expert: in bf16 that rounds after every add. fp32 inputs: the same up to summation order.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuselm.ops.common.activation import Activation
from fuselm.ops.silu_mul.naive import silu_mul_ref


def route_ref(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in x's dtype, experts [N, k] int64) of HF's ``Qwen3_5MoeTopKRouter``."""
    probs = torch.softmax(F.linear(x, router_weight), dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(x.dtype), experts


def swiglu_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               activation: Activation) -> torch.Tensor:
    """One SwiGLU MLP on rows x [n, H]: down(silu_mul(x gate^T, x up^T)), each product rounded."""
    return F.linear(silu_mul_ref(F.linear(x, gate), F.linear(x, up), activation), down)


def swiglu_moe_ref(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, gate_up: torch.Tensor,
                   down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                   shared_expert_gate: torch.Tensor, activation: Activation = Activation()) -> torch.Tensor:
    """The block on x [..., H] -> [..., H] in x's dtype (module docstring: the contract)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, experts = route_ref(x, router_weight, top_k)
    F_ = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():  # experts with no token do nothing
        tokens, slot = torch.where(experts == e)
        y = swiglu_ref(x[tokens], gate_up[e, :F_], gate_up[e, F_:], down[e], activation)
        out.index_add_(0, tokens, y.float() * weights[tokens, slot, None].float())
    scale = torch.sigmoid(F.linear(x, shared_expert_gate).float())  # [N, 1]
    out += scale * swiglu_ref(x, shared_gate, shared_up, shared_down, activation).float()
    return out.to(x.dtype).reshape(shape)
