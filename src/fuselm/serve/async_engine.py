"""The serving engine loop and its asyncio clients: an ``Engine`` stepped by a thread of its own,
its requests streamed to an event loop.

Pieces:
- ``EngineLoop``: the engine thread's work. It owns the ``Engine`` (every ``add_request``,
  ``launch``, ``read`` and ``abort`` runs on it, so the engine needs no locks), takes commands
  (submit, abort, stop) in the order they were sent and answers with plain picklable messages:
  ``("accepted", request_id, error)`` (the error that refused a submission, or None), ``("deltas",
  [(request_id, RequestDelta), ...], EngineStats)`` (a step's new tokens, detokenized and
  stop-string checked here, one message for many requests, and the engine's state after it) and,
  at its exit, ``("closed", reason)``. When no request is unfinished it blocks on its commands
  (no busy loop); while requests run it takes the commands that came in between two steps.
- ``EngineClient``: the event loop's side: ``submit`` (a ``RequestStream`` per request),
  ``abort``, ``shutdown``; it routes the answers to their streams (and, given ``metrics``, records
  them: ``fuselm.serve.metrics``).
- ``AsyncEngine``: the loop on a thread of this process, its answers handed to the event loop
  with ``call_soon_threadsafe``: in-process use and tests.
- ``fuselm.serve.engine_process.EngineProcess``: the loop in a process of its own, answers over a
  pipe: what ``fuselm serve`` runs, so that the HTTP side never holds the GIL the engine thread
  needs between two steps.

Publishing. The engine thread hands a step's tokens over in two parts: the requests it finished
at once, the others after it has launched the next step (after the admission wait too, when there
is one). The event loop then writes their stream chunks while the engine thread waits on the GPU
(without the GIL), not while it plans and launches a step: each of its torch calls releases the
GIL and must take it back, and a loop busy with 32 streams in the same process holds the GIL for
a switch interval at a time (measured on the H100: host spans of 10-26 ms between steps, the GPU
idle, benchmarks/NOTES.md 89).

Admission wait. The engine plans step n+1 as soon as it has read step n-1 (step n still runs on
the GPU), so a request that comes in just after that plan waits a whole step more for its first
chunk. A closed-loop client (a chat user, a benchmark with max concurrency) sends its next
request right after the last token of its previous one, a few ms after the step that ended it
was read. So after a step that finished a request, while none waits, the engine thread waits up
to ``admission_wait`` seconds for a command before it plans the next step (the step in flight
keeps the GPU busy meanwhile: keep it well under a decode step less the host's launch of a
mixed step, ~3.5 ms on the 9B).

    engine = AsyncEngine(Engine(model, max_batch=8), tokenizer=tokenizer, max_queue=64)
    engine.start()                      # in the event loop that submits
    stream = await engine.submit(prompt_ids, SamplingParams(max_tokens=16))
    async for delta in stream:          # RequestDelta: new text and token ids, finish_reason last
        ...
    await engine.shutdown()             # aborts what still runs, ends the thread
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from fuselm.engine.engine import Engine
from fuselm.engine.request import Request, RequestOutput, SamplingParams, TokenLogprobs
from fuselm.serve.metrics import EngineStats, ServerMetrics

logger = logging.getLogger(__name__)

ADMISSION_WAIT_S = 0.003  # the default admission wait (module docstring)
MAX_ADMISSION_WAIT_S = 0.05


class EngineUnavailableError(RuntimeError):
    """The request was not taken: too many are waiting (``QueueFullError``) or the engine is not
    running (stopped, or failed)."""


class QueueFullError(EngineUnavailableError):
    """More than ``max_queue`` requests would be waiting for a slot."""


@dataclass(frozen=True)
class RequestDelta:
    """What one engine step gave a request: ``text`` (detokenized text made final, stop strings
    cut; "" without a tokenizer), ``token_ids`` (the new ids) and, when the request asks for them,
    their ``logprobs`` (one ``TokenLogprobs`` each) and, in its first delta, its
    ``prompt_logprobs``. The last delta of a request has ``finish_reason`` ("stop" or "length")
    and the final ``output``, or ``error`` when the request was cut short (the server stopping,
    the engine failing)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """One submitted request as the event loop sees it: ``async for delta in stream`` yields its
    ``RequestDelta`` s until the last one. ``finished``: the last one has been yielded."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._deltas: asyncio.Queue[RequestDelta] = asyncio.Queue()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while not self.finished:
            delta = await self._deltas.get()
            self.finished = delta.last
            yield delta


def check_admission_wait(admission_wait) -> float:
    if (not isinstance(admission_wait, (int, float)) or isinstance(admission_wait, bool)
            or not 0 <= admission_wait <= MAX_ADMISSION_WAIT_S):
        raise ValueError(f"admission_wait: expected seconds in [0, {MAX_ADMISSION_WAIT_S}], got {admission_wait!r}")
    return float(admission_wait)


def check_max_queue(max_queue) -> int | None:
    if max_queue is not None and (not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0):
        raise ValueError(f"max_queue: expected None or an int >= 0, got {max_queue!r}")
    return max_queue


# Commands from a client to the engine loop, handled in the order they were sent (picklable).
@dataclass
class Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    submitted: float  # time.perf_counter() on the client's side: the request's arrival (one clock per host)
    grammar_starts_after: int | None = None  # Engine.add_request's
    shares_prefill_with: str | None = None  # the id of a request whose prefill this one shares (Engine.add_request)


@dataclass
class Abort:
    request_id: str


class Stop:
    pass


@dataclass
class _Running:
    """The engine loop's record of an accepted, unfinished request."""

    request: Request
    published_tokens: int = 0  # output ids already handed to the client


