"""Scheduler: which requests wait, which run, which cache slot and K/V pages each one owns, which
row of the decode batch each takes, and which prompt tokens are prefilled in the next step.

Requests wait in arrival order. Each step, ``schedule_prefill`` spends a budget of
``max_prefill_tokens`` tokens, the step's decode rows included (as vLLM's
max_num_batched_tokens: a mixed step's GEMMs then have at most that many rows, its time stays
bounded, and a budget that is a multiple of the GEMM tile keeps them whole), at least
``MIN_PREFILL_TOKENS`` of them prompt tokens: first on the prompts already admitted but not yet
wholly in the cache, then on waiting requests, which get a free slot, the next row of the decode batch
and the K/V pages for their prompt + max_tokens positions, taken at admission for the request's
life (so a running request never waits for memory and nothing is preempted); the head of the
queue waits while either is short.
A long prompt is so prefilled over several steps, each chunk in one pass with a decode step of
the requests already decoding; such a mixed step takes one prompt's chunk (a step with nothing
decoding prefills several prompts at once).
Prefill sharing (the n samples of one prompt): a request added with ``shares_prefill_with`` a
source request of the same prompt (T tokens) waits until the source has T - 1 of them in the
cache; the source's chunks stop there while any such request waits. The next step's
``admit_sharers`` (before ``schedule_prefill``) admits each one that finds a free slot and pages
with T - 1 tokens computed (it returns the (source, request) pairs: the caller copies the
source's state into the new slot before the step runs), and all of them, the source too, then
prefill their last token as a chunk of one and draw their first ids. A request that finds no
room then, or whose source ends first, runs as any other. So n samples cost one prefill of
T - 1 tokens and n of one, not n of T.
``finish`` frees a request's slot for the next one. A running request keeps its slot for its
whole life: its state never moves. Its row may: the running requests (prefilling ones too: a
prompt's first id is drawn in its row) hold rows 0 .. n-1, so the decode batch is the smallest
graph that covers n rows whichever slots they own; when one ends, the last row's request takes
its row (``row_slots``, the row -> slot table the runner's graphs read).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from fuselm.engine.request import Request

MIN_PREFILL_TOKENS = 16  # prompt tokens a step may always take, however many rows decode
MIXED_MAX_CHUNKS = 1  # prompt chunks beside a decode step (a step with nothing decoding takes more)
# Shorter prompts are not shared (a source's prefill in two chunks costs a step more; their prefill little)
MIN_SHARED_PREFILL_TOKENS = 64


class Scheduler:
    """Slots and decode rows 0 .. max_batch-1, K/V pages 0 .. num_pages-1 of ``page_size`` tokens; at most
    ``max_prefill_tokens`` (>= 1) tokens per step, decode rows and prompt tokens together (but
    min(max_prefill_tokens, MIN_PREFILL_TOKENS) prompt tokens whatever decodes)."""

    def __init__(self, max_batch: int, max_prefill_tokens: int, num_pages: int, page_size: int):
        if not isinstance(max_prefill_tokens, int) or isinstance(max_prefill_tokens, bool) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens: expected an int >= 1, got {max_prefill_tokens!r}")
        self.waiting: deque[Request] = deque()
        self.rows: list[Request] = []  # the running requests (prefilling or decoding) by row: request.row
        self.prefilling: deque[Request] = deque()  # admitted, prompt not yet wholly in the cache
        self._free_slots = list(range(max_batch))
        self._free_pages = list(range(num_pages))
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pages_needed(self, request: Request) -> int:
        """K/V pages for the request's prompt + max_tokens positions."""
        return -(-(len(request.prompt_token_ids) + request.params.max_tokens) // self.page_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if request.shares_prefill_with is not None:
            request.shares_prefill_with.sharers.append(request)

    def _admit(self, request: Request, pages: int) -> None:
        """Give a waiting request a slot, its pages and the next row."""
        self.waiting.remove(request)
        request.slot = heapq.heappop(self._free_slots)
        request.pages = [heapq.heappop(self._free_pages) for _ in range(pages)]
        request.row = len(self.rows)
        self.rows.append(request)
        self.prefilling.append(request)

    def admit_sharers(self) -> list[tuple[Request, Request]]:
        """Admit the requests whose source has its shared tokens in the cache, or let them run as
        any other when there is no room for them now. Returns the (source, admitted request)
        pairs: their state is to be copied before the next step."""
        forked = []
        ready = [r for r in self.prefilling if r.sharers and r.num_prompt_computed == len(r.prompt_token_ids) - 1]
        for source in ready:
            for request in source.sharers:
                request.shares_prefill_with = None
                pages = self.pages_needed(request)
                if self._free_slots and pages <= self.free_pages:
                    self._admit(request, pages)
                    request.num_prompt_computed = source.num_prompt_computed
                    forked.append((source, request))
            source.sharers = []
        return forked

    def holds(self, request: Request) -> bool:
        """Whether ``request`` is running here (it holds a slot and a row)."""
        row = request.row
        return row is not None and row < len(self.rows) and self.rows[row] is request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.rows)

    def prompt_budget(self, decode_rows: int) -> int:
        """Prompt tokens (padded rows counted) a step with ``decode_rows`` decode rows may take."""
        return max(self.max_prefill_tokens - decode_rows, min(self.max_prefill_tokens, MIN_PREFILL_TOKENS))

    def schedule_prefill(self, decode_rows: int = 0) -> list[tuple[Request, int, int]]:
        """This step's prefill work as (request, first prompt position, tokens): the prompts in
        progress first, then newly admitted ones, within the token budget less the step's
        ``decode_rows``, counting each row as long as the plan's longest (the rows are padded to
        it). Empty when there is none."""
        # The chunks run right-padded to the longest one: R rows of T tokens cost R T, so a plan
        # of R rows keeps R x its longest chunk within the budget. Beside decode rows a step takes
        # one prompt's chunk (MIXED_MAX_CHUNKS): a prompt's short remainder beside the next
        # prompt's start pads to two long rows and runs as continued chunks (H100, 9B, budget 512:
        # 32 + 240 tokens in two rows took 38 ms, 480 fresh tokens in one 19 ms; session 12,
        # benchmarks/engine_steps.py), and one-row mixed steps are the graphs captured up front.
        budget = self.prompt_budget(decode_rows)
        max_rows = MIXED_MAX_CHUNKS if decode_rows else None
        plan, longest = [], 0

        def chunk(request: Request) -> int:  # tokens its next row may take (0: it does not fit)
            rows = len(plan) + 1
            if max_rows is not None and rows > max_rows:
                return 0
            end = len(request.prompt_token_ids) - (1 if request.sharers else 0)  # (sharers wait for T - 1)
            return min(end - request.num_prompt_computed, budget // rows) if rows * longest <= budget else 0

        for request in self.prefilling:
            count = chunk(request)
            if count == 0:
                return plan
            plan.append((request, request.num_prompt_computed, count))
            longest = max(longest, count)
        # arrival order, but a request that shares a prefill waits for its source (admit_sharers);
        # as many candidates as free slots (a copy: admitting one takes it out of the queue)
        candidates = (r for r in self.waiting if r.shares_prefill_with is None)
        for request in list(itertools.islice(candidates, len(self._free_slots))):
            count = chunk(request) if self._free_slots else 0
            pages = self.pages_needed(request)
            if count == 0 or pages > self.free_pages:
                break
            self._admit(request, pages)
            plan.append((request, 0, count))
            longest = max(longest, count)
        return plan

    def prefilled(self, request: Request, tokens: int) -> None:
        """``tokens`` more of ``request``'s prompt are in the cache."""
        request.num_prompt_computed += tokens
        if request.prompt_computed:
            self.prefilling.remove(request)

    def decoding(self) -> dict[int, Request]:
        """row -> request of the running requests whose prompt is wholly in the cache."""
        return {request.row: request for request in self.rows if request.prompt_computed}

    def row_slots(self) -> list[int]:
        """Each row's slot: the running requests' slots in row order (the decode batch's table)."""
        return [request.slot for request in self.rows]

    def rows_in_use(self) -> int:
        """Rows the running requests hold, 0 .. n-1: the decode step must cover these."""
        return len(self.rows)

    def rows_in_use_after_admission(self) -> int:
        """``rows_in_use`` once the next waiting request takes the next row (what a step that
        admits it covers; the same when nothing waits or no slot is free)."""
        return len(self.rows) + bool(self.waiting and self._free_slots)

    def finish(self, request: Request) -> None:
        """Free a finished (or aborted) request's slot, row and pages (the last row's request
        moves into its row)."""
        if self.holds(request):
            last = self.rows.pop()
            if last is not request:
                self.rows[request.row] = last
                last.row = request.row
            request.row = None
            heapq.heappush(self._free_slots, request.slot)
            for page in request.pages:
                heapq.heappush(self._free_pages, page)
            request.pages = []
            if request in self.prefilling:
                self.prefilling.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for sharer in request.sharers:  # they prefill their prompts themselves
            sharer.shares_prefill_with = None
        request.sharers = []
        if request.shares_prefill_with is not None:
            request.shares_prefill_with.sharers.remove(request)
            request.shares_prefill_with = None
