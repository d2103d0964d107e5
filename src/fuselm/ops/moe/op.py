"""``SwiGLUMoE``: the Qwen3.5-MoE sparse block (router, routed SwiGLU experts, the gated shared
expert) on fuselm's kernels, built from HF's block. Inference only.

    moe = SwiGLUMoE.from_hf(hf_block)        # or SwiGLUMoE(router, top_k, gate_up, down, ...)
    y = moe(x)                                # x [..., H]

Three launches per call up to PAIR_PATH_TOKENS tokens (decode, ``decode.swiglu_moe_decode``: the
router logits, then gate/up and down, which route from the logits themselves), six past that
(``routing.route``: the GEMM, softmax / top-k with counts, the pair list's placement; ``grouped_gemm``:
gate/up with the activation, down, the per-token combine with the routing weights), fixed grids
and no host sync whatever the routing (CUDA-graph capturable). On a CPU without TRITON_INTERPRET
every step runs its plain-PyTorch reference.

Weights are kept in the kernels' layout, made once here: ``router_with_gate`` [E + 1 + pad, H]
(HF's router rows, then ``shared_expert_gate``, then zero rows to a multiple of 8:
``pad_router_rows``); ``w13`` [E_total, 2F, H] (each expert's gate and up rows interleaved);
``w2`` [E_total, H, F]. The shared expert is ``num_shared`` = ceil(F_s / F) more experts of F
features each, always selected, weighted by sigmoid(x w_sg^T): its F_s features
zero-padded to num_shared F (a zero gate and up row gives an activation of 0 for every
``Activation``, and a zero down column adds nothing) and split in chunks of F.

Numerics: ``naive.swiglu_moe_ref``'s contract (routing as HF with ties to the lower expert id;
products rounded to the model dtype; the weighted expert outputs and the gated shared output
summed in fp32, rounded once), except that a shared expert wider than F (num_shared > 1) has each
chunk's down product rounded on its own (in fp32 the same up to summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.ops.common.activation import Activation
from fuselm.ops.moe.decode import swiglu_moe_decode
from fuselm.ops.moe.grouped_gemm import combine, expert_down, expert_gate_up
from fuselm.ops.moe.routing import pad_router_rows, route
from fuselm.runtime import cdiv

# The grouped GEMMs' row tile: 16 rows while an expert gets at most 16 pairs on average (decode
# and short prefill; the H200 sweep of session 17 at 64 tokens, ~2 pairs an expert: 64-row tiles
# were mostly padding), 64 past that, 128 past 384 (H100 sweep of session 29, the two GEMMs: 128-row
# tiles faster at 16384 tokens, ~570 pairs an expert, 2.035 against 2.224 ms, slower at 8192, ~290,
# 1.332 against 1.253; NOTES.md 74).
SMALL_BLOCK_M, BLOCK_M, LARGE_BLOCK_M = 16, 64, 128
SMALL_PAIRS_PER_EXPERT, LARGE_PAIRS_PER_EXPERT = 16, 384
# Up to this many tokens the decode path (decode.py: the router logits, then a matrix-vector
# program per pair for gate/up and the down GEMM with the combine, each routing from the logits);
# the grouped GEMMs past it.
PAIR_PATH_TOKENS = 16


def routing_block_m(num_pairs: int, num_experts_total: int) -> int:
    """The grouped GEMMs' row tile for num_pairs (token, slot) pairs over the experts."""
    if num_pairs <= SMALL_PAIRS_PER_EXPERT * num_experts_total:
        return SMALL_BLOCK_M
    return BLOCK_M if num_pairs <= LARGE_PAIRS_PER_EXPERT * num_experts_total else LARGE_BLOCK_M


class SwiGLUMoE(nn.Module):
    """Routed SwiGLU experts + a gated shared expert, from HF-layout tensors: ``router`` [E, H],
    ``gate_up`` [E, 2F, H] (gate rows then up rows per expert), ``down`` [E, H, F],
    ``shared_gate`` / ``shared_up`` [F_s, H], ``shared_down`` [H, F_s], ``shared_expert_gate``
    [1, H], all one dtype and device."""

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
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, F_
        weights = self.kernel_weights(router, gate_up[:, :F_], gate_up[:, F_:], down, shared_gate, shared_up,
                                      shared_down, shared_expert_gate)
        for name, t in weights.items():
            setattr(self, name, nn.Parameter(t, requires_grad=False))
        self.num_shared = self.w13.shape[0] - E

    @staticmethod
    @torch.no_grad()
    def kernel_weights(router, gate, up, down, shared_gate, shared_up, shared_down,
                       shared_expert_gate) -> dict[str, torch.Tensor]:
        """The kernels' layout (module docstring): {"router_with_gate", "w13", "w2"}, new
        contiguous tensors, each expert's weights written into them once. ``gate``, ``up`` [E, F, H]
        and ``down`` [E, H, F]: tensors or sequences of the E experts' tensors (a checkpoint's
        per-expert tensors need no stacking first); the rest as the class docstring's."""
        E, H = router.shape
        F_, F_s = down[0].shape[1], shared_gate.shape[0]
        num_shared = cdiv(F_s, F_)
        # w13 [E + num_shared, F, 2, H]: expert e's gate row f at [e, f, 0], its up row at [e, f, 1]
        # (interleaved); the shared expert's F_s rows in chunks of F after the routed experts, the
        # padding rows zero. w2 likewise, the shared down's columns in chunks of F.
        w13 = router.new_zeros(E + num_shared, F_, 2, H)
        w2 = router.new_zeros(E + num_shared, H, F_)
        if isinstance(gate, torch.Tensor):
            w13[:E, :, 0], w13[:E, :, 1], w2[:E] = gate, up, down
        else:
            for e in range(E):
                w13[e, :, 0], w13[e, :, 1], w2[e] = gate[e], up[e], down[e]
        shared = w13[E:].view(num_shared * F_, 2, H)
        shared[:F_s, 0], shared[:F_s, 1] = shared_gate, shared_up
        w2[E:] = F.pad(shared_down, (0, num_shared * F_ - F_s)).view(H, num_shared, F_).transpose(0, 1)
        return {"router_with_gate": pad_router_rows(torch.cat([router, shared_expert_gate])),
                "w13": w13.view(E + num_shared, 2 * F_, H), "w2": w2}

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
        w = self.router_with_gate
        if not isinstance(x, torch.Tensor) or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [..., H = {self.hidden_size}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype != w.dtype or x.device != w.device:
            raise ValueError(f"x: expected {w.dtype} on {w.device}, got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.hidden_size).contiguous()
        slots = self.top_k + self.num_shared
        if rows.shape[0] <= PAIR_PATH_TOKENS:
            return swiglu_moe_decode(rows, w, self.w13, self.w2, self.top_k, self.activation,
                                     num_experts=self.num_experts).view(x.shape)
        block_m = routing_block_m(rows.shape[0] * slots, self.num_experts + self.num_shared)
        routing = route(rows, w, self.top_k, self.num_shared, block_m, num_experts=self.num_experts)
        pairs = routing.sorted_pairs, routing.block_experts
        h = expert_gate_up(rows, self.w13, *pairs, slots, self.activation, block_m)
        y = expert_down(h, self.w2, *pairs, block_m, rows.shape[0] * slots)
        return combine(y, routing.weights, x.dtype).view(x.shape)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, shared_chunks={self.num_shared}, {self.activation}")