class EngineLoop:
    """The engine thread's work (module docstring): ``run()`` takes commands from ``commands``
    and steps ``engine`` while any request is unfinished, answering through ``answer(message)``.

    Args:
        engine: the ``Engine``; while ``run`` runs only its thread touches it.
        commands: where commands come from, in order: ``get(timeout=None)`` (blocks; raises
            ``queue.Empty`` past ``timeout``) and ``empty()``, as ``queue.SimpleQueue``.
        answer: called on the engine thread with each message (module docstring).
        tokenizer: detokenizes each request's ids as they come (None: deltas carry ids only).
        max_queue: requests that may wait for a slot beyond the ``engine.max_batch`` running; a
            submission past that is refused with ``QueueFullError`` (None: no limit).
        admission_wait: seconds the engine thread waits for a new request after a step that
            finished one, while none waits (module docstring; 0: never).
    """

    def __init__(self, engine: Engine, commands, answer: Callable[[tuple], None], *, tokenizer=None,
                 max_queue: int | None = None, admission_wait: float = ADMISSION_WAIT_S):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = check_max_queue(max_queue)
        self.admission_wait = check_admission_wait(admission_wait)
        self._commands = commands
        self._answer = answer
        self._running: dict[str, _Running] = {}  # request_id -> record
        self.failure: BaseException | None = None  # what ended the loop, if it failed

    def run(self) -> None:
        """Take commands, step while any request is unfinished, publish; until a ``Stop`` (or a
        failed step, which ends every request with an error)."""
        reason = "the engine was shut down"
        try:
            if self.engine.model.device.type == "cuda":
                torch.cuda.set_device(self.engine.model.device)
            finished = False  # the last step finished a request
            going_on: list[Request] = []  # the last step's other requests with new tokens
            while True:
                commands = self._next_commands(finished)
                for command in commands:
                    if isinstance(command, Stop):
                        self._publish(going_on)  # the tokens read: before the streams end
                        return
                    self._handle(command)
                finished = False
                if self.engine.has_unfinished_requests():
                    self.engine.launch()
                    self._publish(going_on)  # the client writes them while this thread waits on the device
                    updated = self.engine.read()
                    ended = [request for request in updated if request.finished]
                    finished, going_on = bool(ended), [request for request in updated if not request.finished]
                    self._publish(ended)  # at once: a closed-loop client's next request must not wait a step
        except BaseException as error:  # a failed step (e.g. a CUDA error) ends every request
            logger.exception("the engine loop failed")
            self.failure, reason = error, f"the engine failed: {error!r}"
        finally:
            self._close(reason)

    def _next_commands(self, finished: bool) -> list:
        """The commands to handle before the next step: block until one comes when no request is
        unfinished; after a step that ``finished`` a request, while none waits, wait up to
        ``admission_wait`` for one (the admission wait); then take all that are queued."""
        commands = []
        if not self.engine.has_unfinished_requests():
            commands.append(self._commands.get())  # idle: sleep until a command comes
        elif finished and self.admission_wait and not self.engine.num_waiting_requests():
            try:
                commands.append(self._commands.get(timeout=self.admission_wait))
            except queue.Empty:
                pass
        while not self._commands.empty():
            commands.append(self._commands.get())
        return commands

    def _handle(self, command) -> None:
        if isinstance(command, Submit):
            self._accept(command)
        elif isinstance(command, Abort):
            running = self._running.pop(command.request_id, None)
            if running is not None:
                self.engine.abort(running.request)
                self._answer(("deltas", [(command.request_id, RequestDelta("", [], error="aborted"))],
                              self._stats()))

    def _accept(self, submit: Submit) -> None:
        """``add_request`` for a submission (its detokenizer built here), then answer whether it
        was taken."""
        waiting = len(self._running) - self.engine.max_batch  # requests already without a slot
        if self.max_queue is not None and waiting >= self.max_queue:
            error = QueueFullError(f"too many requests: {len(self._running)} are unfinished, {self.engine.max_batch} "
                                   f"run at once and at most {self.max_queue} may wait; retry later")
            self._answer(("accepted", submit.request_id, error))
            return
        try:
            detokenizer = None if self.tokenizer is None else self.tokenizer.detokenizer(
                submit.prompt_token_ids, **submit.params.detokenizer_options)
            source = self._running.get(submit.shares_prefill_with)
            request = self.engine.add_request(submit.prompt_token_ids, submit.params, request_id=submit.request_id,
                                              prompt=submit.prompt, detokenizer=detokenizer,
                                              grammar_starts_after=submit.grammar_starts_after,
                                              shares_prefill_with=None if source is None else source.request)
        except Exception as error:  # ValueError / TypeError: a bad request; anything else fails it alone
            self._answer(("accepted", submit.request_id, error))
            return
        request.metrics.arrival_time = submit.submitted  # TTFT from the client's submission, not the engine's pickup
        self._running[request.request_id] = _Running(request)
        self._answer(("accepted", submit.request_id, None))

    def _publish(self, updated: list[Request]) -> None:
        """One ``RequestDelta`` for each of ``updated`` (requests that got tokens in a step) still
        running here, all in one message."""
        deltas = []
        for request in updated:
            running = self._running.get(request.request_id)
            if running is None or running.request is not request:
                continue
            published = running.published_tokens
            new_ids = request.output_token_ids[published:]
            logprobs = None if request.params.logprobs is None else request.output_logprobs[published:]
            prompt_logprobs = request.prompt_logprobs if published == 0 else None
            running.published_tokens = len(request.output_token_ids)
            text = request.take_new_text()
            if request.finished:
                del self._running[request.request_id]
                delta = RequestDelta(text, new_ids, request.finish_reason.value, request.output(), logprobs=logprobs,
                                     prompt_logprobs=prompt_logprobs)
            else:
                delta = RequestDelta(text, new_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
            deltas.append((request.request_id, delta))
        if deltas:
            self._answer(("deltas", deltas, self._stats()))

    def _stats(self) -> EngineStats:
        return EngineStats(self.engine.num_running_requests(), self.engine.num_waiting_requests(),
                           self.engine.kv_cache_usage())

    def _close(self, reason: str) -> None:
        """The loop's exit: answer ``("closed", reason)`` (the client then ends every unfinished
        request's stream with ``reason`` and refuses its submissions not yet answered) and, unless
        the engine failed, abort the requests still here and read the step still in flight, so
        the engine is left empty."""
        running, self._running = self._running, {}
        self._answer(("closed", reason))
        if self.failure is not None:  # a failed engine is not touched again
            return
        try:
            for record in running.values():
                self.engine.abort(record.request)
            while self.engine.has_unfinished_requests():
                self.engine.step()  # only reads the decode step in flight: nothing runs any more
        except Exception:
            logger.exception("the engine failed while its requests were being aborted")


class EngineClient:
    """The event loop's side of an ``EngineLoop`` (module docstring). A subclass carries the
    commands and answers: ``_send(command)`` (False when they can no longer reach the loop), and
    each answer handed to ``_receive`` on the event loop's thread. Every method runs on that
    thread."""

    def __init__(self):
        self._streams: dict[str, RequestStream] = {}  # submitted, not yet ended
        self._accepted: dict[str, asyncio.Future] = {}  # submitted, not yet answered
        self._accepting = False
        self._closed_reason: str | None = None
        self.metrics: ServerMetrics | None = None  # (the server's: records every request's deltas)

    def _send(self, command) -> bool:
        raise NotImplementedError

    @property
    def max_len(self) -> int:
        """Tokens a request may hold (prompt + output): the engine's ``max_request_tokens``
        (its max_len, or fewer where its K/V cache holds fewer: a chat request without max_tokens
        then gets what fits, not a 400 about pages)."""
        raise NotImplementedError

    @property
    def max_requests(self) -> int | None:
        """Requests it holds at once, running and waiting (max_batch + max_queue); None when
        the queue has no limit."""
        raise NotImplementedError

    def start(self) -> None:
        """Take requests; answers go to the running event loop."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Abort every unfinished request (their streams end with an error delta) and stop the
        engine loop."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """The engine loop runs and takes requests."""
        return self._accepting

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                     prompt: str | None = None, grammar_starts_after: int | None = None,
                     shares_prefill_with: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine loop has taken it (``Engine.add_request``, which
        takes ``grammar_starts_after`` too, and ``shares_prefill_with``: the request of that id,
        when it still runs);
        returns its ``RequestStream``. Raises what ``add_request`` raised (ValueError / TypeError
        naming the field for a request it cannot run), ``QueueFullError``, or
        ``EngineUnavailableError``. A submitter cancelled while waiting has its request aborted."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if not self._accepting:
            raise self._unavailable()
        accepted = asyncio.get_running_loop().create_future()
        stream = self._streams[request_id] = RequestStream(request_id)
        self._accepted[request_id] = accepted
        submitted = time.perf_counter()
        if self.metrics is not None:
            self.metrics.submitted(request_id, len(prompt_token_ids), submitted)
        if not self._send(Submit(request_id, list(prompt_token_ids), params, prompt, submitted,
                                 grammar_starts_after, shares_prefill_with)):
            self._end(self._closed_reason or "the engine is not running")
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(stream)  # reaches the loop after the submission: commands keep their order
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End ``stream``'s request and free its slot (nothing happens if it has finished)."""
        if not stream.finished and self._accepting:
            self._send(Abort(stream.request_id))

    def _unavailable(self) -> EngineUnavailableError:
        return EngineUnavailableError(self._closed_reason or "the engine is not running (it was not started)")

    def _receive(self, message: tuple) -> None:
        """One answer of the engine loop (module docstring), on the event loop's thread."""
        kind = message[0]
        if kind == "accepted":
            _, request_id, error = message
            accepted = self._accepted.pop(request_id, None)
            if error is not None:
                self._streams.pop(request_id, None)
                if self.metrics is not None:
                    self.metrics.refused(request_id)
            if accepted is not None and not accepted.done():  # (done: its submitter gave up)
                accepted.set_result(None) if error is None else accepted.set_exception(error)
        elif kind == "deltas":
            now = time.perf_counter()
            for request_id, delta in message[1]:
                stream = self._streams.pop(request_id, None) if delta.last else self._streams.get(request_id)
                if stream is not None:
                    stream._deltas.put_nowait(delta)
                if self.metrics is not None:
                    self.metrics.delta(request_id, delta, now)
            if self.metrics is not None:
                self.metrics.engine_stats = message[2]
        elif kind == "closed":
            self._end(message[1])

    def _end(self, reason: str) -> None:
        """The engine loop is gone: refuse what it did not answer, end every stream with ``reason``."""
        self._accepting = False
        self._closed_reason = self._closed_reason or reason
        accepted, self._accepted = self._accepted, {}
        for future in accepted.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(reason))
        streams, self._streams = self._streams, {}
        now = time.perf_counter()
        for request_id, stream in streams.items():
            if request_id not in accepted:
                stream._deltas.put_nowait(RequestDelta("", [], error=reason))
            if self.metrics is None:
                continue
            if request_id in accepted:
                self.metrics.refused(request_id)
            else:
                self.metrics.delta(request_id, RequestDelta("", [], error=reason), now)
        if self.metrics is not None:
            self.metrics.engine_stats = EngineStats()


