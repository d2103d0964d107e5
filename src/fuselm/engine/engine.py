"""Engine: the generation loop. request -> scheduler -> runner, each calling only the next's
public methods (nano-vllm's shape).

    engine = Engine(model, max_batch=8, max_len=4096)         # captures the decode graphs (CUDA)
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32, temperature=0))
    outputs[0].outputs[0].token_ids

One ``step()``: the scheduler admits waiting requests into free slots and picks the prompt
tokens to prefill, up to ``max_prefill_tokens`` less the step's decode rows (a long prompt in
chunks over several steps; a first token comes from the logits of a prompt's last chunk). With
requests decoding, the runner runs those chunks and their decode step as one mixed pass (the
chunks share its norms, input projections, MLP GEMMs and LM head: measured 19.4 ms for 32 rows
+ 480 tokens against a 9.4 ms decode step, H100, benchmarks/results/.../mixed_step.md);
with none, it prefills and then decodes the just-prefilled requests. That is ``launch()``; then
``read()`` reads the launches of the step before (a mixed pass's first ids too), then a
prefill-only step's first ids (behind its decode step). Decode is pipelined one step deep: step
n+1 is on the GPU while the host appends step n's ids, detokenizes and checks stop conditions, so
the host's work hides behind the GPU's (and a caller's own, between ``launch`` and ``read``). A
request that ends on the host (a stop string) is one step late on the device; that extra step
writes only its own slot and is discarded. Stop ids and max_tokens also end a slot on the device,
inside the step.

Requests join and leave between steps: each owns a cache slot for its life, a finished request's
slot is freed for the next waiting one, and requests already decoding go on untouched. The
running requests hold the decode batch's first rows (the runner's row -> slot table, rewritten
between steps when one leaves), so the step runs the smallest graph that covers them.
"""

from __future__ import annotations

import itertools
import logging
import random
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Sequence

import torch

from fuselm.engine.request import (FinishReason, Logprob, Request, RequestOutput, SamplingParams, TokenLogprobs,
                                   is_token_ids, params_per_prompt, samples_output)
from fuselm.engine.runner import DEFAULT_GRAPH_BATCH_SIZES, ModelRunner
from fuselm.engine.sampling import MAX_DEVICE_STOP_IDS, sampler_variant
from fuselm.engine.scheduler import MIN_SHARED_PREFILL_TOKENS, Scheduler
from fuselm.engine.structured_outputs import GrammarCompiler
from fuselm.engine.token_masks import (TokenMasks, allowed_bitmask, bad_words_token_ids, banned_by_bad_words,
                                       bitmask_words, fill_bans)
from fuselm.models.qwen35 import Qwen35
from fuselm.models.qwen35.cache import PAGE_SIZE
from fuselm.ops.sampling import token_logprobs
from fuselm.runtime import PinnedStaging, check_positive_int

logger = logging.getLogger(__name__)


def thread_usage() -> list[float] | None:
    """The calling thread's use so far, for the step log: [CPU s, minor page faults, voluntary
    context switches, involuntary ones] (``time.thread_time``: exact, where getrusage's times
    lag by up to a scheduler tick; the counts from ``getrusage(RUSAGE_THREAD)``; None where the
    platform has no per-thread counts). Over a slow host span they tell what held the thread up:
    its own work (CPU time ~ the span), the kernel's on its behalf (page faults: e.g. direct
    memory compaction), waiting on a lock such as the GIL (voluntary switches, little CPU) or
    other threads taking its core (involuntary switches)."""
    if not hasattr(resource, "RUSAGE_THREAD"):
        return None
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return [time.thread_time(), usage.ru_minflt, usage.ru_nvcsw, usage.ru_nivcsw]


