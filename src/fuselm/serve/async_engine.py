"""``AsyncEngine``: an ``Engine`` run by a thread of its own, its requests streamed to asyncio.

Threading model. One engine thread owns the ``Engine``: every ``add_request``, ``launch``,
``read`` and ``abort`` runs on it, so the engine needs no locks. The event loop talks to it only through a
thread-safe command queue (submit, abort, stop) and hears back only through
``loop.call_soon_threadsafe``: a submission's acceptance (or the error that refused it), then one
``RequestDelta`` per step that gave the request tokens, put into that request's
``asyncio.Queue``. When no request is unfinished the engine thread blocks on the command queue
(no busy loop); while requests run it takes the commands that came in between two steps.

Publishing. The engine thread hands a step's tokens to the event loop in two parts: the
requests it finished at once, the others after it has launched the next step (after the
admission wait too, when there is one). The loop's thread then writes their stream chunks while
the engine thread waits on the GPU (without the GIL), not while it plans and launches a step:
each of its torch calls releases the GIL and must take it back, and a loop busy with 32 streams
holds the GIL for a switch interval at a time (measured on the H100: host spans of 10-26 ms
between steps, the GPU idle, benchmarks/NOTES.md 89).

Admission wait. The engine plans step n+1 as soon as it has read step n-1 (step n still runs on
the GPU), so a request that comes in just after that plan waits a whole step more for its first
chunk. A closed-loop client (a chat user, a benchmark with max concurrency) sends its next
request right after the last token of its previous one, a few ms after the step that ended it
was read. So after a step that finished a request, while none waits, the engine thread waits up
to ``admission_wait`` seconds for a command before it plans the next step (the step in flight
keeps the GPU busy meanwhile: keep it well under a decode step less the host's launch of a
mixed step, ~3.5 ms on the 9B).

    engine = AsyncEngine(Engine(model, max_batch=8), max_queue=64)
    engine.start()
    stream = await engine.submit(prompt_ids, SamplingParams(max_tokens=16), detokenizer=...)
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
from typing import Sequence

import torch

from fuselm.engine.engine import Engine
from fuselm.engine.request import Request, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

ADMISSION_WAIT_S = 0.003  # the default admission wait (module docstring)
MAX_ADMISSION_WAIT_S = 0.05


class EngineUnavailableError(RuntimeError):
    """The request was not taken: too many are waiting (``QueueFullError``) or the engine thread
    is not running (stopped, or failed)."""


class QueueFullError(EngineUnavailableError):
    """More than ``max_queue`` requests would be waiting for a slot."""


@dataclass(frozen=True)
class RequestDelta:
    """What one engine step gave a request: ``text`` (detokenized text made final, stop strings
    cut; "" without a detokenizer) and ``token_ids`` (the new ids). The last delta of a request
    has ``finish_reason`` ("stop" or "length") and the final ``output``, or ``error`` when the
    request was cut short (the server stopping, the engine failing)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    error: str | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """One submitted request as the event loop sees it: ``async for delta in stream`` yields its
    ``RequestDelta`` s until the last one. ``finished``: the last one has been yielded."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self.loop = loop
        self._deltas: asyncio.Queue[RequestDelta] = asyncio.Queue()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while not self.finished:
            delta = await self._deltas.get()
            self.finished = delta.last
            yield delta

    def deliver(self, delta: RequestDelta) -> None:
        """Hand ``delta`` to the stream's event loop (the engine thread's side)."""
        RequestStream.deliver_all(self.loop, [(self, delta)])

    @staticmethod
    def deliver_all(loop: asyncio.AbstractEventLoop, deltas: list[tuple[RequestStream, RequestDelta]]) -> None:
        """Hand each (stream, delta) of streams on ``loop`` to its stream in one call into the loop
        (the engine thread's side): one wake-up of the loop's thread for a step's deltas, not one a
        request, so fewer handoffs of the GIL between the two threads."""
        _call_in_loop(loop, _put_all, deltas)


def _call_in_loop(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """``callback(*args)`` on ``loop``'s thread; dropped when the loop has closed (nobody waits)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _put_all(deltas: list[tuple[RequestStream, RequestDelta]]) -> None:
    for stream, delta in deltas:
        stream._deltas.put_nowait(delta)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    """Resolve a submission's acceptance future (on its loop), unless its submitter gave up."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


# Commands from the event loop to the engine thread, handled in the order they were sent.
@dataclass
class _Submit:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    detokenizer: object | None
    accepted: asyncio.Future
    submitted: float  # time.perf_counter() on the event loop: the request's arrival


@dataclass
class _Abort:
    stream: RequestStream


class _Stop:
    pass


@dataclass
class _Running:
    """The engine thread's record of an accepted, unfinished request."""

    request: Request
    stream: RequestStream
    published_tokens: int = 0  # output ids already handed to the stream


class AsyncEngine:
    """``engine`` on its own thread (see the module docstring for the threading model).

    Args:
        engine: the ``Engine``; after ``start`` only the engine thread touches it.
        max_queue: requests that may wait for a slot beyond the ``engine.max_batch`` running; a
            submission past that is refused with ``QueueFullError`` (None: no limit).
        admission_wait: seconds the engine thread waits for a new request after a step that
            finished one, while none waits (see the module docstring; 0: never).
    """

    def __init__(self, engine: Engine, max_queue: int | None = None, admission_wait: float = ADMISSION_WAIT_S):
        if max_queue is not None and (not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0):
            raise ValueError(f"max_queue: expected None or an int >= 0, got {max_queue!r}")
        if (not isinstance(admission_wait, (int, float)) or isinstance(admission_wait, bool)
                or not 0 <= admission_wait <= MAX_ADMISSION_WAIT_S):
            raise ValueError(f"admission_wait: expected seconds in [0, {MAX_ADMISSION_WAIT_S}], got {admission_wait!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.admission_wait = float(admission_wait)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fuselm-engine", daemon=True)
        # Guards ``_accepting`` against the engine thread's exit, so that no command is queued
        # after the thread's last look at the queue (it would never be answered).
        self._accepting_lock = threading.Lock()
        self._accepting = False
        self._running: dict[str, _Running] = {}  # engine thread only: request_id -> record
        self.failure: BaseException | None = None  # what ended the engine thread, if it failed

    # ------------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start the engine thread."""
        self._accepting = True
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread is running and takes requests."""
        return self._accepting and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _send(self, command) -> bool:
        """Queue ``command`` for the engine thread; False when the thread no longer reads them."""
        with self._accepting_lock:
            if self._accepting:
                self._commands.put(command)
            return self._accepting

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                     prompt: str | None = None, detokenizer=None) -> RequestStream:
        """Queue a request and wait until the engine thread has taken it (``Engine.add_request``);
        returns its ``RequestStream``. Raises what ``add_request`` raised (ValueError / TypeError
        naming the field for a request it cannot run), ``QueueFullError``, or
        ``EngineUnavailableError``. A submitter cancelled while waiting has its request aborted."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id or uuid.uuid4().hex, loop)
        accepted = loop.create_future()
        if not self._send(_Submit(stream, list(prompt_token_ids), params, prompt, detokenizer, accepted,
                                  time.perf_counter())):
            raise self._unavailable()
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(stream)  # runs after the submission on the engine thread: commands keep their order
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End ``stream``'s request and free its slot (nothing happens if it has finished). Safe
        from any thread."""
        if not stream.finished:
            self._send(_Abort(stream))

    async def shutdown(self) -> None:
        """Abort every unfinished request (their streams end with an error delta), stop the
        engine thread and wait for it to end."""
        self._send(_Stop())
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    def _unavailable(self) -> EngineUnavailableError:
        if self.failure is not None:
            return EngineUnavailableError(f"the engine failed: {self.failure!r}")
        return EngineUnavailableError("the engine is not running (it was shut down)")

    # ------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        """The engine thread: take commands, step while any request is unfinished, publish."""
        reason = "the engine was shut down"
        try:
            if self.engine.model.device.type == "cuda":
                torch.cuda.set_device(self.engine.model.device)
            finished = False  # the last step finished a request
            going_on: list[Request] = []  # the last step's other requests with new tokens
            while True:
                commands = self._next_commands(finished)
                for command in commands:
                    if isinstance(command, _Stop):
                        self._publish(going_on)  # the tokens read: before the streams end
                        return
                    self._handle(command)
                finished = False
                if self.engine.has_unfinished_requests():
                    self.engine.launch()
                    self._publish(going_on)  # the loop writes them while this thread waits on the device
                    updated = self.engine.read()
                    ended = [request for request in updated if request.finished]
                    finished, going_on = bool(ended), [request for request in updated if not request.finished]
                    self._publish(ended)  # at once: a closed-loop client's next request must not wait a step
        except BaseException as error:  # a failed step (e.g. a CUDA error) ends every request
            logger.exception("the engine thread failed")
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
            commands.append(self._commands.get_nowait())
        return commands

    def _handle(self, command) -> None:
        if isinstance(command, _Submit):
            self._accept(command)
        elif isinstance(command, _Abort):
            running = self._running.pop(command.stream.request_id, None)
            if running is not None:
                self.engine.abort(running.request)
                running.stream.deliver(RequestDelta("", [], error="aborted"))

    def _accept(self, submit: _Submit) -> None:
        """``add_request`` for a submission, then settle its acceptance future."""
        loop = submit.stream.loop
        waiting = len(self._running) - self.engine.max_batch  # requests already without a slot
        if self.max_queue is not None and waiting >= self.max_queue:
            error = QueueFullError(f"too many requests: {len(self._running)} are unfinished, {self.engine.max_batch} "
                                   f"run at once and at most {self.max_queue} may wait; retry later")
            _call_in_loop(loop, _settle, submit.accepted, error)
            return
        try:
            request = self.engine.add_request(submit.prompt_token_ids, submit.params,
                                              request_id=submit.stream.request_id, prompt=submit.prompt,
                                              detokenizer=submit.detokenizer)
        except Exception as error:  # ValueError / TypeError: a bad request; anything else fails it alone
            _call_in_loop(loop, _settle, submit.accepted, error)
            return
        request.metrics.arrival_time = submit.submitted  # TTFT from the server's submission, not the engine's pickup
        self._running[request.request_id] = _Running(request, submit.stream)
        _call_in_loop(loop, _settle, submit.accepted, None)

    def _publish(self, updated: list[Request]) -> None:
        """One ``RequestDelta`` to the stream of each of ``updated`` (requests that got tokens in a
        step) that is still running here, all handed to each event loop at once
        (``RequestStream.deliver_all``)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestDelta]]] = {}
        for request in updated:
            running = self._running.get(request.request_id)
            if running is None or running.request is not request:
                continue
            new_ids = request.output_token_ids[running.published_tokens:]
            running.published_tokens = len(request.output_token_ids)
            text = request.take_new_text()
            if request.finished:
                del self._running[request.request_id]
                delta = RequestDelta(text, new_ids, request.finish_reason.value, request.output())
            else:
                delta = RequestDelta(text, new_ids)
            by_loop.setdefault(running.stream.loop, []).append((running.stream, delta))
        for loop, deltas in by_loop.items():
            RequestStream.deliver_all(loop, deltas)

    def _close(self, reason: str) -> None:
        """The engine thread's exit: take no more commands, refuse the submissions still queued,
        end every unfinished request's stream with ``reason`` and, unless the engine failed,
        abort those requests and read the step still in flight, so the engine is left empty."""
        with self._accepting_lock:
            self._accepting = False
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, _Submit):
                _call_in_loop(command.stream.loop, _settle, command.accepted, EngineUnavailableError(reason))
        running, self._running = list(self._running.values()), {}
        for record in running:
            record.stream.deliver(RequestDelta("", [], error=reason))
        if self.failure is not None:  # a failed engine is not touched again
            return
        try:
            for record in running:
                self.engine.abort(record.request)
            while self.engine.has_unfinished_requests():
                self.engine.step()  # only reads the decode step in flight: nothing runs any more
        except Exception:
            logger.exception("the engine failed while its requests were being aborted")
