"""The HTTP server: OpenAI's routes over an engine client, on aiohttp.

``run_server`` (``fuselm serve``) runs the engine in a process of its own
(``fuselm.serve.engine_process.EngineProcess``); ``build_app`` over a loaded ``ServedModel`` alone
runs it on a thread of the server's process (``fuselm.serve.async_engine.AsyncEngine``: tests,
embedding). The routes see the same ``EngineClient`` either way.

    GET  /health               200 while the engine runs, else 503
    GET  /version              {"version": fuselm's}
    GET  /v1/models            the served model, in OpenAI's list format
    GET  /v1/models/{model}    the served model (404 for another name)
    POST /v1/completions       a prompt's completion; "stream": true for server-sent events
    POST /v1/chat/completions  the assistant's reply to "messages"; "stream" likewise
    POST /v1/responses         OpenAI's Responses API over the chat path (``fuselm.serve.responses``)
    POST /tokenize             vLLM's: the token ids of a prompt, or of messages as chat renders them
    POST /detokenize           vLLM's: the text of token ids
    GET  /metrics              Prometheus' scrape: vLLM's metrics, named fuselm:* (``fuselm.serve.metrics``)

Request fields and answer shapes: ``fuselm.serve.protocol``. Every error is OpenAI's error JSON
with its HTTP status: 400 a bad field (named in ``param``), 401 a missing or wrong API key (a
server started with keys checks them on the /v1 routes, as vLLM's ``--api-key``), 404 an unknown
model, 503 a full queue or an engine that is not running, 500 a bug. A request is checked (prompt tokenized,
SamplingParams built, ``Engine.add_request`` run by the engine loop) before anything of its
answer is sent, so a bad request is a 400 even when streamed.

A client that goes away has its request aborted, which frees its engine slot: the server runs
with aiohttp's ``handler_cancellation`` (a closed connection cancels its handler) and a failed
write ends a stream; either way the handler's ``finally`` sends ``EngineClient.abort``.

Lifecycle: the engine takes requests from the app's start (``on_startup``); on shutdown
(``run_server``: SIGINT or SIGTERM) the listening sockets close first, then ``on_shutdown`` aborts
every unfinished request (streams end with an error event, waiting answers with a 503) and stops
the engine (its thread or process).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import hashlib
import hmac
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aiohttp import web

import fuselm
from fuselm.engine.engine import Engine
from fuselm.engine.request import SamplingParams
from fuselm.serve.async_engine import (ADMISSION_WAIT_S, AsyncEngine, EngineClient, EngineUnavailableError,
                                       RequestStream)
from fuselm.serve.cors import CorsPolicy
from fuselm.serve.engine_process import EngineProcess, EngineSpec, gc_recorder
from fuselm.serve.metrics import ServerMetrics, metrics_available
from fuselm.serve.protocol import (APIError, ChatFormat, CompletionFormat, GenerationRequest, Prompt, ResponseFormat,
                                   bad_request, check_model, check_reply_parsers, detokenize_response, echo_of,
                                   in_batch, model_card, model_list, parse_chat_request, parse_completion_request,
                                   token_usage, tokenize_response)
from fuselm.serve.responses import ResponsesFormat, chat_body_of, responses_error
from fuselm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 2**20
"""Largest request body taken (aiohttp's default, 1 MiB, is short for long prompts)."""


@dataclass
class ServedModel:
    """What a server serves: the ``engine`` (None on the HTTP side of an engine process), its
    ``name`` (the ``model`` of requests and answers), the ``tokenizer`` (None: token-id prompts
    only; ``no_tokenizer_reason`` says why in errors), the sampling defaults of requests
    (``default_params``: the checkpoint's generation_config), the checkpoint directory it
    came from (``model_dir``; None: random weights) and the parsers of chat replies
    (``reasoning_parser``, ``tool_call_parser``: ``fuselm.serve.reply_parser``'s names, or None)."""

    name: str
    engine: Engine | None
    tokenizer: Tokenizer | None
    default_params: SamplingParams
    no_tokenizer_reason: str = ""
    model_dir: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self):
        check_reply_parsers(self.reasoning_parser, self.tool_call_parser)

    @classmethod
    def from_llm(cls, llm, name: str | None = None) -> ServedModel:
        """An ``LLM``'s engine and tokenizer (its structured outputs' vocabulary tables built now,
        ~1.5 s at Qwen3.5's vocabulary, not when a first request stalls the running ones); name:
        default the checkpoint directory's name."""
        try:
            llm.engine.grammars.warm_up()
        except ValueError as error:  # (llguidance missing, no eos id: constrained requests get a 400 naming it)
            logger.warning("structured outputs unavailable: %s", error)
        return cls(name or Path(llm.model_dir).resolve().name, llm.engine, llm.tokenizer,
                   llm.get_default_sampling_params(), model_dir=str(llm.model_dir))

    @classmethod
    def load(cls, model_dir: str | None = None, config: str | None = None, *, name: str | None = None,
             **options) -> ServedModel:
        """A checkpoint directory (``LLM(model_dir, **options)``: options are LLM's, engine
        options included) or, with ``config``, ``random(config, **options)``: what ``fuselm
        serve`` builds (in its engine process)."""
        if (model_dir is None) == (config is None):
            raise ValueError("expected exactly one of model_dir (a checkpoint) and config (random weights)")
        if config is not None:
            return cls.random(config, name=name, **options)
        from fuselm.engine.llm import LLM

        return cls.from_llm(LLM(model_dir, **options), name)

    @classmethod
    def from_engine_info(cls, info: dict) -> ServedModel:
        """The HTTP side of an engine process's model (``EngineProcess.info``): no engine, the
        tokenizer loaded again from the checkpoint directory."""
        tokenizer = None if info["model_dir"] is None else Tokenizer.from_pretrained(info["model_dir"])
        return cls(info["name"], None, tokenizer, info["default_params"], info["no_tokenizer_reason"],
                   info["model_dir"])

    @classmethod
    def random(cls, config_name: str, *, dtype, device, max_batch: int, max_len: int, seed: int | None = None,
               name: str | None = None, max_prefill_tokens: int | None = None,
               kv_cache_tokens: int | None = None, state_dtype: str = "float32") -> ServedModel:
        """Seeded random weights of the preset ``config_name`` (``presets.PRESETS``; weights from
        ``seed``, default 0), without a tokenizer; name: default ``config_name``."""
        from fuselm.models.qwen35.presets import preset_config, random_qwen35

        model = random_qwen35(preset_config(config_name), dtype=dtype, device=device, seed=seed or 0)
        engine = Engine(model, max_batch=max_batch, max_len=max_len, seed=seed, max_prefill_tokens=max_prefill_tokens,
                        kv_cache_tokens=kv_cache_tokens, state_dtype=state_dtype)
        return cls(name or config_name, engine, None,
                   SamplingParams(), f"random weights of --config {config_name}")


