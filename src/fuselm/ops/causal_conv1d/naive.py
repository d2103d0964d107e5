"""Plain-PyTorch references for ``causal_conv1d_silu`` and ``short_conv_silu``: the Gated DeltaNet
short convolution of a prefill chunk as HF's ``causal_conv1d_fn`` computes it (``F.conv1d`` in the weight dtype over the
chunk after its history, SiLU, the model dtype), and the conv state it leaves.

Shapes: x [B, T, C] (row b's real tokens first, ``lengths[b]`` of them), weight [C, K]; the state
pool [S, C, K] holds, per slot, the inputs at the latest positions p with p % K == column (zeros
before position 0). Row b continues slot ``slots[b]`` at position ``starts[b]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_history_ref(conv_state: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, kernel: int) -> torch.Tensor:
    """[B, C, K]: the inputs at positions start - K .. start - 1 of each row (zeros before 0)."""
    B, C = slots.shape[0], conv_state.shape[1]
    positions = starts[:, None] + torch.arange(-kernel, 0, device=starts.device)  # [B, K]
    history = conv_state[slots].gather(2, (positions % kernel)[:, None, :].expand(B, C, -1))
    return history.masked_fill((positions < 0)[:, None, :], 0)


def causal_conv1d_silu_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                           starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv) [B, T, C] in x's dtype; writes each slot's new conv state (the
    inputs at positions start + length - K .. start + length - 1, circular) into ``conv_state``."""
    B, T, C = x.shape
    K = weight.shape[-1]
    extended = torch.cat([conv_history_ref(conv_state, slots, starts, K), x.transpose(1, 2)], dim=2)  # [B, C, K + T]
    conv = F.conv1d(extended[..., 1:], weight.reshape(C, 1, K), groups=C)  # [B, C, T]
    out = F.silu(conv).transpose(1, 2)
    # extended[..., j] is position start - K + j: position start + length - K + i is column length + i.
    columns = lengths[:, None] + torch.arange(K, device=x.device)
    inputs = extended.gather(2, columns[:, None, :].expand(B, C, -1))
    circular = (starts[:, None] + columns - K) % K
    state = torch.empty_like(inputs).scatter_(2, circular[:, None, :].expand(B, C, -1), inputs)
    conv_state.index_copy_(0, slots, state)
    return out


def short_conv_silu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same in PyTorch (HF's path: conv1d in x's dtype over [B, C, T], SiLU): [B, T, C]."""
    C, K = weight.shape
    conv = F.conv1d(x.transpose(1, 2), weight.reshape(C, 1, K), padding=K - 1, groups=C)[..., : x.shape[1]]
    return F.silu(conv).transpose(1, 2)
