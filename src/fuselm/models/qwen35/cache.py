"""Decode state of a Qwen3.5 model, preallocated once per (max_batch, max_len).

Slot r of the cache is one request's state for its life: its attention K/V row, its Gated
DeltaNet conv inputs and recurrent state, its length and whether it takes part in decode. Every
tensor keeps its address for the cache's life, so a CUDA graph may capture them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fuselm.models.qwen35.config import FULL_ATTENTION, Qwen35Config
from fuselm.runtime import check_positive_int


@dataclass
class AttentionCache:
    """Static KV cache of one full-attention layer: [max_batch, kv_heads, max_len + 1, head_dim].
    Column ``max_len`` is a scratch column: inactive rows write their K/V there during decode
    (an index op with no branch), and no active row ever attends to it."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class DeltaNetCache:
    """State of one Gated DeltaNet layer: the conv inputs per row [max_batch, conv_dim, kernel]
    (model dtype), circular: column j holds the input at the latest position p with p % kernel == j
    (zeros for positions before the prompt), so a decode step reads the previous kernel - 1 inputs
    and writes one column (``gated_delta_rule_decode_step``); and the delta-rule state pool
    [max_batch, value_heads, key_head_dim, value_head_dim] (fp32, updated in place)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class Qwen35Cache:
    """All decode state, preallocated: ``lengths`` [max_batch] int64 (tokens in the cache per
    row = the next token's position), ``active`` [max_batch] bool (rows that take part in decode),
    and per layer an ``AttentionCache`` or a ``DeltaNetCache``. Every tensor keeps its address
    for the cache's life (a CUDA graph may capture them)."""

    config: Qwen35Config
    max_len: int
    lengths: torch.Tensor
    active: torch.Tensor
    layers: list
    slots: torch.Tensor = field(repr=False)  # arange(max_batch), int32: each row's state-pool slot

    @classmethod
    def allocate(cls, config: Qwen35Config, max_batch: int, max_len: int, dtype, device) -> "Qwen35Cache":
        check_positive_int("max_batch", max_batch)
        check_positive_int("max_len", max_len)
        layers = []
        for layer_type in config.layer_types:
            if layer_type == FULL_ATTENTION:
                shape = (max_batch, config.num_key_value_heads, max_len + 1, config.head_dim)
                layers.append(AttentionCache(torch.zeros(shape, dtype=dtype, device=device),
                                             torch.zeros(shape, dtype=dtype, device=device)))
            else:
                layers.append(DeltaNetCache(
                    torch.zeros(max_batch, config.linear_conv_dim, config.linear_conv_kernel_dim,
                                dtype=dtype, device=device),
                    torch.zeros(max_batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                config.linear_value_head_dim, dtype=torch.float32, device=device)))
        return cls(config, max_len, torch.zeros(max_batch, dtype=torch.int64, device=device),
                   torch.zeros(max_batch, dtype=torch.bool, device=device), layers,
                   torch.arange(max_batch, dtype=torch.int32, device=device))

    @property
    def max_batch(self) -> int:
        return self.lengths.shape[0]

    def first_rows(self, rows: int) -> "Qwen35Cache":
        """A cache of rows 0 .. rows-1 that shares this one's memory (every tensor a leading-dim
        view, so contiguous and at the same addresses): a decode step on it reads and writes
        exactly those rows. The engine captures one CUDA graph per batch size on such views."""
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows: expected an int in [1, {self.max_batch}], got {rows!r}")
        layers = [AttentionCache(layer.key[:rows], layer.value[:rows]) if isinstance(layer, AttentionCache)
                  else DeltaNetCache(layer.conv[:rows], layer.recurrent[:rows]) for layer in self.layers]
        return Qwen35Cache(self.config, self.max_len, self.lengths[:rows], self.active[:rows], layers,
                           self.slots[:rows])

