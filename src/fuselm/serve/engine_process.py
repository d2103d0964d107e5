"""``EngineProcess``: the serving engine loop in a process of its own (what ``fuselm serve`` runs).

Why a process. In one process the HTTP side (the event loop parsing requests, tokenizing and
writing every stream's chunks) and the engine thread share one GIL: each torch call of the
engine thread's host work releases it and must take it back, and an event loop busy with 32
streams makes it wait a switch interval each time; on some machines that held the GPU idle for
10-40 ms at a time (benchmarks/NOTES.md 89, 90). vLLM's V1 engine core and SGLang's scheduler run
apart from their HTTP servers likewise.

How. ``launch()`` spawns the child (a fresh interpreter, so the server process never initializes
CUDA), which builds its ``ServedModel`` from ``EngineSpec.build`` (weights, tokenizer, CUDA graphs
of the mixed steps), answers ``("ready", info)`` or ``("failed", error)``, and then runs an
``EngineLoop`` on a thread of its own (its main thread stays free for the SIGALRM handler of
``--stall-dump``). Commands and answers (``fuselm.serve.async_engine``'s) go over one duplex pipe
(``multiprocessing.Pipe``: length-prefixed pickles over a Unix socket pair), one message per
publish; detokenizing and stop strings stay in the child, whose host work hides behind the GPU.
The server reads the answers in its event loop (``add_reader`` on the pipe), with no thread.

Lifecycle. The child ignores SIGINT and SIGTERM: the server's handling of them shuts it down in
order (``Stop``; the child ends every stream, answers "closed", reads the step in flight, writes
its step log and exits). It also stops when the pipe closes (the server died). The server learns
of a dead child from the pipe's end: every unfinished request ends with an error, new ones get
``EngineUnavailableError`` (HTTP 503), and ``alive`` (``/health``) turns False.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from fuselm.serve.async_engine import (ADMISSION_WAIT_S, EngineClient, EngineLoop, EngineUnavailableError, Stop,
                                       check_admission_wait, check_max_queue)

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0  # how long a stopping child may take before it is killed


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process runs.

    Args:
        build: a picklable callable (a module-level function, or ``functools.partial`` of one)
            returning the ``ServedModel`` to serve; runs in the child.
        max_queue, admission_wait: ``EngineLoop``'s.
        step_log: write the engine's step log (JSON lines, garbage collections included) here
            when the child exits (``fuselm serve --step-log``).
        stall_dump: write every thread's stack here whenever the host work between two steps
            passes ``stall_dump_s`` (or a step's wait ``stall_dump_wait_s``):
            ``Engine.watch_host_stalls``.
    """

    build: Callable
    max_queue: int | None = None
    admission_wait: float = ADMISSION_WAIT_S
    step_log: str | None = None
    stall_dump: str | None = None
    stall_dump_s: float = 0.01
    stall_dump_wait_s: float | None = None

    def __post_init__(self):
        check_max_queue(self.max_queue)
        check_admission_wait(self.admission_wait)


