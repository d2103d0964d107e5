"""Decode state of a Qwen3.5 model, preallocated once per (max_batch, max_len, pages).

Slot r of the cache is one request's state for its life: its Gated DeltaNet conv inputs and
recurrent state, its length, whether it takes part in decode, and its row of the block table:
the attention K/V pages that hold its positions (position p in page ``block_table[r, p // P]``,
slot p % P, P = ``page_size``). Pages are shared by all slots, so the K/V memory follows the
tokens requests can hold (``num_pages``), not max_batch x max_len. Every tensor keeps its
address for the cache's life, so a CUDA graph may capture them; a request joining rewrites its
slot's block-table row, never a tensor's address. A decode step reads any set of slots through a
row -> slot table (``Qwen35.decode_step``'s ``slots``), so which requests decode together never
moves their state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fuselm.models.qwen35.config import FULL_ATTENTION, Qwen35Config
from fuselm.ops.decode_inputs import kv_write_targets
from fuselm.runtime import PinnedStaging, check_positive_int, parse_dtype


PAGE_SIZE = 64  # tokens per K/V page (the decode attention kernel reads one page per block)


@dataclass
class AttentionCache:
    """Paged K/V of one full-attention layer: [num_pages + 1, kv_heads, page_size, head_dim]
    each. Page ``num_pages`` is a scratch page: inactive rows write their K/V there during decode
    (an index op with no branch), block-table entries no request owns point at it, and no active
    row ever attends to it."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class DeltaNetCache:
    """State of one Gated DeltaNet layer: the conv inputs per slot [max_batch, conv_dim, kernel]
    (model dtype), circular: column j holds the input at the latest position p with p % kernel == j
    (zeros for positions before the prompt), so a decode step reads the previous kernel - 1 inputs
    and writes one column (``gated_delta_rule_decode_step``); and the delta-rule state pool
    [max_batch, value_heads, key_head_dim, value_head_dim], updated in place: fp32 by default (HF's
    numerics), or 16 bits (``state_dtype``: vLLM's default, the model dtype), read into fp32 by
    every kernel and each step's (or chunk's) new state rounded once into it."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class Qwen35Cache:
    """All decode state, preallocated: ``lengths`` [max_batch] int64 (tokens in the cache per
    slot = the next token's position), ``active`` [max_batch] bool (slots that take part in decode),
    ``block_table`` [max_batch, pages_per_slot] int64 (each slot's K/V pages), ``rotary``
    [max_len, 2, rotary_dim] (each position's cos and sin, read by prefill and decode steps), and
    per layer an ``AttentionCache`` or a ``DeltaNetCache``. Every tensor keeps its address for the
    cache's life (a CUDA graph may capture them)."""

    config: Qwen35Config
    max_len: int
    page_size: int
    num_pages: int  # K/V pages requests can own (page num_pages is the scratch page)
    lengths: torch.Tensor
    active: torch.Tensor
    layers: list
    # arange(max_batch) int64: the decode table of every slot in order (row = slot), a decode step's default
    slots: torch.Tensor = field(repr=False)
    block_table: torch.Tensor = field(repr=False)
    # [max_len, 2, rotary_dim] in the model dtype: the cos and sin of each position (``rotary_table``,
    # made by ``Qwen35.new_cache``); held here so that graphs captured on the cache can read it as long
    # as the cache lives
    rotary: torch.Tensor = field(repr=False)

    @classmethod
    def allocate(cls, config: Qwen35Config, max_batch: int, max_len: int, dtype, device, rotary: torch.Tensor,
                 num_pages: int | None = None, page_size: int = PAGE_SIZE,
                 state_dtype: torch.dtype | str = torch.float32) -> "Qwen35Cache":
        """``num_pages`` K/V pages of ``page_size`` tokens (a power of two >= 16) shared by the
        slots; ``rotary`` the [max_len, 2, rotary_dim] table of cos / sin rows by position, in
        ``dtype`` on ``device``. Default: enough for every slot's max_len, and slot r owns pages
        r * pages_per_slot onwards (the block table an owner of the whole cache wants). With fewer,
        every slot starts with no pages (all at the scratch page): whoever admits requests gives
        them pages (``assign_pages``). ``state_dtype``: the Gated DeltaNet state pool's (a torch
        dtype or its name: float32, bfloat16 or float16; ``DeltaNetCache``)."""
        state_dtype = parse_dtype(state_dtype, "state_dtype")
        check_positive_int("max_batch", max_batch)
        check_positive_int("max_len", max_len)
        check_positive_int("page_size", page_size)
        want = torch.device(device)
        if (not isinstance(rotary, torch.Tensor) or rotary.dim() != 3 or rotary.shape[:2] != (max_len, 2)
                or rotary.dtype != dtype or rotary.device.type != want.type
                or want.index not in (None, rotary.device.index)):
            raise ValueError(f"rotary: expected a [max_len = {max_len}, 2, rotary_dim] table in {dtype} on {device}, "
                             f"got {getattr(rotary, 'shape', rotary)}")
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size: expected a power of two >= 16, got {page_size}")
        pages_per_slot = -(-max_len // page_size)
        whole = max_batch * pages_per_slot
        num_pages = whole if num_pages is None else check_positive_int("num_pages", num_pages)
        layers = []
        for layer_type in config.layer_types:
            if layer_type == FULL_ATTENTION:
                shape = (num_pages + 1, config.num_key_value_heads, page_size, config.head_dim)
                layers.append(AttentionCache(torch.zeros(shape, dtype=dtype, device=device),
                                             torch.zeros(shape, dtype=dtype, device=device)))
            else:
                layers.append(DeltaNetCache(
                    torch.zeros(max_batch, config.linear_conv_dim, config.linear_conv_kernel_dim,
                                dtype=dtype, device=device),
                    torch.zeros(max_batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                config.linear_value_head_dim, dtype=state_dtype, device=device)))
        if num_pages >= whole:
            table = torch.arange(whole, device=device).view(max_batch, pages_per_slot)
        else:
            table = torch.full((max_batch, pages_per_slot), num_pages, device=device)
        return cls(config, max_len, page_size, num_pages, torch.zeros(max_batch, dtype=torch.int64, device=device),
                   torch.zeros(max_batch, dtype=torch.bool, device=device), layers,
                   torch.arange(max_batch, device=device), table, rotary)

    @property
    def max_batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def pages_per_slot(self) -> int:
        return self.block_table.shape[1]

    def assign_pages(self, slots: list[int], pages: list[list[int]], staging: PinnedStaging | None = None) -> None:
        """Give slot ``slots[i]`` the pages ``pages[i]`` (its positions 0 .. len * page_size - 1;
        the rest of its row points at the scratch page). Small host-to-device copies, enqueued on
        the stream without waiting for it through ``staging`` (between graph replays); without
        it, plain copies."""
        rows = torch.full((len(slots), self.pages_per_slot), self.num_pages, dtype=torch.int64)
        for i, owned in enumerate(pages):
            rows[i, :len(owned)] = torch.tensor(owned, dtype=torch.int64)
        index = torch.tensor(slots, dtype=torch.int64)
        device = self.block_table.device
        move = staging.to_device if staging is not None else (lambda tensor: tensor.to(device))
        self.block_table.index_copy_(0, move(index), move(rows))

    def kv_write_targets(self, positions: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor):
        """(page, column) of each token's K/V: slot p % P of its row's page p // P (P = page size),
        the page from ``pages`` (block-table rows [rows, pages_per_slot]), for ``positions`` [rows]
        or [rows, T]; the scratch page, column 0, where ``valid`` (like positions) is False. Device
        ops only (no host sync)."""
        return kv_write_targets(positions, pages, valid, self.page_size, self.num_pages)