async def _json_body(request: web.Request) -> dict:
    """The request's body as a JSON object (APIError 400 otherwise)."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _off_loop(function, *args):
    """``function(*args)`` on a thread of the loop's default executor: a request's tokenizing and
    chat template (pure CPU work: ~9 s for a 10 MB prompt) would otherwise hold the event loop's
    thread, and with it every other client's stream."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(function, *args))


async def _send_event(response: web.StreamResponse, data: dict | str, named: bool = False) -> None:
    """One server-sent event ``data: <json>`` (or ``data: [DONE]``), after ``event: <its type>``
    when ``named``."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    event = f"event: {data['type']}\n" if named and isinstance(data, dict) else ""
    await response.write(f"{event}data: {text}\n\n".encode())


class OpenAIServer:
    """The routes' handlers over one ``ServedModel`` and the ``EngineClient`` (``engine``) that
    runs its requests."""

    def __init__(self, model: ServedModel, engine: EngineClient):
        self.model = model
        self.engine = engine
        self.created = int(time.time())

    # ------------------------------------------------------------------------ lifecycle
    async def on_startup(self, app: web.Application) -> None:
        self.engine.start()

    async def on_shutdown(self, app: web.Application) -> None:
        await self.engine.shutdown()

    # ------------------------------------------------------------------------ routes
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.alive:
            return web.Response(status=200)
        raise APIError(503, "the engine is not running")

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus' scrape (``fuselm.serve.metrics``)."""
        if self.engine.metrics is None:
            raise APIError(404, "no metrics: this server runs without prometheus_client (pip install "
                                "prometheus_client)")
        return web.Response(body=self.engine.metrics.render(),
                            headers={"Content-Type": ServerMetrics.CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self.model.name, self.created, self.engine.max_len))

    async def retrieve_model(self, request: web.Request) -> web.Response:
        check_model({"model": request.match_info["model"]}, self.model.name)
        return web.json_response(model_card(self.model.name, self.created, self.engine.max_len))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": fuselm.__version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        check_model(body, self.model.name)
        return web.json_response(await _off_loop(tokenize_response, body, self.model.tokenizer,
                                                 self.engine.max_len, self.model.no_tokenizer_reason))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        check_model(body, self.model.name)
        return web.json_response(await _off_loop(detokenize_response, body, self.model.tokenizer,
                                                 self.model.no_tokenizer_reason))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        check_model(body, self.model.name)
        generation = await _off_loop(parse_completion_request, body, self.model.tokenizer,
                                     self.model.default_params, self.engine.max_len, self.model.no_tokenizer_reason)
        return await self._generate(request, generation, CompletionFormat)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        check_model(body, self.model.name)
        generation = await _off_loop(parse_chat_request, body, self.model.tokenizer, self.model.default_params,
                                     self.engine.max_len, self.model.no_tokenizer_reason, self.model.reasoning_parser,
                                     self.model.tool_call_parser)
        return await self._generate(request, generation, ChatFormat)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API over the chat path (``fuselm.serve.responses``)."""
        body = await _json_body(request)
        check_model(body, self.model.name)
        try:
            generation = await _off_loop(parse_chat_request, chat_body_of(body), self.model.tokenizer,
                                         self.model.default_params, self.engine.max_len,
                                         self.model.no_tokenizer_reason, self.model.reasoning_parser,
                                         self.model.tool_call_parser)
        except APIError as error:
            raise responses_error(error) from None
        generation = dataclasses.replace(generation, prompt_field="input", max_tokens_field="max_output_tokens")
        return await self._generate(request, generation, ResponsesFormat, body=body)

    # ------------------------------------------------------------------------ generation
    async def _generate(self, request: web.Request, generation: GenerationRequest,
                        format_class: type[ResponseFormat], **format_options) -> web.StreamResponse:
        """Submit a checked request to the engine, one engine request per sequence (n for each
        prompt; choice p n + i is prompt p's sequence i), and answer it, whole or streamed, in
        ``format_class`` (``for_request`` takes ``format_options``). Whatever ends the handler
        early (the client gone, an error, one sequence refused) aborts every sequence."""
        request_id = format_class.id_prefix + uuid.uuid4().hex
        sequences = [(index, prompt, params) for index, prompt in enumerate(generation.prompts)
                     for params in prompt.params.samples()]
        capacity = self.engine.max_requests
        if capacity is not None and len(sequences) > capacity:
            n = generation.prompts[0].params.n
            raise bad_request(f"{len(generation.prompts)} prompt(s) x n = {n} are {len(sequences)} sequences, each an "
                              f"engine request, and this server holds {capacity} at most (max batch + max queue)",
                              "n" if n > 1 else generation.prompt_field)
        ids = [request_id] if len(sequences) == 1 else [f"{request_id}-{index}" for index in range(len(sequences))]
        # A prompt's first sequence's id: its others share its prefill (Engine.add_request).
        first_of = {}
        for (index, _, _), sequence_id in zip(sequences, ids):
            first_of.setdefault(index, sequence_id)
        # All at once: the engine loop takes commands in order, so the sequences start together.
        submissions = [asyncio.ensure_future(self.engine.submit(
            prompt.token_ids, params, request_id=sequence_id, prompt=prompt.text,
            grammar_starts_after=generation.grammar_starts_after,
            shares_prefill_with=None if first_of[index] == sequence_id else first_of[index]))
            for (index, prompt, params), sequence_id in zip(sequences, ids)]
        try:
            submitted = await asyncio.gather(*submissions, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away: the pending ones abort themselves
            for submission in submissions:
                if submission.done() and not submission.cancelled() and submission.exception() is None:
                    self.engine.abort(submission.result())
            raise
        streams = [stream for stream in submitted if isinstance(stream, RequestStream)]
        try:
            failed = next((k for k, outcome in enumerate(submitted) if isinstance(outcome, BaseException)), None)
            error = None if failed is None else submitted[failed]
            if isinstance(error, EngineUnavailableError):
                raise APIError(503, str(error)) from None
            if isinstance(error, (ValueError, TypeError)):  # Engine.add_request's checks
                raise in_batch(bad_request(str(error), generation.param_of(error)), sequences[failed][0],
                               len(generation.prompts)) from None
            if error is not None:
                raise error
            answer = format_class.for_request(request_id, self.model.name, generation, self.model.tokenizer,
                                              **format_options)
            prompts = [prompt for _, prompt, _ in sequences]
            if generation.stream:
                return await self._stream(request, streams, answer, generation, prompts)
            return await self._collect(streams, answer, generation, prompts)
        finally:
            for stream in streams:
                self.engine.abort(stream)  # nothing to do when it finished

    async def _collect(self, streams: list[RequestStream], answer: ResponseFormat, generation: GenerationRequest,
                       prompts: list[Prompt]) -> web.Response:
        """The whole answer, once every sequence has finished (sequence i of prompt ``prompts[i]``)."""
        last = [None] * len(streams)
        async with contextlib.aclosing(_deltas(streams)) as deltas:
            async for index, delta in deltas:
                last[index] = delta
        cut = next((delta.error for delta in last if delta.error is not None), None)
        if cut is not None:
            raise APIError(503, f"the request was cut short: {cut}")
        completions = [delta.output.outputs[0] for delta in last]
        echoes = [echo_of(generation, prompt, delta.output.prompt_logprobs, self.model.tokenizer)
                  for prompt, delta in zip(prompts, last)]
        choices = [answer.choice(index, completion.text or "", completion.token_ids, completion.finish_reason,
                                 completion.stop_reason, completion.logprobs, echo)
                   for index, (completion, echo) in enumerate(zip(completions, echoes))]
        usage = token_usage(generation.prompt_tokens, sum(len(c.token_ids) for c in completions))
        response = answer.response(choices, usage)
        if generation.prompt_logprobs is not None:  # a prompt's first sequence computed them for its others
            by_prompt = {id(prompt): delta.output.prompt_logprobs for prompt, delta in zip(prompts, last)
                         if delta.output.prompt_logprobs is not None}
            response = answer.with_prompt_logprobs(response, [by_prompt.get(id(prompt)) for prompt in prompts],
                                                   generation.prompt_logprobs)
        return web.json_response(response)

    async def _stream(self, request: web.Request, streams: list[RequestStream], answer: ResponseFormat,
                      generation: GenerationRequest, prompts: list[Prompt]) -> web.StreamResponse:
        """Server-sent events: the format's chunks of each step that made a sequence's text final
        (and of its last one, with the finish_reason), the sequences' interleaved as they come, each
        with its choice index; then its closing chunks (chat and completions: the usage chunk when
        asked for, then ``[DONE]``). A request cut short ends with the format's error event
        (OpenAI's error JSON), then its closing chunks for a stream cut short."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        echoed, named, cut = set(), answer.named_events, False
        generated = [0] * len(streams)  # each sequence's tokens so far

        def with_usage(chunk):  # vLLM's continuous_usage_stats: a choice's chunk, its sequence's usage so far
            if generation.continuous_usage and isinstance(chunk, dict) and chunk.get("choices"):
                index = chunk["choices"][0]["index"]
                chunk["usage"] = token_usage(len(prompts[index].token_ids), generated[index])
            return chunk

        try:
            for chunk in answer.first_chunks(len(streams)):
                await _send_event(response, with_usage(chunk), named)
            async with contextlib.aclosing(_deltas(streams)) as deltas:
                async for index, delta in deltas:
                    if delta.error is not None:
                        error = APIError(503, f"the request was cut short: {delta.error}")
                        await _send_event(response, answer.error_chunk(error), named)
                        cut = True
                        break
                    generated[index] += len(delta.token_ids)
                    echo = None  # the prompt, before a sequence's first text (echo)
                    if index not in echoed:
                        echoed.add(index)
                        echo = echo_of(generation, prompts[index], delta.prompt_logprobs, self.model.tokenizer)
                    if delta.text or delta.last or answer.return_token_ids or delta.logprobs or echo is not None:
                        stop_reason = None if delta.output is None else delta.output.outputs[0].stop_reason
                        for chunk in answer.chunks(index, delta.text, delta.token_ids, delta.finish_reason,
                                                   stop_reason, delta.logprobs, echo):
                            await _send_event(response, with_usage(chunk), named)
            usage = token_usage(generation.prompt_tokens, sum(generated))
            for chunk in answer.closing_chunks(usage, generation.include_usage, cut):
                await _send_event(response, chunk, named)
            await response.write_eof()
        except ConnectionResetError:  # the client went away; _generate aborts the request
            pass
        return response


async def _deltas(streams: list[RequestStream]):
    """(index, delta) for the deltas of ``streams`` (a request's sequences) as they come, each
    stream's in order, until every stream has given its last."""
    if len(streams) == 1:  # (the common case: no task per request)
        async for delta in streams[0]:
            yield 0, delta
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, stream: RequestStream) -> None:
        async for delta in stream:
            merged.put_nowait((index, delta))

    tasks = [asyncio.create_task(forward(index, stream)) for index, stream in enumerate(streams)]
    try:
        unfinished = len(streams)
        while unfinished:
            index, delta = await merged.get()
            unfinished -= delta.last
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()


SERVER = web.AppKey("fuselm_server", OpenAIServer)
"""``app[SERVER]``: the ``OpenAIServer`` behind an app of ``build_app``."""


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """APIError -> its status and OpenAI's error JSON; any other exception -> a 500 of the same
    shape (logged). The request fails alone: the engine and the other requests go on."""
    try:
        return await handler(request)
    except APIError as error:
        return web.json_response(error.body, status=error.status)
    except web.HTTPException as error:  # aiohttp's: 404 no such route, 405 wrong method, 413 too large
        if error.status < 400:
            raise
        headers = {name: value for name, value in error.headers.items() if name.lower() == "allow"}
        return web.json_response(APIError(error.status, f"{error.reason}: {request.method} {request.path}"
                                          + (f" ({error.text})" if error.status == 413 else "")).body,
                                 status=error.status, headers=headers)
    except Exception as error:
        logger.exception("request %s %s failed", request.method, request.path)
        return web.json_response(APIError(500, f"internal error: {error!r}").body, status=500)


def check_api_keys(api_keys: Sequence[str]) -> list[str]:
    """``api_keys`` as a list; ValueError naming the argument unless each is a non-blank string."""
    if any(not isinstance(key, str) or not key.strip() for key in api_keys):
        raise ValueError("api_keys: expected non-empty strings")
    return list(api_keys)


def _api_key_check(api_keys: Sequence[str]):
    """A middleware that answers 401 (OpenAI's error JSON) to a request under /v1 whose
    ``Authorization`` header is not ``Bearer <one of api_keys>`` (vLLM's ``--api-key``: /health,
    /tokenize and /detokenize stay open). Keys are compared by their SHA-256 digests in constant
    time, every key every time."""
    digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1") and request.method != "OPTIONS":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            digest = hashlib.sha256(token.strip().encode()).digest()
            matched = False
            for known in digests:
                matched |= hmac.compare_digest(digest, known)
            if scheme.lower() != "bearer" or not matched:
                raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                                    "with a key the server was started with (--api-key)")
        return await handler(request)

    return check


