"""ModelRunner: runs the model on the device for the engine (prefill, then decode as CUDA graphs).

State: one ``Qwen35Cache`` of ``max_batch`` slots (attention K/V, DeltaNet conv and recurrent
state), ``SlotSampling`` (each slot's sampling parameters and stop counters) and
``input_tokens`` [max_batch] (each slot's last token: the next decode step's input), allocated
once. A request owns one slot from its prefill to its end.

Prefill (eager, host-side lengths): ``model.prefill`` writes the new requests' state into their
slots and leaves every other slot alone; their first tokens are drawn from its logits. A prompt
may come in chunks over several calls (``model.prefill(..., start=)`` continues from the state
its earlier chunks left); its slot decodes only once the whole prompt is in.

Decode step (what a graph holds), for batch size b, on the cache's first b slots
(``Qwen35Cache.first_rows``: views, same addresses):
    logits = model.decode_step(input_tokens[:b], cache_b)   # advances the active slots
    ids    = sample_and_advance(logits)                     # per-slot params; stop ids and
                                                            # max_tokens clear cache.active
    input_tokens[:b] = ids                                  # the next step's input
Every input and output is a static device buffer, so a step is one ``graph.replay()``. One graph
is captured per batch size in ``graph_batch_sizes`` (clipped to max_batch, which is always
added) and per sampler variant (``filtered``: some slot uses top-k / top-p), all in one memory
pool; inactive slots inside b write no DeltaNet state and put their K/V in the cache's scratch
column. Without CUDA (or ``use_graphs=False``) the same step runs eagerly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fuselm.engine.request import Request
from fuselm.engine.sampling import SlotSampling
from fuselm.models.qwen35 import Qwen35

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SAMPLER_VARIANTS = (False, True)  # filtered: without / with top-k and top-p


class ModelRunner:
    """Prefill and CUDA-graph decode of a ``Qwen35`` over ``max_batch`` cache slots of
    ``max_len`` tokens."""

    def __init__(self, model: Qwen35, max_batch: int, max_len: int,
                 graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES, use_graphs: bool | None = None):
        if not isinstance(model, Qwen35):
            raise TypeError(f"model: expected a fuselm Qwen35, got {type(model).__name__}")
        self.model = model
        self.device = model.device
        self.cache = model.new_cache(max_batch, max_len)  # checks max_batch, max_len
        sizes = [b for b in graph_batch_sizes if isinstance(b, int) and not isinstance(b, bool) and b >= 1]
        if len(sizes) != len(graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes: expected positive ints, got {tuple(graph_batch_sizes)!r}")
        self.batch_sizes = tuple(sorted({b for b in sizes if b <= max_batch} | {max_batch}))
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"use_graphs: CUDA graphs need the model on a CUDA device, it is on {self.device}")
        self.sampling = SlotSampling(max_batch, self.device)
        self.input_tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._views = {b: self.cache.first_rows(b) for b in self.batch_sizes}
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._graph_outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        if self.use_graphs:
            self._capture_graphs()

    @property
    def max_batch(self) -> int:
        return self.cache.max_batch

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def batch_size_for(self, slots_in_use: int) -> int:
        """The smallest decode batch size that covers slots 0 .. slots_in_use - 1."""
        return next(b for b in self.batch_sizes if b >= slots_in_use)

    # ------------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, plan: list[tuple[Request, int, int]]) -> tuple[list[Request], torch.Tensor]:
        """Prefill ``plan``'s chunks: (request, first prompt position, tokens), each request with
        its ``slot`` set. Chunks that start together go through one right-padded prefill; a
        request starting at position 0 gets its sampling parameters in its slot. Requests whose
        prompt ends with this chunk get their first token drawn; the others stay inactive until
        their last chunk. Returns (those requests, their first ids [n] on the device); other slots
        are untouched."""
        completed, logits, slots = [], [], []
        for start in sorted({start for _, start, _ in plan}):
            chunks = [(request, count) for request, first, count in plan if first == start]
            requests = [request for request, _ in chunks]
            group_slots = torch.tensor([r.slot for r in requests], dtype=torch.int64, device=self.device)
            if start == 0:
                self.sampling.assign(requests, group_slots)
            rows = [r.prompt_token_ids[start:start + count] for r, count in chunks]
            longest = max(len(row) for row in rows)
            ids = torch.tensor([row + [0] * (longest - len(row)) for row in rows]).to(self.device)
            mask = None
            if any(len(row) < longest for row in rows):
                mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in rows]).to(self.device)
            group_logits = self.model.prefill(ids, self.cache, mask, group_slots, start=start)
            for index, (request, count) in enumerate(chunks):
                if start + count == len(request.prompt_token_ids):
                    completed.append(request)
                    logits.append(group_logits[index])
                    slots.append(request.slot)
                else:
                    self.cache.active[request.slot] = False  # mid-prompt: no decode step yet
        if not completed:
            return [], torch.empty(0, dtype=torch.int64, device=self.device)
        slot_tensor = torch.tensor(slots, dtype=torch.int64, device=self.device)
        first = self.sampling.sample_and_advance(torch.stack(logits), self.cache.active,
                                                 any(r.params.filtered for r in completed), slot_tensor)
        self.input_tokens.index_copy_(0, slot_tensor, first)
        return completed, first

    def release(self, slots: Sequence[int]) -> None:
        """Mark slots inactive (their requests ended on the host: a stop string, an abort). One
        fill per slot, enqueued on the stream: no host sync."""
        for slot in slots:
            self.cache.active[slot] = False

    # ------------------------------------------------------------------------ decode
    @torch.no_grad()
    def _step_body(self, batch: int, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over slots 0 .. batch-1: (logits [batch, V], ids [batch])."""
        cache = self._views[batch]
        logits = self.model.decode_step(self.input_tokens[:batch], cache)
        ids = self.sampling.sample_and_advance(logits, cache.active, filtered)
        self.input_tokens[:batch].copy_(ids)
        return logits, ids

    def _capture_graphs(self) -> None:
        """Warm up every (batch size, sampler) on a side stream (Triton JIT, cuBLAS workspaces,
        attention backend choice), then capture one graph each, largest first, all in one memory
        pool (their temporaries never live at the same time). Every slot is inactive here, so
        warm-up and capture write no request state."""
        if bool(self.cache.active.any()):
            raise RuntimeError("graphs are captured on an idle cache")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for batch in self.batch_sizes:
                for filtered in SAMPLER_VARIANTS:
                    for _ in range(2):
                        self._step_body(batch, filtered)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for batch in reversed(self.batch_sizes):
            for filtered in SAMPLER_VARIANTS:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._graph_outputs[batch, filtered] = self._step_body(batch, filtered)
                pool = graph.pool()
                self._graphs[batch, filtered] = graph
        torch.cuda.synchronize(self.device)

    def decode(self, batch: int, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over slots 0 .. batch-1 (``batch`` one of ``batch_sizes``): a graph
        replay, or eager. Returns (logits [batch, V], ids [batch]): in a graph, its static
        buffers (valid until the next step)."""
        if self.use_graphs:
            self._graphs[batch, filtered].replay()
            return self._graph_outputs[batch, filtered]
        return self._step_body(batch, filtered)
