"""Per-slot sampling on the device: every request's parameters are graph inputs, not constants.

``SlotSampling`` holds, for each cache slot, the sampling parameters of the request in it
(temperature, top-k, top-p, min-p, penalties, seed), how many tokens it has drawn (the position of
its random stream: a request's draws depend on its seed and position only, never on its batch or
slot), how many it may still draw, its stop ids (banned until its min_tokens), its logit bias,
and (for the penalties) how many times it drew each token and which tokens its prompt holds
(``counts`` [slots, V] int32, 1 MB a slot at Qwen3.5's vocabulary). ``sample_and_advance`` draws
the next id of each row of a decode batch with its slot's parameters (the row -> slot table; by default rows are the
first slots) (``fuselm.ops.sampling.sample_tokens``) and updates those counters and the
cache's ``active`` flags on the device: a slot stops when it draws one of its stop ids or its
last allowed token. No host sync, static shapes: it runs inside the decode step's CUDA graph.
"""

from __future__ import annotations

import torch

from fuselm.engine.request import MAX_LOGIT_BIAS, Request
from fuselm.ops.sampling import PROMPT_BIT, advance_slots, apply_penalties, sample_tokens
from fuselm.runtime import PinnedStaging

# Stop ids checked on the device per slot (eos ids + the request's stop_token_ids). A request
# with more is still stopped by the host, one step later (the extra step's state is discarded).
MAX_DEVICE_STOP_IDS = 8

# Sampler variants, chosen on the host from the requests in a step (a decode graph is captured
# for each): PLAIN, no request filters (greedy, or top-k, top-p and min-p off): no cut-offs;
# FILTERED, some request filters: each row's cut-off first (``fuselm.ops.sampling.cutoffs``);
# PENALIZED, PENALIZED_TOP_K and PENALIZED_FILTERED, some request has a penalty, a logit bias or
# min_tokens (``SamplingParams.penalized``): the logits are penalised (and stop ids banned) first
# (``apply_penalties``, into fp32) and the draws counted; fp32 cut-offs come from the SMALL_TOP_K
# largest logits when every filtering request's top-p rides on a top-k of at most that many
# (PENALIZED_TOP_K: Qwen's settings, top-k 20), else from a sort of each row (PENALIZED_FILTERED).
# Every variant draws the same ids for the requests it serves as a cheaper one would.
PLAIN, FILTERED, PENALIZED = "plain", "filtered", "penalized"
PENALIZED_TOP_K, PENALIZED_FILTERED = "penalized_top_k", "penalized_filtered"
SAMPLER_VARIANTS = (PLAIN, FILTERED, PENALIZED, PENALIZED_TOP_K, PENALIZED_FILTERED)
SMALL_TOP_K = 64


def sampler_variant(requests) -> str:
    """The cheapest sampler variant that serves every one of ``requests``."""
    filtering = [r.params for r in requests if r.params.filtered]
    if not any(r.params.penalized for r in requests):
        return FILTERED if filtering else PLAIN
    if not filtering:
        return PENALIZED
    small = all(p.top_p == 1 or 1 <= p.top_k <= SMALL_TOP_K for p in filtering)
    return PENALIZED_TOP_K if small else PENALIZED_FILTERED