def build_app(model: ServedModel, engine: EngineClient | None = None, max_queue: int | None = None,
              admission_wait: float = ADMISSION_WAIT_S, api_keys: Sequence[str] = (),
              cors: CorsPolicy | None = CorsPolicy()) -> web.Application:
    """The aiohttp application serving ``model`` (routes: module docstring) through ``engine``
    (default: an ``AsyncEngine`` over ``model.engine`` on a thread of this process, holding at
    most ``max_queue`` waiting requests and waiting ``admission_wait`` s for a closed-loop
    client's next request); ``app[SERVER]`` is its ``OpenAIServer``. With ``api_keys``, requests
    under /v1 must bring one (``Authorization: Bearer <key>``; 401 otherwise). ``cors``: the
    cross-origin requests browsers may make (``fuselm.serve.cors``; default vLLM's: any origin,
    no credentials; None: no CORS headers). Run it with
    ``handler_cancellation=True`` so that a client that goes away has its request aborted
    (``run_server`` does)."""
    check_api_keys(api_keys)
    if engine is None:
        engine = AsyncEngine(model.engine, tokenizer=model.tokenizer, max_queue=max_queue,
                             admission_wait=admission_wait)
    if metrics_available():
        engine.metrics = ServerMetrics(model.name, engine.max_len)
    else:
        logger.warning("prometheus_client is not installed: the server runs without /metrics")
    server = OpenAIServer(model, engine)
    middlewares = [_openai_errors] + ([_api_key_check(api_keys)] if api_keys else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_REQUEST_BYTES)
    if cors is not None:
        cors.install(app)
    app[SERVER] = server
    app.add_routes([web.get("/health", server.health), web.get("/version", server.version),
                    web.get("/v1/models", server.models), web.get("/v1/models/{model}", server.retrieve_model),
                    web.post("/v1/completions", server.completions),
                    web.post("/v1/chat/completions", server.chat_completions),
                    web.post("/v1/responses", server.responses),
                    web.post("/tokenize", server.tokenize), web.post("/detokenize", server.detokenize),
                    web.get("/metrics", server.metrics)])
    app.on_startup.append(server.on_startup)
    app.on_shutdown.append(server.on_shutdown)
    return app


