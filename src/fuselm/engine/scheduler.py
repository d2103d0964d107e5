"""Scheduler: which requests wait, which run, and which cache slot each one owns.

Requests wait in arrival order. ``admit`` gives waiting requests the lowest free slots (so the
running slots stay packed at the bottom and the decode graph stays small) and returns them for
prefill; ``finish`` frees a request's slot for the next one. A running request keeps its slot
for its whole life: its state never moves.
"""

from __future__ import annotations

import heapq
from collections import deque

from fuselm.engine.request import Request


class Scheduler:
    """Slots 0 .. max_batch-1; ``max_prefill_tokens`` bounds the prompt tokens of one prefill
    (at least one request is always admitted when a slot is free)."""

    def __init__(self, max_batch: int, max_prefill_tokens: int):
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self._free_slots = list(range(max_batch))
        self.max_prefill_tokens = max_prefill_tokens

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Waiting requests that get a slot now, in arrival order (empty when none can)."""
        admitted, tokens = [], 0
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            if admitted and tokens + len(request.prompt_token_ids) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            request.slot = heapq.heappop(self._free_slots)
            self.running[request.slot] = request
            admitted.append(request)
            tokens += len(request.prompt_token_ids)
        return admitted

    def slots_in_use(self) -> int:
        """1 + the highest running slot (0 when none runs): the decode step must cover these."""
        return max(self.running) + 1 if self.running else 0

    def finish(self, request: Request) -> None:
        """Free a finished (or aborted) request's slot."""
        if request.slot is not None and self.running.get(request.slot) is request:
            del self.running[request.slot]
            heapq.heappush(self._free_slots, request.slot)
        elif request in self.waiting:
            self.waiting.remove(request)