class AsyncEngine(EngineClient):
    """``engine`` on a thread of this process (module docstring).

    Args:
        engine: the ``Engine``; after ``start`` only the engine thread touches it.
        tokenizer, max_queue, admission_wait: as ``EngineLoop``'s.
    """

    def __init__(self, engine: Engine, *, tokenizer=None, max_queue: int | None = None,
                 admission_wait: float = ADMISSION_WAIT_S):
        super().__init__()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._engine_loop = EngineLoop(engine, self._commands, self._answer, tokenizer=tokenizer,
                                       max_queue=max_queue, admission_wait=admission_wait)
        self._thread = threading.Thread(target=self._engine_loop.run, name="fuselm-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def engine(self) -> Engine:
        return self._engine_loop.engine

    @property
    def max_len(self) -> int:
        return self.engine.max_request_tokens

    @property
    def max_requests(self) -> int | None:
        max_queue = self._engine_loop.max_queue
        return None if max_queue is None else self.engine.max_batch + max_queue

    @property
    def failure(self) -> BaseException | None:
        """What ended the engine thread, if it failed."""
        return self._engine_loop.failure

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._accepting and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread; its answers go to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread.start()

    def _send(self, command) -> bool:
        self._commands.put(command)
        return self._thread.is_alive()

    def _answer(self, message: tuple) -> None:  # on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._receive, message)
        except RuntimeError:  # the event loop has closed: nobody waits
            pass

    async def shutdown(self) -> None:
        """``EngineClient.shutdown``: the engine thread ends before it returns."""
        if self._thread.is_alive():
            self._commands.put(Stop())
            await asyncio.to_thread(self._thread.join)  # (its answers, "closed" last, have run by then)
        self._end("the engine was shut down")