def run_server(spec: EngineSpec, host: str = "127.0.0.1", port: int = 8000, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None, api_keys: Sequence[str] = (),
               cors: CorsPolicy | None = CorsPolicy()) -> None:
    """Serve what ``spec`` builds on ``host:port`` until SIGINT or SIGTERM, then shut down
    cleanly (stop listening, abort unfinished requests, stop the engine process) and return. The
    engine runs in a process of its own (``EngineProcess``); this one only speaks HTTP, and parses
    chat replies with ``reasoning_parser`` and ``tool_call_parser`` (``ServedModel``'s).
    ``api_keys``, ``cors``: as ``build_app``'s."""
    check_reply_parsers(reasoning_parser, tool_call_parser)
    check_api_keys(api_keys)  # (before the engine process starts)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = EngineProcess(spec)
    info = engine.launch()
    http_pauses: list[dict] = []  # this process's garbage collections, for the step log
    if spec.step_log is not None:
        gc.callbacks.append(gc_recorder(http_pauses))
    try:
        model = dataclasses.replace(ServedModel.from_engine_info(info), reasoning_parser=reasoning_parser,
                                    tool_call_parser=tool_call_parser)
        print(f"fuselm serve: {model.name} (max_batch {info['max_batch']}, max_len {info['max_len']}, "
              f"{'text and token-id prompts' if model.tokenizer is not None else 'token-id prompts only'}; "
              f"engine process {engine.process.pid})", file=sys.stderr, flush=True)
        gc.collect()
        gc.freeze()  # the objects loaded at start-up stay out of the collections
        web.run_app(build_app(model, engine, api_keys=api_keys, cors=cors), host=host, port=port,
                    handler_cancellation=True,
                    print=lambda message: print(message, file=sys.stderr, flush=True))
    finally:
        engine.stop()  # (when serving never began or ended abnormally; after a shutdown, nothing)
        if spec.step_log is not None:  # after the engine process's steps, written on its way out
            with open(spec.step_log, "a") as handle:
                handle.writelines(json.dumps({**pause, "process": "http"}) + "\n" for pause in http_pauses)


def serve_spec(model_dir: str | None = None, config: str | None = None, *, max_queue: int | None = None,
               admission_wait: float = ADMISSION_WAIT_S, step_log: str | None = None, stall_dump: str | None = None,
               stall_dump_s: float = 0.01, stall_dump_wait_s: float | None = None, **options) -> EngineSpec:
    """The ``EngineSpec`` of ``ServedModel.load(model_dir, config, **options)`` (``fuselm serve``'s
    options; the other arguments: ``EngineSpec``'s)."""
    return EngineSpec(functools.partial(ServedModel.load, model_dir, config, **options), max_queue=max_queue,
                      admission_wait=admission_wait, step_log=step_log, stall_dump=stall_dump,
                      stall_dump_s=stall_dump_s, stall_dump_wait_s=stall_dump_wait_s)
