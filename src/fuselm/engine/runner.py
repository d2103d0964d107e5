"""ModelRunner: runs the model on the device for the engine (prefill, then decode as CUDA graphs).

State: one ``Qwen35Cache`` of ``max_batch`` slots (DeltaNet conv and recurrent state, a
block-table row into the shared attention K/V pages), ``SlotSampling`` (each slot's sampling
parameters and stop counters), ``input_tokens`` [max_batch] (each slot's last token: the next
decode step's input) and ``row_slots`` [max_batch] (the decode batch's row -> slot table),
allocated once, as is the pinned host memory the steps' small copies go through (``staging``). A
request owns one slot from its prefill to its end; its row in the decode batch is the caller's
(``set_rows``) and may change between steps: nothing but the table moves.

Prefill (``model.prefill_step`` over one right-padded group of chunks): writes the requests'
state into their slots and leaves every other slot alone; first tokens are drawn from its
logits. A prompt may come in chunks over several steps (each continues from the state its
earlier chunks left); its slot decodes only once the whole prompt is in. ``mixed`` runs such a
group and a decode step as one ``model.mixed_step`` (the chunks share the decode step's read of
the weights; a chunk that completes its prompt draws its first id in its request's row). With
CUDA, prefill and mixed steps are graphs too: rows and tokens padded up to
buckets (``ROW_BUCKETS``, ``TOKEN_BUCKETS``), one graph per (rows, tokens, fresh) and, mixed, per
decode (batch, variant), captured the first time it is needed, so a 512-token prompt is one
replay instead of ~1,200 launches. A mixed step of one chunk pads its tokens so that the decode
rows and the chunk make a multiple of ``GEMM_TILE_M`` rows (32 decode rows + 250 prompt tokens: 256
tokens, one 288-row GEMM).

Decode step (what a graph holds), for batch size b, on the slots of rows 0 .. b-1:
    slots  = row_slots[:b]                                  # a static view: the table's first b rows
    logits = model.decode_step(input_tokens, cache, slots)  # advances the active slots
    ids    = sample_and_advance(logits, slots)              # per-slot params; stop ids and
                                                            # max_tokens clear cache.active;
                                                            # input_tokens[slots] = ids, the next input
Every input and output is a static device buffer, so a step is one ``graph.replay()``. One graph
is captured per batch size in ``graph_batch_sizes`` (clipped to max_batch, which is always
added) and per sampler variant (``engine.sampling.SAMPLER_VARIANTS``), all in one memory
pool; the table is a permutation of the slots, so rows past the running requests hold idle
slots: inactive, they write no DeltaNet state and put their K/V in the cache's scratch page.
Without CUDA (or ``use_graphs=False``) the same step runs eagerly.

Token masks (``engine.token_masks``): ``prefill``, ``mixed`` and ``decode`` take ``masks``, a
function called once the step's forward pass is queued and before its draw, returning the draw's
``TokenMasks`` (bitmasks as int32 host words): the rows' disallowed tokens are -inf when drawn
(``apply_token_bitmask``), the grammars' before the logits are returned (their logprobs see
them), the bans' only in what the sampler reads (the logits returned are a copy from before
them when a banned row's request wants logprobs). A decode step with masks runs its forward pass
as a graph of its own (``("logits", b)``: the decode step without its draw, into
``decode_logits``; captured on first use, after an eager run that is that step) and then the
(b, variant) sampler graph.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fuselm.engine.request import MAX_LOGPROBS, Request
from fuselm.engine.sampling import SAMPLER_VARIANTS, SlotSampling, sampler_variant
from fuselm.models.qwen35 import Qwen35
from fuselm.models.qwen35.cache import PAGE_SIZE, DeltaNetCache
from fuselm.ops.sampling import apply_token_bitmask, token_logprobs
from fuselm.runtime import PinnedStaging, cublaslt_preferred, graph_capture

logger = logging.getLogger(__name__)

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# Prefill graph buckets: a group of chunks is padded up to the next bucket in rows and in tokens
# (tokens: 16 and 24 times powers of two, so at most a third of a graph's tokens are padding).
ROW_BUCKETS = tuple(2 ** i for i in range(12))
TOKEN_BUCKETS = tuple(sorted({m * 2 ** i for m in (16, 24) for i in range(16)}))
# A mixed step's decode rows + chunk tokens are padded to a multiple of this: few graph shapes,
# and not past the rows where cuBLAS(Lt) picks slower tiles (H100, 9B, 32 decode rows: padding
# 288 rows to 320 would cost ~0.9 ms of a 12 ms step; benchmarks/NOTES.md 87).
GEMM_TILE_M = 32
# Prefill and mixed steps of more (padded) prompt tokens run eagerly: their GPU time (>= ~17 ms on
# the 9B) hides their ~1,200 launches, and a burst's shapes (several long prompts in one step)
# would each cost a capture on first use, a stall of the running requests (measured on the H100:
# up to 2 s between two tokens of a request at 32 clients).
GRAPH_MAX_TOKENS = 512
PACKED_COLUMNS = 5  # a prefill or mixed step's packed inputs per chunk past its ids (``_admit``)
PROMPT_LOGPROBS_POSITIONS = 512  # prompt positions a step of ``prompt_logprobs``' LM head ([512, V] logits)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next((b for b in buckets if b >= n), n)


class ModelRunner:
    """Prefill and CUDA-graph decode of a ``Qwen35`` over ``max_batch`` cache slots of
    ``max_len`` tokens."""

    def __init__(self, model: Qwen35, max_batch: int, max_len: int,
                 graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES, use_graphs: bool | None = None,
                 num_pages: int | None = None, page_size: int = PAGE_SIZE,
                 state_dtype: torch.dtype | str = torch.float32):
        if not isinstance(model, Qwen35):
            raise TypeError(f"model: expected a fuselm Qwen35, got {type(model).__name__}")
        self.model = model
        self.device = model.device
        self.cache = model.new_cache(max_batch, max_len, num_pages, page_size, state_dtype)  # checks them
        sizes = [b for b in graph_batch_sizes if isinstance(b, int) and not isinstance(b, bool) and b >= 1]
        if len(sizes) != len(graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes: expected positive ints, got {tuple(graph_batch_sizes)!r}")
        self.batch_sizes = tuple(sorted({b for b in sizes if b <= max_batch} | {max_batch}))
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"use_graphs: CUDA graphs need the model on a CUDA device, it is on {self.device}")
        self.sampling = SlotSampling(max_batch, model.config.vocab_size, self.device)
        # Pinned host memory for each step's small copies (admissions' inputs, ids read back):
        # the engine calls staging.next_step() before each step's launches.
        # (2 MiB a step: room for 64 rows of structured outputs' bitmasks at Qwen3.5's vocabulary, 31 KB each)
        self.staging = PinnedStaging(self.device, nbytes=2 << 20)
        self.input_tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        # The decode batch's row -> slot table, a permutation of the slots (graphs read its first b
        # rows); ``set_rows`` rewrites it between steps, from this host copy.
        self.row_slots = torch.arange(max_batch, device=self.device)
        self._row_slots = list(range(max_batch))
        # A mixed step's decode logits, for the sampler graphs (the mixed graphs write them here).
        self.decode_logits = torch.zeros(max_batch, model.config.vocab_size, dtype=model.dtype, device=self.device)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # decode (batch, variant); prefill, mixed: see _run_graph
        self._graph_outputs: dict[tuple, object] = {}
        self._graph_inputs: dict[tuple, torch.Tensor] = {}  # a prefill or mixed graph's packed inputs
        self._pool = None  # the memory pool every graph shares (they never run at the same time)
        if self.use_graphs:
            self._capture_graphs()

    @property
    def max_batch(self) -> int:
        return self.cache.max_batch

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def batch_size_for(self, rows: int) -> int:
        """The smallest decode batch size that covers rows 0 .. rows - 1."""
        return next(b for b in self.batch_sizes if b >= rows)

    def set_rows(self, slots: Sequence[int]) -> None:
        """Rows 0 .. len(slots) - 1 of the decode batch decode ``slots`` (distinct), from the next
        step on; the other slots fill the rows after them (idle rows). One small host-to-device
        copy through ``staging``, enqueued behind the steps already launched, when the table
        changes; nothing when it does not. The state stays where it is."""
        held = set(slots)
        if len(held) != len(slots) or not held <= set(range(self.max_batch)):
            raise ValueError(f"slots: expected distinct slots in [0, {self.max_batch}), got {list(slots)}")
        table = list(slots) + [slot for slot in self._row_slots if slot not in held]
        if table != self._row_slots:
            self._row_slots = table
            self.staging.copy_(self.row_slots, torch.tensor(table, dtype=torch.int64))

    # ------------------------------------------------------------------------ prefill
    @torch.no_grad()
    def share_prefill(self, pairs: Sequence[tuple[Request, Request]]) -> None:
        """For each (source, sharer) pair (``Scheduler.admit_sharers``: the same prompt, the
        source's first ``num_prompt_computed`` tokens in its slot): copy the source's cached
        prefix into the sharer's slot and pages (each DeltaNet layer's conv and recurrent state,
        the K/V pages of those positions, the length) and give the sharer its sampling
        parameters and block-table row, so that its next chunk continues from there. Queued on
        the stream (between graph replays), behind the step that computed the prefix and before
        the next one."""
        if not pairs:
            return
        sharers = [sharer for _, sharer in pairs]
        slots = [sharer.slot for sharer in sharers]
        self.sampling.assign(sharers, slots, self.staging)
        self.cache.assign_pages(slots, [sharer.pages for sharer in sharers], self.staging)
        source_slots = self.staging.to_device(torch.tensor([source.slot for source, _ in pairs], dtype=torch.int64))
        sharer_slots = self.staging.to_device(torch.tensor(slots, dtype=torch.int64))
        pages = [(source.pages[k], sharer.pages[k]) for source, sharer in pairs
                 for k in range(-(-source.num_prompt_computed // self.cache.page_size))]
        source_pages, sharer_pages = (self.staging.to_device(torch.tensor(column, dtype=torch.int64))
                                      for column in zip(*pages))
        for layer in self.cache.layers:
            if isinstance(layer, DeltaNetCache):
                for state in (layer.conv, layer.recurrent):
                    state.index_copy_(0, sharer_slots, state.index_select(0, source_slots))
            else:
                for kv in (layer.key, layer.value):
                    kv.index_copy_(0, sharer_pages, kv.index_select(0, source_pages))
        self.cache.lengths.index_copy_(0, sharer_slots, self.cache.lengths.index_select(0, source_slots))

    @torch.no_grad()
    def prefill(self, plan: list[tuple[Request, int, int]],
                masks: Callable | None = None) -> tuple[list[Request], torch.Tensor, torch.Tensor]:
        """Prefill ``plan``'s chunks: (request, first prompt position, tokens), each request with
        its ``slot`` and ``pages`` set, in one right-padded ``model.prefill_step``. Requests whose
        prompt ends with this chunk get their first token drawn and their slot activated; the
        others stay inactive until their last chunk. Returns (those requests, the logits [n, V]
        their first ids were drawn from (bans aside: module docstring), those ids [n]), on the
        device: not yet read, so the caller can launch a decode step behind them first; other
        slots are untouched. No host sync. ``masks``' rows index those requests (module docstring)."""
        packed, key = self._admit(plan)
        logits = self._run_graph(("prefill",) + key, packed, lambda inputs: self._prefill_body(inputs, key[2]))
        return self._first_tokens(plan, logits, masks)

    @torch.no_grad()
    def mixed(self, plan: list[tuple[Request, int, int]], batch: int, variant: str,
              masks: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step over rows 0 .. batch-1 (as :meth:`decode`) and ``plan``'s prompt chunks
        (as :meth:`prefill`) in one ``model.mixed_step``: the chunks ride on the decode step's
        read of the weights instead of taking a step of their own between decode steps. The
        chunks' slots must be inactive (a prompt not yet wholly in); a chunk that completes its
        prompt needs its request's row (``request.row``, below ``batch``, the row whose table
        entry is its slot): it draws its first id with the decode rows, in the same draw (its
        last token's logits go into that row of the decode logits and the slot turns active
        before the draw; ``variant`` must cover its request too). Returns (logits [batch, V], ids
        [batch]) by row, on the device (a completed prompt's first id and its logits in its row;
        static buffers, valid until the next step). ``masks``: by row (module docstring)."""
        for request, start, count in plan:  # host lists only: a drifted table would draw from the wrong row
            row = request.row
            if request.completes_prompt(start, count) and not (
                    row is not None and 0 <= row < batch and self._row_slots[row] == request.slot):
                raise ValueError(f"plan: request {request.request_id!r} completes its prompt in this step but its row "
                                 f"{request.row} is not a row below batch = {batch} whose table entry is its slot "
                                 f"{request.slot} (set_rows)")
        packed, key = self._admit(plan, batch)
        body = lambda inputs: self._mixed_body(inputs, batch, key[2])  # noqa: E731
        self._run_graph(("mixed", batch) + key, packed, body)
        logits = self._apply_masks(self.decode_logits[:batch], masks)
        return logits, self._sample_decode_logits(batch, variant)

    def capture_mixed_graphs(self, longest_chunk: dict[int, int]) -> int:
        """Capture now the mixed graphs of one prompt chunk beside each decode batch size b in
        ``longest_chunk``: every chunk of 1 .. longest_chunk[b] tokens (the scheduler's budget at b
        decode rows), padded as ``_admit`` pads it (``_padded_shape``), fresh and continued (a
        server calls this at start-up: a capture while requests run stalls them all, ~0.1 s).
        Writes only into idle slots' state and leaves the cache as it found it. Returns the
        graphs captured."""
        if not self.use_graphs:
            return 0
        if bool(self.cache.active.any()):
            raise RuntimeError("graphs are captured on an idle cache")
        slot = self.max_batch - 1
        captured = 0
        for batch, longest in longest_chunk.items():
            # (a chunk of more than GRAPH_MAX_TOKENS tokens runs eagerly whatever its padding)
            shapes = {self._padded_shape(1, count, batch) for count in range(1, min(longest, GRAPH_MAX_TOKENS) + 1)}
            for rows, tokens, graphed in sorted(shapes):
                for start in (0, 1) if graphed else ():  # fresh, continued
                    key = ("mixed", batch, rows, tokens, start == 0, graphed)
                    if key not in self._graphs:
                        packed = torch.zeros(1, tokens + PACKED_COLUMNS, dtype=torch.int64)
                        packed[0, tokens:] = torch.tensor([slot, start, tokens, 0, slot])
                        self._run_graph(key, packed, lambda inputs, b=batch, f=start == 0: self._mixed_body(inputs, b, f))
                        captured += 1
        self.cache.lengths.zero_()
        torch.cuda.synchronize(self.device)
        return captured

    def _padded_shape(self, rows: int, tokens: int, decode_rows: int) -> tuple[int, int, bool]:
        """(rows, tokens, graphed) of a step of ``rows`` chunks of at most ``tokens`` tokens beside
        ``decode_rows`` decode rows: one chunk of a mixed step padded so that both fill whole
        GEMM tiles; otherwise, with graphs, rows and tokens padded up to a bucket. ``graphed``:
        a graph runs it (at most ``GRAPH_MAX_TOKENS`` padded tokens); an eager step keeps its rows
        and tokens unbucketed."""
        if rows == 1 and decode_rows:
            tokens = -(-(decode_rows + tokens) // GEMM_TILE_M) * GEMM_TILE_M - decode_rows
            padded = rows, tokens
        else:
            padded = _bucket(rows, ROW_BUCKETS), _bucket(tokens, TOKEN_BUCKETS)
        if self.use_graphs and padded[0] * padded[1] <= GRAPH_MAX_TOKENS:
            return padded + (True,)
        return rows, tokens, False

    def _admit(self, plan: list[tuple[Request, int, int]],
               decode_rows: int = 0) -> tuple[torch.Tensor, tuple[int, int, bool, bool]]:
        """Give the fresh requests (position 0) their sampling parameters and block-table row, and
        pack the chunks' inputs for one host-to-device copy: [rows, tokens + 5] = ids, slot,
        start, length, completes, decode row (where a completed prompt's logits go in a mixed
        step), padded as ``_padded_shape`` says (padding rows repeat row 0, which writes the same
        values again). Returns (packed, (rows, tokens, fresh, graphed))."""
        fresh = [request for request, start, _ in plan if start == 0]
        if fresh:
            self.sampling.assign(fresh, [r.slot for r in fresh], self.staging)
            self.cache.assign_pages([r.slot for r in fresh], [r.pages for r in fresh], self.staging)
        rows, tokens, graphed = self._padded_shape(len(plan), max(count for _, _, count in plan), decode_rows)
        packed = torch.zeros(rows, tokens + PACKED_COLUMNS, dtype=torch.int64)
        for i in range(rows):
            request, start, count = plan[i if i < len(plan) else 0]
            packed[i, :count] = torch.tensor(request.prompt_token_ids[start:start + count])
            completes = request.completes_prompt(start, count)
            row = -1 if request.row is None else request.row  # (a prefill step reads no row)
            packed[i, tokens:] = torch.tensor([request.slot, start, count, completes, row])
        return packed, (rows, tokens, len(fresh) == len(plan), graphed)

    def _run_graph(self, key: tuple, packed: torch.Tensor, body):
        """``body(inputs)`` on the packed inputs: eager when ``key`` ends with graphed False;
        else one replay of ``key``'s graph, captured the first time it is needed (after an eager
        run that is this call's result and warms its kernels). Prefill and mixed steps run (and
        are captured) with cuBLASLt preferred: its picks for the GEMMs of a mixed step's 288 rows
        (32 decode + 256 prompt) are faster than cuBLAS's (``runtime.cublaslt_preferred``)."""
        if not key[-1]:
            with cublaslt_preferred(self.device):
                return body(self.staging.to_device(packed))
        if key in self._graphs:
            self.staging.copy_(self._graph_inputs[key], packed)
            self._graphs[key].replay()
            return self._graph_outputs[key]
        inputs = self._graph_inputs[key] = packed.to(self.device)
        with cublaslt_preferred(self.device):
            return self._capture_on_first_use(key, lambda: body(inputs))

    def _capture_on_first_use(self, key: tuple, body):
        """``body()`` run eagerly (this step's work, which also warms its kernels), then captured
        as ``key``'s graph in the shared pool (a capture runs nothing); returns the eager run's
        result (the graph's static outputs go to ``_graph_outputs[key]``)."""
        began = time.perf_counter()
        result = body()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self._pool):
            self._graph_outputs[key] = body()
        self._graphs[key] = graph
        logger.info("graph %s: warm-up run and capture in %.2f s (%d graphs)", key, time.perf_counter() - began,
                    len(self._graphs))
        return result

    def _first_tokens(self, plan: list[tuple[Request, int, int]], logits: torch.Tensor,
                      masks: Callable | None = None) -> tuple[list[Request], torch.Tensor, torch.Tensor]:
        """Draw the first token of each request whose prompt this plan completed, from its row
        of ``logits`` [>= rows, V]; it becomes the slot's next decode input. Returns (those
        requests, their rows of the logits, their ids)."""
        ends = [i for i, (request, start, count) in enumerate(plan) if request.completes_prompt(start, count)]
        if not ends:
            return [], logits[:0], torch.empty(0, dtype=torch.int64, device=self.device)
        completed = [plan[i][0] for i in ends]
        slots = self.staging.to_device(torch.tensor([r.slot for r in completed], dtype=torch.int64))
        rows = self.staging.to_device(torch.tensor(ends, dtype=torch.int64))
        logits = logits[rows]
        unbanned = self._apply_masks(logits, masks)
        first = self.sampling.sample_and_advance(logits, self.cache.active, sampler_variant(completed), slots,
                                                 self.input_tokens)
        return completed, unbanned, first

    @staticmethod
    def _unpack(inputs: torch.Tensor):
        tokens = inputs.shape[1] - PACKED_COLUMNS
        return (inputs[:, :tokens],) + tuple(inputs[:, tokens:].unbind(1))

    def _prefill_body(self, inputs: torch.Tensor, fresh: bool) -> torch.Tensor:
        """What a prefill graph holds: packed ``inputs`` (see ``_admit``) -> last-token logits
        [rows, V]; the slots that complete their prompt become active."""
        ids, slots, starts, lengths, completes, _ = self._unpack(inputs)
        logits = self.model.prefill_step(ids, self.cache, slots, starts, lengths, fresh)
        self.cache.active.index_copy_(0, slots, completes.bool())  # mid-prompt slots stay out of decode
        return logits

    def _mixed_body(self, inputs: torch.Tensor, batch: int, fresh: bool) -> None:
        """What a mixed graph holds: the model pass, its decode logits into the static
        ``decode_logits`` buffer (drawn from by the (batch, variant) sampler graph after it: one
        mixed graph serves every sampler), each chunk's last-token logits into its request's row
        there, and the slots whose prompt completes turned active: their first ids come from
        that draw. (A chunk that does not complete its prompt leaves its slot inactive: its row
        draws nothing that counts.)"""
        ids, slots, starts, lengths, completes, rows = self._unpack(inputs)
        decode_logits, logits = self.model.mixed_step(self.input_tokens, self.cache, ids, slots, starts, lengths,
                                                      fresh, decode_slots=self.row_slots[:batch])
        self.decode_logits[:batch].copy_(decode_logits)
        self.decode_logits.index_copy_(0, rows, logits)
        self.cache.active.index_copy_(0, slots, completes.bool())

    def _apply_masks(self, logits: torch.Tensor, masks: Callable | None) -> torch.Tensor:
        """-inf, in place, over the tokens ``masks()`` (``TokenMasks``) disallows in its rows of
        ``logits``. Returns the logits the draw's logprobs are of: ``logits``, or a copy taken
        before the bans when a banned row's request wants logprobs."""
        if masks is None:
            return logits
        token_masks = masks()
        self._mask(logits, token_masks.grammar_rows, token_masks.grammar)
        unbanned = logits.clone() if token_masks.ban_rows and token_masks.raw_logprobs else logits
        self._mask(logits, token_masks.ban_rows, token_masks.bans)
        return unbanned

    def _mask(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        if rows:
            apply_token_bitmask(logits, bitmask.to(self.device, non_blocking=True),
                                self.staging.to_device(torch.tensor(rows, dtype=torch.int64)))

    def _sample_decode_logits(self, batch: int, variant: str) -> torch.Tensor:
        """The next ids [batch] (by row) drawn from ``decode_logits[:batch]``: a graph replay, or
        eager."""
        if self.use_graphs:
            self._graphs["sample", batch, variant].replay()
            return self._graph_outputs["sample", batch, variant]
        return self._next_inputs(self.decode_logits[:batch], batch, variant)

    def release(self, slots: Sequence[int]) -> None:
        """Mark slots inactive (their requests ended on the host: a stop string, an abort). One
        fill kernel per slot, enqueued on the stream: no host sync. (``active[slot] = False``
        copies a host scalar and waits for the queued steps: measured on the H100, each finished
        request delayed the tokens of the step being read by a whole step, ITL p99 ~2 steps.)"""
        for slot in slots:
            self.cache.active[slot:slot + 1].fill_(False)

    # ------------------------------------------------------------------------ prompt log-probabilities
    @torch.no_grad()
    def prompt_logprobs(self, prompt_token_ids: Sequence[int], num_top: int) -> tuple[torch.Tensor, ...]:
        """Each prompt token's log-probability and rank after the tokens before it, and the
        ``num_top`` most likely tokens there: ``token_logprobs`` of the logits at positions 0 .. T-2
        for the ids at 1 .. T-1, four device tensors ([T-1] fp32, [T-1] int64, [T-1, k] fp32,
        [T-1, k] int64). A pass over the prompt of its own (``model.hidden_states``, in a cache of
        its own: the prefill keeps the last position's logits only), its LM head and log-probabilities
        ``PROMPT_LOGPROBS_POSITIONS`` positions at a time. Eager, no host sync; other slots untouched."""
        ids = self.staging.to_device(torch.tensor([list(prompt_token_ids)], dtype=torch.int64))
        hidden, targets = self.model.hidden_states(ids)[0, :-1], ids[0, 1:]
        parts = [token_logprobs(F.linear(hidden[start:start + PROMPT_LOGPROBS_POSITIONS], self.model.lm_head_weight),
                                targets[start:start + PROMPT_LOGPROBS_POSITIONS], num_top)
                 for start in range(0, max(len(targets), 1), PROMPT_LOGPROBS_POSITIONS)]
        return tuple(torch.cat(values) for values in zip(*parts))

    # ------------------------------------------------------------------------ decode
    @torch.no_grad()
    def _step_body(self, batch: int, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over rows 0 .. batch-1: (logits [batch, V], ids [batch])."""
        logits = self.model.decode_step(self.input_tokens, self.cache, self.row_slots[:batch])
        return logits, self._next_inputs(logits, batch, variant)

    @torch.no_grad()
    def _decode_logits(self, batch: int) -> None:
        """A decode step's forward pass over rows 0 .. batch-1 into ``decode_logits[:batch]``, no
        draw: the ("logits", batch) graph, captured the first time (after an eager run, which is
        this step: a capture runs nothing), or eager."""
        def body():
            self.decode_logits[:batch].copy_(self.model.decode_step(self.input_tokens, self.cache,
                                                                    self.row_slots[:batch]))

        key = ("logits", batch)
        if key in self._graphs:
            self._graphs[key].replay()
        elif self.use_graphs:
            self._capture_on_first_use(key, body)
        else:
            body()

    def _next_inputs(self, logits: torch.Tensor, batch: int, variant: str) -> torch.Tensor:
        """A decode step's ids [batch] from its logits [batch, V], row n's drawn with slot
        ``row_slots[n]``'s parameters (stops clear the slots' active flags) and written as that
        slot's next input."""
        return self.sampling.sample_and_advance(logits, self.cache.active, variant, self.row_slots[:batch],
                                                self.input_tokens)

    def _capture_graphs(self) -> None:
        """Warm up every (batch size, sampler) and the log-probabilities' kernels on a side stream
        (Triton JIT, cuBLAS workspaces, attention backend choice), then capture one graph each,
        largest first, all in one memory
        pool (their temporaries never live at the same time). Every slot is inactive here, so
        warm-up and capture write no request state."""
        if bool(self.cache.active.any()):
            raise RuntimeError("graphs are captured on an idle cache")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for batch in self.batch_sizes:
                for variant in SAMPLER_VARIANTS:
                    for _ in range(2):
                        self._step_body(batch, variant)
                        self._next_inputs(self.decode_logits[:batch], batch, variant)
            # The log-probabilities' kernel builds (a few: token_logprobs rounds the top count), so
            # that a request asking for them does not stall the running ones with a compile.
            for num_top in range(MAX_LOGPROBS + 1):
                token_logprobs(self.decode_logits[:1], self.input_tokens[:1], num_top)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for batch in reversed(self.batch_sizes):
            for variant in SAMPLER_VARIANTS:
                for key, body in (((batch, variant), lambda: self._step_body(batch, variant)),
                                  (("sample", batch, variant),
                                   lambda: self._next_inputs(self.decode_logits[:batch], batch, variant))):
                    graph = torch.cuda.CUDAGraph()
                    with graph_capture(graph, pool=self._pool):
                        self._graph_outputs[key] = body()
                    self._pool = graph.pool()
                    self._graphs[key] = graph
        torch.cuda.synchronize(self.device)

    def decode(self, batch: int, variant: str, masks: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over rows 0 .. batch-1 (``batch`` one of ``batch_sizes``; row n decodes
        the slot ``set_rows`` gave it): a graph replay, or eager. Returns (logits [batch, V],
        ids [batch]) by row: in a graph, its static buffers (valid until the next step). With
        ``masks`` (module docstring): the forward pass, the masks, then the draw."""
        if masks is not None:
            self._decode_logits(batch)
            logits = self._apply_masks(self.decode_logits[:batch], masks)
            return logits, self._sample_decode_logits(batch, variant)
        if self.use_graphs:
            self._graphs[batch, variant].replay()
            return self._graph_outputs[batch, variant]
        return self._step_body(batch, variant)