class SlotSampling:
    """Sampling parameters and stop counters of ``max_batch`` slots, on ``device``."""

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device):
        self.temperature = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.repetition = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.presence = torch.zeros(max_batch, dtype=torch.float32, device=device)
        # Each slot's draws per token, + PROMPT_BIT for its prompt's tokens: kept for the requests
        # with a penalty (every step that holds one runs a penalised variant, which counts).
        self.counts = torch.zeros(max_batch, vocab_size, dtype=torch.int32, device=device)
        # Each slot's logit bias: its first bias_counts[slot] entries (every request writes its count).
        self.bias_ids = torch.full((max_batch, MAX_LOGIT_BIAS), -1, dtype=torch.int32, device=device)
        self.bias_values = torch.zeros(max_batch, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.bias_counts = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.seeds = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)  # tokens drawn so far
        self.remaining = torch.zeros(max_batch, dtype=torch.int64, device=device)  # tokens still allowed
        self.min_tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # stop ids banned until then
        self.stop_ids = torch.full((max_batch, MAX_DEVICE_STOP_IDS), -1, dtype=torch.int64, device=device)

    def assign(self, requests: list[Request], slots: list[int], staging: PinnedStaging) -> None:
        """Write the requests' parameters into their ``slots`` (small host-to-device copies through
        ``staging``, one per tensor; between graph replays, never inside one)."""
        params = [r.params for r in requests]

        def column(values, dtype):
            return staging.to_device(torch.tensor(values, dtype=dtype))

        slot_list = list(slots)
        slots = column(slot_list, torch.int64)
        self.temperature.index_copy_(0, slots, column([p.temperature for p in params], torch.float32))
        self.top_k.index_copy_(0, slots, column([p.top_k for p in params], torch.int32))
        self.top_p.index_copy_(0, slots, column([p.top_p for p in params], torch.float32))
        self.min_p.index_copy_(0, slots, column([p.min_p for p in params], torch.float32))
        self.repetition.index_copy_(0, slots, column([p.repetition_penalty for p in params], torch.float32))
        self.frequency.index_copy_(0, slots, column([p.frequency_penalty for p in params], torch.float32))
        self.presence.index_copy_(0, slots, column([p.presence_penalty for p in params], torch.float32))
        self.bias_counts.index_copy_(0, slots, column([len(p.logit_bias or ()) for p in params], torch.int32))
        biased = [(slot, p.logit_bias) for slot, p in zip(slot_list, params) if p.logit_bias]
        if biased:
            rows = column([slot for slot, _ in biased], torch.int64)
            pad = [MAX_LOGIT_BIAS - len(bias) for _, bias in biased]
            self.bias_ids.index_copy_(0, rows, column([list(bias) + [-1] * n for (_, bias), n in zip(biased, pad)],
                                                      torch.int32))
            self.bias_values.index_copy_(0, rows, column([list(bias.values()) + [0.0] * n
                                                          for (_, bias), n in zip(biased, pad)], torch.float32))
        self.seeds.index_copy_(0, slots, column([r.seed for r in requests], torch.int64))
        self.positions.index_fill_(0, slots, 0)
        self.remaining.index_copy_(0, slots, column([p.max_tokens for p in params], torch.int64))
        self.min_tokens.index_copy_(0, slots, column([p.min_tokens for p in params], torch.int64))
        stop = [list(r.stop_ids[:MAX_DEVICE_STOP_IDS]) + [-1] * (MAX_DEVICE_STOP_IDS - len(r.stop_ids[:MAX_DEVICE_STOP_IDS]))
                for r in requests]
        self.stop_ids.index_copy_(0, slots, column(stop, torch.int64))
        penalized = [(r, slot) for r, slot in zip(requests, slot_list) if r.params.penalized]
        if penalized:  # a fresh count for each, and its prompt's tokens marked (the repetition penalty's)
            self.counts.index_fill_(0, column([slot for _, slot in penalized], torch.int64), 0)
            vocab = self.counts.shape[1]
            marks = [slot * vocab + t for r, slot in penalized if r.params.repetition_penalty != 1
                     for t in set(r.prompt_token_ids)]
            if marks:
                self.counts.view(-1).index_fill_(0, column(marks, torch.int64), PROMPT_BIT)

    def sample_and_advance(self, logits: torch.Tensor, active: torch.Tensor, variant: str,
                           slots: torch.Tensor | None = None, next_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Next ids [n] for logits [n, V] of the slots ``slots`` [n] (default: the first n slots).
        ``active`` is the cache's [max_batch] flags: cleared where a slot stops. Inactive slots
        draw nothing that counts (their counters stay); their ids are meaningless. With
        ``next_inputs`` [max_batch], each slot's id is also written there (the next step's input).
        ``variant``: one of ``SAMPLER_VARIANTS``, a promise about the slots' settings
        (``sampler_variant``). One launch past the draw's own: the counters, stops and next
        inputs (``advance_slots``; penalised variants count the draws there too); penalised
        variants one before it (``apply_penalties``, into fp32 logits of its own)."""
        n = logits.shape[0]
        index = (lambda t: t[:n]) if slots is None else (lambda t: t[slots])
        penalized = variant in (PENALIZED, PENALIZED_TOP_K, PENALIZED_FILTERED)
        filtered = variant in (FILTERED, PENALIZED_TOP_K, PENALIZED_FILTERED)
        if penalized:
            logits = apply_penalties(logits, self.counts, index(self.repetition), index(self.frequency),
                                     index(self.presence), slots, bias_ids=self.bias_ids,
                                     bias_values=self.bias_values, bias_counts=self.bias_counts,
                                     banned_ids=self.stop_ids, banned_until=self.min_tokens, positions=self.positions)
        ids = sample_tokens(logits, index(self.temperature), index(self.top_k), index(self.top_p),
                            index(self.seeds), index(self.positions), filtered=filtered,
                            min_p=index(self.min_p) if filtered else None,
                            max_top_k=SMALL_TOP_K if variant == PENALIZED_TOP_K else None)
        advance_slots(ids, active, self.positions, self.remaining, self.stop_ids, slots, next_inputs,
                      self.counts if penalized else None)
        return ids