def _queue_to_host(tensors, allocate, timed: bool = False) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Copies of device ``tensors`` into host tensors from ``allocate(shape, dtype)`` (pinned
    memory), queued without waiting, and an event recorded behind them (``timed``: with timing);
    off CUDA, clones and no event."""
    if not tensors[0].is_cuda:
        return [t.clone() for t in tensors], None
    host = [allocate(t.shape, t.dtype) for t in tensors]
    for destination, t in zip(host, tensors):
        destination.copy_(t, non_blocking=True)
    done = torch.cuda.Event(enable_timing=timed)
    done.record()
    return host, done


class _Launched:
    """Ids on the GPU (a decode step's per row, or a prefill's first ids per completed request)
    on their way to pinned host memory (this step's ``staging`` buffer), and which request each
    index belonged to at launch (a request's row may change before they are read). When one of
    those requests asks for log-probabilities (``SamplingParams.logprobs``), those of every index
    (``fuselm.ops.sampling.token_logprobs`` of the ``logits`` the ids were drawn from: two launches
    behind the step's) travel with them."""

    def __init__(self, ids: torch.Tensor, requests: dict[int, Request], staging: PinnedStaging, timed: bool = False,
                 logits: torch.Tensor | None = None):
        self.requests = dict(requests)
        self.taken = False  # read and appended (``Engine._read``: once)
        self.staging, self.step = staging, staging.steps
        asked = [r.params.logprobs for r in self.requests.values() if r.params.logprobs is not None]
        device = [ids] + (list(token_logprobs(logits, ids, max(asked))) if asked else [])
        self.host, self.done = _queue_to_host(device, staging.host, timed)  # timed: the step log's GPU time

    def read(self) -> tuple[list[int], list | None]:
        """(the ids, and None or the log-probabilities: (logprob, rank, top logprobs, top ids) lists
        by index), once the device has written them."""
        if self.done is not None:
            if self.staging.steps - self.step >= self.staging.depth:  # the engine reads each launch a step later
                raise RuntimeError(f"ids of step {self.step} read at step {self.staging.steps}: their pinned buffer "
                                   "was reused")
            self.done.synchronize()
        values = [t.tolist() for t in self.host]
        return values[0], values[1:] or None


class _PromptLogprobs:
    """A prompt's log-probabilities (``ModelRunner.prompt_logprobs``) on their way to pinned host
    memory of their own (its request may wait many steps for a slot: the steps' staging buffers
    come back sooner), read when the request's first token is (by then long written)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.host, self.done = _queue_to_host(
            tensors, lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))

    def entries(self, prompt_token_ids: list[int], num_top: int) -> list[TokenLogprobs | None]:
        """None for the first token, then each later one's ``TokenLogprobs``."""
        if self.done is not None:
            self.done.synchronize()
        values = [t.tolist() for t in self.host]
        return [None] + [_token_logprobs(token, index, values, num_top)
                         for index, token in enumerate(prompt_token_ids[1:])]


def _token_logprobs(token: int, index: int, logprobs: list, num_top: int) -> TokenLogprobs:
    """Index ``index``'s ``TokenLogprobs`` from a launch's log-probabilities (``_Launched.read``):
    the drawn ``token`` first, then the ``num_top`` most likely."""
    logprob, rank, top, top_ids = (values[index] for values in logprobs)
    entry = {token: Logprob(logprob, rank)}
    for position, (top_id, top_logprob) in enumerate(zip(top_ids[:num_top], top[:num_top])):
        entry.setdefault(top_id, Logprob(top_logprob, position + 1))
    return entry


class Engine:
    """Continuous-batching generation for a ``Qwen35`` model.

    Args:
        model: a loaded ``Qwen35``.
        max_batch: requests running at once (cache slots); more wait in a queue.
        max_len: tokens per request (prompt + generated).
        graph_batch_sizes: decode graphs to capture (clipped to max_batch, which is added).
        max_prefill_tokens: tokens of one step, the decode rows included as in vLLM's
            max_num_batched_tokens (default: max_batch * max_len; prompt tokens get at least
            ``scheduler.MIN_PREFILL_TOKENS`` of it): a longer prompt is prefilled in chunks over
            several steps, each in one pass with a decode step of the running requests, so one
            long prompt cannot stall them: the budget bounds how much longer than a decode step
            such a step takes.
        kv_cache_tokens: attention K/V positions the cache holds, in pages of ``page_size``
            tokens (a power of two >= 16; default: max_batch * max_len, every slot's whole context). A request takes pages
            for its prompt + max_tokens when it starts and returns them when it ends; with fewer
            pages than that default, requests wait for pages as for slots.
        seed: seeds the seeds drawn for requests that bring none (None: fresh entropy).
        use_graphs: capture CUDA graphs (default: when the model is on CUDA).
        state_dtype: the Gated DeltaNet recurrent states' dtype in the cache (a torch dtype or its
            name): float32 (default: HF's numerics) or bfloat16 / float16 (vLLM's default, its
            ``--mamba-ssm-cache-dtype auto``): every kernel still computes in fp32, each step's new
            state is rounded once into the cache; half the state bytes a decode step moves (9B,
            batch 32: 1.6 of 3.2 GB).
        tokenizer: a ``fuselm.tokenizer.Tokenizer`` for requests with ``structured_outputs``
            (their grammars are compiled over its vocabulary) or ``bad_words`` (encoded with it);
            ``LLM`` and the server give theirs.

    Token masks (structured outputs, allowed_token_ids, bad_words; ``engine.token_masks``): a
    step that draws for a masked request reads the step before's ids as soon as its forward pass
    is queued (not after the step's launches) when a grammar or a bad word needs them, advances
    those requests' grammars, writes the bitmasks while the device runs the forward, and masks
    the logits before the draw (decode steps then run their forward and their draw as two
    graphs). The device stays busy while that host work is shorter than a forward pass.
    """

    def __init__(self, model: Qwen35, max_batch: int = 8, max_len: int = 4096,
                 graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES, *,
                 max_prefill_tokens: int | None = None, kv_cache_tokens: int | None = None,
                 page_size: int = PAGE_SIZE, seed: int | None = None, use_graphs: bool | None = None,
                 state_dtype: torch.dtype | str = torch.float32, tokenizer=None):
        if kv_cache_tokens is not None:
            check_positive_int("kv_cache_tokens", kv_cache_tokens)
        num_pages = None if kv_cache_tokens is None else -(-kv_cache_tokens // max(1, page_size))
        self.runner = ModelRunner(model, max_batch, max_len, graph_batch_sizes, use_graphs, num_pages, page_size,
                                  state_dtype)
        cache = self.runner.cache
        self.scheduler = Scheduler(max_batch, max_prefill_tokens or max_batch * max_len, cache.num_pages,
                                   cache.page_size)
        self.model = model
        # Set to a list to record each step (``launch()`` and ``read()``: what it launched, when its
        # host work began, when its launches were done, and when it had read the step before's ids:
        # the gaps between "read" times are the steps' durations as a decoding request sees them;
        # the engine thread's CPU use at launch and read; with CUDA, "gpu_ms": its GPU time, from
        # an event queued just before its launches to its last launch's); ``fuselm serve
        # --step-log``.
        self.step_log: list[dict] | None = None
        # ``watch_host_stalls``: (file, seconds, the SIGALRM handler before); steps so far and the
        # thread that runs them, for its dumps.
        self._stall_watch: tuple | None = None
        self._steps = 0
        self._stepping_thread: int | None = None
        # What the stall timer watches: (phase, step, since when, seconds), and what it watched
        # before (a signal raised in one phase may be handled in the next).
        self._watched = self._watched_before = ("span", 0, 0.0, None)
        self.vocab_size = model.config.vocab_size
        self.eos_ids = model.config.stop_token_ids
        self.tokenizer = tokenizer
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, self.vocab_size, self.eos_ids)
        self._read_ahead: list[Request] = []  # requests a launch's token masks read early, for the next read()
        self._seeds = random.Random(seed)
        self._ids = itertools.count()
        self._in_flight: list[_Launched] = []  # the last step's launches, read in the next step
        self._launched: tuple | None = None  # ``launch()``'s, until its ``read()``
        self._timing: list[tuple] = []  # (step-log entry, start event, end event) until the end has run

    @property
    def max_batch(self) -> int:
        return self.runner.max_batch

    def watch_host_stalls(self, file, seconds: float | None, wait_seconds: float | None = None, *,
                          interrupt_system_calls: bool = False) -> None:
        """While requests run, write every thread's Python stack to ``file`` (an open text file)
        whenever the host's work between two steps, from reading one step's ids to the next step's
        launches, takes longer than ``seconds`` (None: stop watching), and, with ``wait_seconds``,
        whenever a ``read`` (its wait for the step before, then appending its ids) ends longer
        than that after the launches before it. A real-time timer armed and disarmed at each read
        and launch (``setitimer`` calls, no extra thread) raises SIGALRM; its handler, on the main
        thread, writes the stacks: where the stalled engine thread is, and what the other threads
        were doing (``fuselm serve --stall-dump``; benchmarks/stall_dump.py groups them). Call it
        from the main thread (it installs the SIGALRM handler; stopping restores the one before).
        ``interrupt_system_calls``: a system call the signal lands in fails with EINTR instead of
        resuming, so that the handler runs at once where the main thread only waits (a thread's
        join: with SA_RESTART the kernel would resume the wait and the handler run after it)."""
        for name, value in (("seconds", seconds), ("wait_seconds", wait_seconds)):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name}: expected None or a positive number, got {value!r}")
        if not hasattr(signal, "setitimer"):
            raise RuntimeError("watch_host_stalls: this platform has no setitimer")
        if self._stall_watch is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._stall_watch[-1])
            self._stall_watch = None
        if seconds is not None:
            previous = signal.signal(signal.SIGALRM, self._dump_stacks)  # ValueError off the main thread
            signal.siginterrupt(signal.SIGALRM, interrupt_system_calls)
            self._stall_watch = (file, float(seconds), None if wait_seconds is None else float(wait_seconds),
                                 signal.SIG_DFL if previous is None else previous)

    def _watch(self, phase: str, armed: bool = True) -> None:
        """Arm the stall timer for ``phase``: "span" (the host's work from a read to the next
        launches) or "wait" (from the launches to the read); its threshold from
        ``watch_host_stalls`` (none, or not ``armed``: disarm it)."""
        watch = self._stall_watch  # (None if the main thread stopped the watching meanwhile)
        if watch is None:
            return
        _, span_seconds, wait_seconds, _ = watch
        seconds = (span_seconds if phase == "span" else wait_seconds) if armed else None
        self._stepping_thread = threading.get_ident()
        self._watched_before, self._watched = self._watched, (phase, self._steps, time.perf_counter(), seconds)
        signal.setitimer(signal.ITIMER_REAL, seconds or 0)

    def _dump_stacks(self, signum, frame) -> None:
        """The SIGALRM handler of ``watch_host_stalls`` (on the main thread, between two of its
        bytecodes): every thread's stack, innermost frame first, in faulthandler's layout; the
        threads named by ident but for the main one and the engine's (``threading.enumerate``
        takes a lock the interrupted thread may hold), no source lines read. A failure to write
        stops the watching rather than raise into the interrupted code."""
        watch = self._stall_watch
        if watch is None:
            return
        try:
            file, now = watch[0], time.perf_counter()
            phase, step, began, seconds = self._watched
            if seconds is None or now - began < seconds:  # raised in the phase before, handled in this one
                phase, step, began, seconds = self._watched_before
            where = f"the host's span after step {step}" if phase == "span" else f"the wait for step {step}"
            lines = [f"Stall ({(now - began) * 1e3:.1f} ms into {where}, watched at {(seconds or 0) * 1e3:g} ms):"]
            stacks = sys._current_frames()
            stacks[threading.get_ident()] = frame  # this thread's, where the signal interrupted it
            main = threading.main_thread().ident
            for ident, top in stacks.items():
                name = "MainThread" if ident == main else hex(ident)
                engine = " (engine)" if ident == self._stepping_thread else ""
                lines.append(f"Thread {name}{engine} (most recent call first):")
                lines += [f'  File "{f.filename}", line {f.lineno} in {f.name}'
                          for f in traceback.StackSummary.extract(traceback.walk_stack(top), lookup_lines=False)]
            file.write("\n".join(lines) + "\n\n")
            file.flush()
        except Exception:  # (e.g. a full disk) the stall is the caller's business, not the code this interrupted
            self._stall_watch = None
            signal.setitimer(signal.ITIMER_REAL, 0)
            logger.exception("watch_host_stalls: writing the stacks failed; no longer watching")

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    @property
    def max_request_tokens(self) -> int:
        """Tokens one request may hold (prompt + output): ``max_len``, or the K/V cache's whole
        capacity where ``kv_cache_tokens`` holds fewer (a request takes its pages when it starts)."""
        cache = self.runner.cache
        return min(self.max_len, cache.num_pages * cache.page_size)

    # ------------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, prompt: str | None = None, detokenizer=None,
                    grammar_starts_after: int | None = None, shares_prefill_with: Request | None = None) -> Request:
        """Queue one request; ValueError/TypeError naming the argument when it cannot run (the
        engine and every other request are left as they were). ``grammar_starts_after``: with
        ``params.structured_outputs``, a token id before which the output is free (a reasoning
        model's end-of-thinking id: the grammar constrains the answer). ``shares_prefill_with``:
        an unfinished request of this engine with the same prompt (another sample of it) whose
        prefill this one copies (``scheduler``'s prefill sharing) when the prompt has more than
        ``MIN_SHARED_PREFILL_TOKENS`` tokens and that request has not yet prefilled past its last
        but one; else this one prefills its prompt itself (the same tokens in fp32 either way;
        in 16 bits its last token's chunk of one rounds otherwise, as any chunking does)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"n: a request draws one sequence (n = 1), got n = {params.n}: add_requests, generate "
                             f"and LLM queue one request per sample (SamplingParams.samples)")
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise TypeError(f"prompt_token_ids: expected a list of token ids, got {type(prompt_token_ids).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: empty prompt (0 tokens); every request needs at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids: token ids must be ints in [0, {self.vocab_size}) (vocab_size)")
        if params.truncate_prompt_tokens is not None:  # (vLLM's: the last k tokens; -1: the context's length)
            keep = self.max_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if keep > self.max_len:
                raise ValueError(f"truncate_prompt_tokens: {keep} is more than max_len = {self.max_len}")
            ids = ids[-keep:]
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in max_len = {self.max_len} "
                             f"(prompt + max_tokens must fit)")
        if len(ids) + params.max_tokens > self.max_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"max_len = {self.max_len}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad} are not in [0, {self.vocab_size}) (vocab_size)")
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:10]} are not in [0, {self.vocab_size}) (vocab_size)")
        bad = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids: token ids {bad[:10]} are not in [0, {self.vocab_size}) (vocab_size)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this engine has no tokenizer to encode them with (Engine(..., tokenizer=...); "
                             "LLM and the server give theirs)")
        stop_ids = tuple(dict.fromkeys(list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))))
        if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= set(stop_ids):
            raise ValueError("allowed_token_ids: every allowed id is a stop id, and min_tokens bans those: nothing "
                             "could be drawn")
        if params.min_tokens and len(stop_ids) > MAX_DEVICE_STOP_IDS:  # the device bans the ones it holds
            raise ValueError(f"min_tokens: a request with min_tokens may have {MAX_DEVICE_STOP_IDS} stop ids at most "
                             f"(stop_token_ids and the model's eos ids), got {len(stop_ids)}")
        request = Request(str(next(self._ids)) if request_id is None else request_id, ids, params,
                          self._seeds.getrandbits(63) if params.seed is None else params.seed, stop_ids,
                          prompt=prompt, detokenizer=detokenizer)
        pages, cache = self.scheduler.pages_needed(request), self.runner.cache
        if pages > cache.num_pages:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {params.max_tokens} need {pages} K/V "
                             f"pages of {cache.page_size} tokens; the cache has {cache.num_pages} (kv_cache_tokens)")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this engine has no tokenizer to compile grammars over "
                                 "(Engine(..., tokenizer=...); LLM and the server give theirs)")
            request.grammar = self.grammars.compile(params.structured_outputs, grammar_starts_after)
        if params.allowed_token_ids:
            request.allowed_mask = allowed_bitmask(params.allowed_token_ids, self.vocab_size)
        if params.bad_words:
            request.bad_words_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        if params.prompt_logprobs is not None:  # queued now on the device, read with the first token
            request.pending_prompt_logprobs = _PromptLogprobs(self.runner.prompt_logprobs(ids, params.prompt_logprobs))
        source = shares_prefill_with
        if (source is not None and not source.finished and source.prompt_token_ids == ids
                and len(ids) > MIN_SHARED_PREFILL_TOKENS and source.num_prompt_computed < len(ids) - 1
                and (self.scheduler.holds(source) or source in self.scheduler.waiting)):
            request.shares_prefill_with = source
        self.scheduler.add(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def num_waiting_requests(self) -> int:
        """Requests queued for a slot (not yet admitted)."""
        return len(self.scheduler.waiting)

    def num_running_requests(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return self.scheduler.rows_in_use()

    def kv_cache_usage(self) -> float:
        """The fraction of the attention K/V pages requests hold (a request takes its prompt +
        max_tokens pages when it starts)."""
        num_pages = self.runner.cache.num_pages
        return (num_pages - self.scheduler.free_pages) / num_pages

    def abort(self, request: Request) -> None:
        """End a request now (its slot is freed; an in-flight step's ids for it are dropped)."""
        if not request.finished:
            request.finish_reason, request.stop_reason = FinishReason.STOP, None
            self._finish(request)
        if self._stall_watch is not None and not self.has_unfinished_requests():
            signal.setitimer(signal.ITIMER_REAL, 0)  # no step follows: the host's span ends here

    # ------------------------------------------------------------------------ the loop
    def _finish(self, request: Request) -> None:
        request.metrics.finished_time = time.perf_counter()
        if self.scheduler.holds(request):
            self.runner.release([request.slot])
        self.scheduler.finish(request)  # (the next launch gives the runner the rows it leaves)

    def _append(self, request: Request, token: int, now: float, logprobs: TokenLogprobs | None = None,
                refused: bool = False) -> None:
        """One new token of a running request (and its ``logprobs`` when the request asks for
        them): record it, detokenize, check stop conditions in vLLM's order (stop ids, stop
        strings, length; then a complete grammar) and end the request when one holds. A stop id's
        text is left out, as vLLM leaves it, unless ``include_stop_str_in_output``. ``refused``:
        the request's grammar (which ``_read`` advanced by the token) could not take it."""
        request.output_token_ids.append(token)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
            if request.pending_prompt_logprobs is not None:
                request.prompt_logprobs = request.pending_prompt_logprobs.entries(request.prompt_token_ids,
                                                                                  request.params.prompt_logprobs)
                request.pending_prompt_logprobs = None
        grammar = request.grammar
        if refused:  # (the draw was masked: not expected)
            logger.warning("request %s: its grammar refused token %d (%s); ending it", request.request_id, token,
                           grammar.error)
        # (before min_tokens no stop id is drawn: the sampler bans them; the detokenizer's stop strings wait too)
        if token in request.stop_ids and len(request.output_token_ids) >= request.params.min_tokens:
            # stop_reason: the id when the request asked for it (vLLM: None at eos)
            request.finish_reason = FinishReason.STOP
            request.stop_reason = token if token in request.params.stop_token_ids else None
            if request.detokenizer is not None and request.params.include_stop_str_in_output:
                request._new_text.append(request.detokenizer.feed(token))  # (its text; none when special and skipped)
        else:
            detokenizer = request.detokenizer
            if detokenizer is not None:
                request._new_text.append(detokenizer.feed(token))
            if detokenizer is not None and detokenizer.stopped:
                request.finish_reason, request.stop_reason = FinishReason.STOP, detokenizer.stop_reason
            elif len(request.output_token_ids) >= request.params.max_tokens:
                request.finish_reason = FinishReason.LENGTH
            elif refused or (grammar is not None and grammar.complete and not self._eos_stops(request)):
                # (a complete grammar allows only the eos ids: drawn next, they end the request, unless it ignores them)
                request.finish_reason, request.stop_reason = FinishReason.STOP, None
        if request.finished:
            if request.detokenizer is not None:
                request._new_text.append(request.detokenizer.flush())
            self._finish(request)

    def _eos_stops(self, request: Request) -> bool:
        return any(token in request.stop_ids for token in self.eos_ids)

    def _read(self, launched: _Launched) -> list[Request]:
        """Append a finished decode step's ids to the requests that were running in it (once:
        nothing when it was read already)."""
        if launched.taken:
            return []
        launched.taken = True
        (ids, logprobs), now = launched.read(), time.perf_counter()
        running = [(index, request) for index, request in launched.requests.items() if not request.finished]
        constrained = [(index, request) for index, request in running if request.grammar is not None]
        refused = set()
        if constrained:  # the grammars advance together (on llguidance's threads)
            verdicts = self.grammars.accept_tokens([(request.grammar, ids[index]) for index, request in constrained])
            refused = {index for (index, _), verdict in zip(constrained, verdicts) if not verdict}
        for index, request in running:
            entry = None if request.params.logprobs is None else _token_logprobs(ids[index], index, logprobs,
                                                                                request.params.logprobs)
            self._append(request, ids[index], now, entry, refused=index in refused)
        return [request for _, request in running]

    def step(self) -> list[Request]:
        """``launch()`` this step, then ``read()`` the one before: returns the requests that got a
        token (finished ones included)."""
        self.launch()
        return self.read()

    def launch(self) -> None:
        """Queue this step on the device, reading nothing: prefill its prompt chunks (the
        scheduler's budget) and decode the requests whose prompts were in before it, in one mixed
        pass when there are both (a prompt the pass completes draws its first id in the decode
        rows' draw and decodes from the next step on; its id is read with theirs a step later, so
        the host never waits for a mixed pass with nothing queued behind it), else a prefill and
        then a decode step that takes in the just-completed prompts (their first ids read at once,
        behind that decode step). Each ``launch`` is followed by one ``read``; between the two the
        caller may do host work of its own while the device runs (a server: stream the tokens of
        the step before), without delaying this step. An engine whose ``launch`` or ``read``
        raised is not stepped again (a device error leaves its state unknown)."""
        if self._launched is not None:
            raise RuntimeError("launch: the step launched before has not been read (call read())")
        began = time.perf_counter()
        staging = self.runner.staging
        staging.next_step()
        forked = self.scheduler.admit_sharers()  # (requests admitted with a copy of a prefix: made below)
        decoding = self.scheduler.decoding()
        # The budget less the decode rows this step will run (the decode batch covers the row a
        # newly admitted request takes: mixed graphs are keyed by it, captured up front).
        decode_rows = self.runner.batch_size_for(self.scheduler.rows_in_use_after_admission()) if decoding else 0
        plan = self.scheduler.schedule_prefill(decode_rows)
        self.runner.set_rows(self.scheduler.row_slots())  # rows left and taken since the last launch
        self.runner.share_prefill(forked)
        mixed = bool(plan and decoding)
        pending, prefilled = [], None
        # The step log's GPU time of a step: from an event queued just before its launches to its
        # last launch's (from the later of the step before's end and this point: with the device
        # idle, the host's launches count too).
        timed = self.step_log is not None and self.runner.device.type == "cuda"
        if timed:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        completing = [request for request, start, count in plan if request.completes_prompt(start, count)]
        if mixed:
            # The prompts this pass completes draw their first ids with its decode rows (in their rows).
            running = {**decoding, **{request.row: request for request in completing}}
            logits, ids = self.runner.mixed(plan, *self._decode_shape(decoding, completing),
                                            masks=self._token_masks(running))
            pending.append(_Launched(ids, running, staging, timed, logits))
        elif plan:
            completed, logits, first = self.runner.prefill(plan, masks=self._token_masks(dict(enumerate(completing))))
            prefilled = _Launched(first, dict(enumerate(completed)), staging, timed, logits)
        for request, _, count in plan:
            self.scheduler.prefilled(request, count)
        if not mixed:
            decoding = self.scheduler.decoding()
            if decoding:
                masks = self._token_masks(decoding, [] if prefilled is None else [prefilled])
                logits, ids = self.runner.decode(*self._decode_shape(decoding), masks=masks)
                pending.append(_Launched(ids, decoding, staging, timed, logits))
        if self._stall_watch is not None:  # the host's span between steps ends at the launches; the wait begins
            self._watch("wait")
        entry = None
        if self.step_log is not None:
            kind = "mixed" if mixed else "prefill+decode" if plan and decoding else "prefill" if plan else \
                "decode" if decoding else "idle"
            # running / waiting: requests holding a slot / queued for one once this step was planned;
            # admission_waits_ms: how long each request this step admitted had waited for it;
            # usage_launched / usage_read: the engine thread's ``thread_usage`` at launched / read.
            entry = {"began": began, "launched": time.perf_counter(), "kind": kind,
                     "decode_rows": len(decoding), "chunks": len(plan),
                     "prompt_tokens": sum(count for _, _, count in plan),
                     "running": self.scheduler.rows_in_use(), "waiting": len(self.scheduler.waiting),
                     "admission_waits_ms": [round(1e3 * (began - request.metrics.arrival_time), 3)
                                            for request, start, _ in plan if start == 0],
                     "usage_launched": thread_usage()}
            last = (pending or [prefilled])[-1]
            if timed and last is not None:
                self._timing.append((entry, started, last.done))
        self._launched = (pending, prefilled, entry)

    def read(self) -> list[Request]:
        """Read the launches of the step before the one ``launch()`` queued (waiting for them), and
        a prefill-only step's first ids: append the ids to their requests (detokenize, check stop
        conditions, end the finished ones). Returns the requests that got a token (finished ones
        included)."""
        if self._launched is None:
            raise RuntimeError("read: no step was launched (call launch() first)")
        (pending, prefilled, entry), self._launched = self._launched, None
        updated, self._read_ahead = self._read_ahead, []
        for launched in self._in_flight:
            updated += self._read(launched)
        if prefilled is not None:
            updated += self._read(prefilled)
        # A launch whose requests all ended meanwhile is dropped unread.
        self._in_flight = [launched for launched in pending
                           if any(not request.finished for request in launched.requests.values())]
        if entry is not None:
            # finished: requests this read ended (a closed-loop client's next request follows each)
            entry.update(read=time.perf_counter(), usage_read=thread_usage(),
                         finished=sum(request.finished for request in updated))
            self.step_log.append(entry)
            # gpu_ms: each step's GPU time (CUDA events), once its last launch has run.
            while self._timing and self._timing[0][2].query():
                logged, started, done = self._timing.pop(0)
                logged["gpu_ms"] = round(started.elapsed_time(done), 4)
        self._steps += 1
        if self._stall_watch is not None:  # from this read to the next launches, if one follows
            self._watch("span", armed=self.has_unfinished_requests())
        return updated

    def _token_masks(self, drawing: dict[int, Request], unread: Sequence[_Launched] = ()) -> Callable | None:
        """For a draw over ``drawing`` (row -> request) holding masked requests (``Request.masked``):
        the function the runner calls once the step's forward pass is queued. When a grammar or a
        bad word of several tokens needs the tokens drawn so far, it first reads the launches not
        yet read (the step before's, and ``unread``) and appends their ids (``_append``); it
        returns the draw's ``TokenMasks`` (bitmasks in this step's pinned memory). None without
        masked requests."""
        masked = {row: request for row, request in drawing.items() if request.masked}
        if not masked:
            return None
        words = bitmask_words(self.vocab_size)

        def masks() -> TokenMasks:
            if any(request.grammar is not None or any(len(sequence) > 1 for sequence in request.bad_words_ids)
                   for request in masked.values()):
                for launched in list(self._in_flight) + list(unread):
                    self._read_ahead += self._read(launched)
                self._in_flight = []
            live = {row: request for row, request in masked.items() if not request.finished}
            grammar_rows = [row for row, request in live.items()
                            if request.grammar is not None and request.grammar.constrains]
            grammar = self.runner.staging.host((len(grammar_rows), words), torch.int32)
            if grammar_rows:
                self.grammars.fill_bitmasks([live[row].grammar for row in grammar_rows], grammar)
            bans = []  # (row, allowed, banned)
            for row, request in live.items():
                banned = banned_by_bad_words(request.bad_words_ids, request.output_token_ids)
                if request.allowed_mask is not None or banned:
                    bans.append((row, request.allowed_mask, banned))
            ban_mask = self.runner.staging.host((len(bans), words), torch.int32)
            for (_, allowed, banned), ban_row in zip(bans, ban_mask):
                fill_bans(ban_row, allowed, banned)
            raw_logprobs = any(live[row].params.logprobs is not None for row, _, _ in bans)
            return TokenMasks(grammar_rows, grammar, [row for row, _, _ in bans], ban_mask, raw_logprobs)

        return masks

    def capture_mixed_graphs(self) -> int:
        """Capture, before any request runs, the mixed prefill + decode graphs that one prompt
        chunk beside a decode step uses under this engine's token budget (``ModelRunner.
        capture_mixed_graphs``: otherwise each is captured on first use, stalling the running
        requests). Returns how many were captured (0 without graphs)."""
        if self.has_unfinished_requests():
            raise RuntimeError("capture_mixed_graphs: the engine has requests; call it before adding any")
        return self.runner.capture_mixed_graphs({b: self.scheduler.prompt_budget(b) for b in self.runner.batch_sizes})

    def _decode_shape(self, decoding: dict[int, Request], drawing: Sequence[Request] = ()) -> tuple[int, str]:
        """(decode batch size, sampler variant) of a step over the ``decoding`` requests (and
        ``drawing``: requests drawing their first id in it): the smallest graph covering the rows
        in use, the variant their sampling settings allow."""
        return (self.runner.batch_size_for(self.scheduler.rows_in_use()),
                sampler_variant(list(decoding.values()) + list(drawing)))

    def add_requests(self, prompts: Sequence[dict],
                     detokenizer: Callable[[list[int], SamplingParams], object] | None = None) -> list[list[Request]]:
        """Queue several prompts, each given as ``add_request``'s keyword arguments, all or none:
        when one is refused, none of them stays queued and the error names it as ``prompts[i]``.
        A prompt whose params ask for n > 1 sequences is n requests (``SamplingParams.samples``;
        request ids "<id>-<i>" when an id is given), which share its prefill
        (``shares_prefill_with``). ``detokenizer(prompt_token_ids, params)`` builds each
        request's detokenizer. Returns each prompt's requests."""
        added: list[list[Request]] = []
        try:
            for arguments in prompts:
                added.append([])
                params = arguments.get("params")  # (add_request checks its type)
                samples = params.samples() if isinstance(params, SamplingParams) else [params]
                request_id = arguments.get("request_id")
                for index, sample in enumerate(samples):
                    sample_id = request_id if request_id is None or len(samples) == 1 else f"{request_id}-{index}"
                    made = {} if detokenizer is None else {
                        "detokenizer": detokenizer(list(arguments["prompt_token_ids"]), sample)}
                    if index:  # the samples of a prompt share its prefill (Scheduler)
                        made["shares_prefill_with"] = added[-1][0]
                    added[-1].append(self.add_request(**{**arguments, **made, "params": sample,
                                                         "request_id": sample_id}))
        except (ValueError, TypeError) as error:
            for request in (r for group in added for r in group):
                self.abort(request)
            raise type(error)(f"prompts[{len(added) - 1}]: {error}") from None
        return added

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 stream: Callable[[Request], None] | None = None) -> list[RequestOutput]:
        """Run token-id prompts to the end; one ``RequestOutput`` per prompt, in order.

        prompts: a list of token-id lists (or one list of ints, or an int tensor [B, T] / [T]);
        params: one ``SamplingParams`` for all, or one per prompt; stream: called with each
        request that got tokens, after every step. Every prompt is checked before any runs."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts: expected a non-empty list of token-id lists, got {prompts!r}")
        if is_token_ids(prompts):
            prompts = [prompts]
        params_list = params_per_prompt(params, len(prompts))
        groups = self.add_requests([{"prompt_token_ids": prompt, "params": request_params}
                                    for prompt, request_params in zip(prompts, params_list)])
        self.run(stream)
        return [samples_output(group) for group in groups]

    def run(self, stream: Callable[[Request], None] | None = None) -> None:
        """Step until every queued request has finished."""
        while self.has_unfinished_requests():
            for request in self.step():
                if stream is not None:
                    stream(request)