class EngineProcess(EngineClient):
    """The ``EngineLoop`` of ``spec`` in a child process (module docstring): ``launch()`` (blocks
    until the model is loaded), then in the event loop ``start()``, ``submit`` / ``abort``,
    ``shutdown()``. ``info``: what the child reported when ready (name, max_batch, max_len,
    default_params, no_tokenizer_reason, model_dir)."""

    def __init__(self, spec: EngineSpec):
        super().__init__()
        self.spec = spec
        self.info: dict | None = None
        self._process = None
        self._pipe = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_len(self) -> int:
        return self.info["max_len"]

    @property
    def max_requests(self) -> int | None:
        return None if self.spec.max_queue is None else self.info["max_batch"] + self.spec.max_queue

    @property
    def process(self) -> multiprocessing.process.BaseProcess | None:
        return self._process

    @property
    def alive(self) -> bool:
        return self._accepting and self._process is not None and self._process.is_alive()

    def launch(self) -> dict:
        """Spawn the child and wait until it has built its model; returns ``info``. Raises what
        the build raised (e.g. ValueError naming a bad option), or RuntimeError when the child
        died first."""
        if self._process is not None:
            raise RuntimeError("launch: the engine process was launched already")
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe(duplex=True)
        self._process = context.Process(target=_child_main, args=(self.spec, child_end), name="fuselm-engine")
        # The child starts with SIGALRM blocked (a signal mask outlives fork and exec), so that the
        # threads its imports start block it too (``_child_main``).
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        child_end.close()  # the child holds the only other end: its exit reads as EOF here
        try:
            while not self._pipe.poll(0.2):
                if not self._process.is_alive():
                    raise RuntimeError(f"the engine process exited while starting (exit code "
                                       f"{self._process.exitcode})")
            kind, payload = self._pipe.recv()
        except BaseException:
            self.stop()
            raise
        if kind == "failed":
            self._process.join(SHUTDOWN_TIMEOUT_S)
            raise payload
        self.info = payload
        return payload

    def start(self) -> None:
        """Take requests: the child's answers are read in the running event loop."""
        if self.info is None:
            raise RuntimeError("start: launch() the engine process first")
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._pipe.fileno(), self._read_answers)
        self._accepting = True

    def _send(self, command) -> bool:
        try:
            self._pipe.send(command)
            return True
        except (OSError, ValueError):  # the child is gone (broken pipe) or the pipe closed
            return False

    def _read_answers(self) -> None:
        """Hand every answer waiting in the pipe to ``_receive``; at its end (the child exited
        or died), end everything."""
        try:
            while self._pipe.poll():
                self._receive(self._pipe.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(self._pipe.fileno())
            if self._closed_reason is None:  # no "closed" came first: it died
                logger.error("the engine process ended unexpectedly (exit code %s)", self._process.exitcode)
            self._end(self._closed_reason or "the engine process ended")

    async def shutdown(self) -> None:
        """Abort every unfinished request (their streams end with an error delta), stop the child
        and wait for it to exit (killed past ``SHUTDOWN_TIMEOUT_S``)."""
        if self._process is None:
            return
        if self._process.is_alive():
            self._send(Stop())
            await asyncio.to_thread(self._process.join, SHUTDOWN_TIMEOUT_S)
        if self._loop is not None and not self._pipe.closed:
            self._read_answers()  # what came with the exit ("closed" last), then EOF
        self.stop()
        self._end("the engine was shut down")

    def stop(self) -> None:
        """Stop the child now if it still runs (a start-up that failed, a stop that hung, a server
        that never served: ``shutdown`` outside an event loop); close the pipe."""
        if self._process is None:
            return
        if self._process.is_alive():
            self._send(Stop())
            self._process.join(5.0)
        if self._process.is_alive():
            logger.error("the engine process did not stop: killing it")
            self._process.kill()
            self._process.join()
        if self._loop is not None and not self._pipe.closed:
            try:
                self._loop.remove_reader(self._pipe.fileno())
            except (ValueError, RuntimeError):  # (the event loop has closed)
                pass
        self._pipe.close()


# ============================================================================ the child
class _PipeCommands:
    """The child's end of the pipe as ``EngineLoop``'s command queue; its end (the server gone)
    reads as ``Stop``."""

    def __init__(self, pipe):
        self._pipe = pipe
        self._ended = False

    def get(self, timeout: float | None = None):
        if self._ended:
            return Stop()
        if not self._pipe.poll(timeout):
            raise queue.Empty
        try:
            return self._pipe.recv()
        except (EOFError, OSError):
            self._ended = True
            return Stop()

    def empty(self) -> bool:
        return self._ended or not self._pipe.poll()


def _portable(error: BaseException) -> BaseException:
    """``error`` as the server process can unpickle it: the types a client handles (ValueError,
    TypeError, EngineUnavailableError) as they are, any other as a RuntimeError naming it."""
    if type(error) in (ValueError, TypeError) or isinstance(error, EngineUnavailableError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")


def gc_recorder(pauses: list[dict]):
    """A ``gc.callbacks`` hook appending each garbage collection to ``pauses`` as a step-log entry
    {"kind": "gc", "generation", "began", "read"} (the step log's clock), so that
    benchmarks/step_log.py can tell a collection that stalled the engine from other host work."""
    began = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            pauses.append({"kind": "gc", "generation": info["generation"], "began": began.pop(),
                           "read": time.perf_counter()})
    return record


def _child_main(spec: EngineSpec, pipe) -> None:
    """The engine process: build, report, run the engine loop until Stop or the pipe's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops it in order (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The stall timer's SIGALRM must land on the main thread, which waits for the engine thread's
    # end: landing on another thread it would only flag its handler, to run once the main thread
    # runs bytecode again (after the join). So the process starts with it blocked (``launch``),
    # every thread (torch's at import, the driver's, the engine's) inherits that, and the main
    # thread unblocks it once they are up.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pauses: list[dict] = []
    stall_dump = None
    try:
        model = spec.build()
        engine = model.engine
        began = time.perf_counter()
        captured = engine.capture_mixed_graphs()
        if captured:
            print(f"fuselm serve: {captured} mixed prefill + decode graphs captured in "
                  f"{time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        if spec.step_log is not None:
            engine.step_log = []
            gc.callbacks.append(gc_recorder(pauses))
        if spec.stall_dump is not None:
            stall_dump = open(spec.stall_dump, "w")
            # (interrupting the main thread's wait for the engine thread: the dumps are written there)
            engine.watch_host_stalls(stall_dump, spec.stall_dump_s, spec.stall_dump_wait_s,
                                     interrupt_system_calls=True)
        # A full garbage collection walking the objects loaded at start-up would stall a step.
        gc.collect()
        gc.freeze()
    except BaseException as error:
        pipe.send(("failed", _portable(error)))
        pipe.close()
        return
    pipe.send(("ready", {"name": model.name, "max_batch": engine.max_batch, "max_len": engine.max_request_tokens,
                         "default_params": model.default_params, "no_tokenizer_reason": model.no_tokenizer_reason,
                         "model_dir": model.model_dir}))

    def answer(message: tuple) -> None:
        if message[0] == "accepted" and message[2] is not None:
            message = (message[0], message[1], _portable(message[2]))
        try:
            pipe.send(message)
        except OSError:  # the server is gone: the loop stops at the pipe's end
            pass

    loop = EngineLoop(engine, _PipeCommands(pipe), answer, tokenizer=model.tokenizer, max_queue=spec.max_queue,
                      admission_wait=spec.admission_wait)
    thread = threading.Thread(target=loop.run, name="fuselm-engine")
    thread.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})  # (see the top)
    thread.join()
    if stall_dump is not None:
        engine.watch_host_stalls(None, None)
        stall_dump.close()
    if spec.step_log is not None:
        with open(spec.step_log, "w") as handle:
            handle.writelines(json.dumps(entry) + "\n" for entry in engine.step_log + pauses)
    pipe.close()
