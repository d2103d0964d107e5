"""``fuselm bench-serve URL``: a load generator for an OpenAI-compatible server, in the shape of
vLLM's ``vllm bench serve`` (random or ShareGPT dataset, arrival process, client-side metrics, report).

    fuselm bench-serve http://127.0.0.1:8000 --num-prompts 200 --random-input-len 512 \\
        --random-output-len 256 --request-rate 8 --max-concurrency 32 --goodput ttft:500 tpot:50 --out DIR

What is sent. ``num_prompts`` requests of the random dataset (``random_requests``; or of a ShareGPT
file, ``sharegpt_requests``: text prompts, vLLM's sample of them): prompt and
output lengths drawn uniformly among the integers in [len * (1 - r), len * (1 + r)], prompts of
random ordinary token ids (``seed``). ``backend='openai'`` posts each to /v1/completions with the
prompt as a list of ids (its length is exact and the server needs no tokenizer);
``backend='openai-chat'`` posts to /v1/chat/completions one user message, the text a tokenizer
decodes from the ids. Every request is streamed with ``stream_options.include_usage``,
``ignore_eos`` and ``max_tokens`` = its output length, so that it generates exactly that many
tokens.

When (``arrival_times``). Request i is due at the i-th event of a gamma renewal process: gaps of
shape ``burstiness`` B and mean 1 / ``request_rate`` (B = 1: a Poisson process, B < 1 burstier,
B > 1 more regular; rate inf: all at once). A request then waits for one of ``max_concurrency``
slots (a client-side semaphore) and is sent. ``warmup_requests`` go first, all at once under the
same limit, and count nowhere.

What is measured (client clock, ``time.perf_counter``; the definitions of vLLM's benchmark):

    TTFT    time to first token: from sending the request to the first stream chunk with content
    ITL     inter-token latency: the gap between two successive content chunks (a server that
            streams k tokens per chunk gives one ITL per chunk, covering k tokens)
    TPOT    time per output token, first token excluded: (E2EL - TTFT) / (output tokens - 1), one
            value per request with more than one output token
    E2EL    end-to-end latency: from sending the request to the end of its stream
    output tokens   the final usage chunk's ``completion_tokens`` (without one: the content chunks)
    goodput completed requests per second that meet every SLO given (ms: TTFT, TPOT, E2EL at most
            the value; a one-token request meets any TPOT SLO)

Throughputs divide by the duration, from the first request due to the last one finished (warm-up
excluded): completed requests/s, output tokens/s, input + output tokens/s (input tokens: the
server's ``usage.prompt_tokens``, else the prompt's length). A request fails on an HTTP status
other than 200, an error event in the stream, a stream without content, a connection error, or no
complete response within ``request_timeout`` seconds; it is counted with its error and left out of
every other figure. The peak of requests in flight (sent, not yet finished) is measured too.

Only ``base_url`` is contacted: GET /v1/models when no ``model`` is given, then POST ``endpoint``;
proxy settings of the environment are ignored.

Results: the vLLM-style table on stdout; with ``out``, ``<label>.json`` and ``<label>.md``
(``fuselm.bench.write_results``) and ``<label>.png`` (``plot_results``; needs matplotlib). The
JSON holds the run's settings (backend, base_url, endpoint, model, dataset, dataset_path,
sharegpt_output_len, num_prompts,
random_input_len, random_output_len, random_range_ratio, seed, request_rate ("inf" for inf),
burstiness, max_concurrency, warmup_requests, request_timeout, goodput_slos_ms, percentiles,
date), the metrics (duration [s], completed, failed, total_input_tokens, total_output_tokens,
request_throughput [req/s], request_goodput [req/s, null without SLOs], output_throughput and
total_token_throughput [tok/s], max_concurrent_requests, and for ttft, tpot, itl and e2el:
mean_X_ms, median_X_ms, std_X_ms, max_X_ms and pP_X_ms for P in the percentiles, 99 always among
them; null when nothing was measured) and per request, in dataset order: input_lens, output_lens,
ttfts, itls, latencies, start_times, queue_times (seconds; start_times from the run's start,
queue_times the wait for a concurrency slot; null for a failed request's timings) and errors
("" for success).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import tokenizers
from tqdm import tqdm

from fuselm.bench import write_results

BACKEND_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# Token ids drawn without --tokenizer: below 32000 every common vocabulary has ordinary tokens
# (special and added tokens sit at the end of the vocabulary).
DEFAULT_RANDOM_VOCAB_SIZE = 32000
SLO_METRICS = ("ttft", "tpot", "e2el")
# (key, short name, heading) of the latency metrics, in the report's order.
LATENCY_METRICS = (("ttft", "TTFT", "Time to First Token"),
                   ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                   ("itl", "ITL", "Inter-token Latency"),
                   ("e2el", "E2EL", "End-to-end Latency"))
ERROR_TEXT_LIMIT = 500  # characters of an error response kept


# ============================================================================ the random dataset
@dataclass
class BenchRequest:
    """One request of the dataset: its prompt (token ids for /v1/completions, text for chat), the
    prompt's length in tokens and the number of tokens to generate."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def load_tokenizer(path: str | Path):
    """``tokenizers.Tokenizer`` of ``path``: a checkpoint directory (its tokenizer.json) or the
    file itself. FileNotFoundError when there is none."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json")
    return tokenizers.Tokenizer.from_file(str(file))


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The ids of ``tokenizer``'s vocabulary that are not added tokens (special tokens, chat
    markers), sorted."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = np.fromiter(tokenizer.get_added_tokens_decoder(), dtype=np.int64)
    return np.setdiff1d(np.arange(vocab_size), added)


def uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> np.ndarray:
    """``count`` integers drawn uniformly among those in [length * (1 - r), length * (1 + r)]
    (r = ``range_ratio``; at least 1)."""
    low = max(1, math.ceil(length * (1 - range_ratio) - 1e-9))
    high = max(low, math.floor(length * (1 + range_ratio) + 1e-9))
    return rng.integers(low, high + 1, size=count)


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, *,
                    seed: int = 0, tokenizer=None, vocab_size: int | None = None,
                    as_text: bool = False) -> list[BenchRequest]:
    """vLLM's random dataset: ``num_prompts`` requests whose prompt and output lengths are drawn
    by ``uniform_lengths``, prompts of ids drawn uniformly (with replacement) from the
    ``tokenizer``'s ordinary ids, else from [0, ``vocab_size``) (default
    ``DEFAULT_RANDOM_VOCAB_SIZE``). ``as_text`` (needs the tokenizer): the prompt is the text it
    decodes from the ids, and its length that text's token count. Same ``seed``, same requests.
    ValueError names a bad size or ratio."""
    for name, value in (("num_prompts", num_prompts), ("random_input_len", input_len),
                        ("random_output_len", output_len)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {value}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio: expected in [0, 1), got {range_ratio}")
    if as_text and tokenizer is None:
        raise ValueError("text prompts (--backend openai-chat) need --tokenizer: the prompt is the text it decodes "
                         "from random token ids")
    if tokenizer is not None:
        candidate_ids = ordinary_token_ids(tokenizer)
    else:
        vocab_size = DEFAULT_RANDOM_VOCAB_SIZE if vocab_size is None else vocab_size
        if vocab_size < 1:
            raise ValueError(f"--random-vocab-size: expected >= 1, got {vocab_size}")
        candidate_ids = np.arange(vocab_size)
    rng = np.random.default_rng(seed)
    input_lens = uniform_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = uniform_lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for prompt_len, new_tokens in zip(input_lens.tolist(), output_lens.tolist()):
        ids = rng.choice(candidate_ids, size=prompt_len).tolist()
        if as_text:
            text = tokenizer.decode(ids)
            requests.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False).ids), new_tokens))
        else:
            requests.append(BenchRequest(ids, prompt_len, new_tokens))
    return requests


# ============================================================================ the ShareGPT dataset
# vLLM's filter of ShareGPT sequences (benchmarks' is_valid_sequence): prompt and output at least
# this many tokens, the prompt at most SHAREGPT_MAX_PROMPT_LEN, both at most SHAREGPT_MAX_TOTAL_LEN.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


def sharegpt_requests(path: str | Path, num_prompts: int, tokenizer, *, seed: int = 0,
                      output_len: int | None = None) -> list[BenchRequest]:
    """vLLM's ShareGPT dataset: of a ShareGPT JSON file (a list of {"conversations": [{"from",
    "value"}, ...]}, e.g. ShareGPT_V3_unfiltered_cleaned_split.json), the conversations of two
    turns or more, shuffled as vLLM shuffles them (``random.seed(seed)``, ``random.shuffle``);
    each gives a text prompt (its first turn; its length: the ``tokenizer``'s token count) and an
    output length (the second turn's token count, or ``output_len``); sequences outside vLLM's
    filter (``SHAREGPT_*``; the output's minimum not applied with ``output_len``) are skipped, the
    first ``num_prompts`` kept. With fewer, some are drawn again (vLLM's oversampling, seeded).
    ValueError names a bad file or size."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts: expected >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"--sharegpt-output-len: expected >= 1, got {output_len}")
    if tokenizer is None:
        raise ValueError("--dataset-name sharegpt needs --tokenizer (the prompts' and outputs' token counts)")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--dataset-path {path}: cannot read a ShareGPT JSON file ({error})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations")
    conversations = [entry["conversations"] for entry in data
                     if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
                     and len(entry["conversations"]) >= 2]
    random.Random(seed).shuffle(conversations)
    requests = []
    for turns in conversations:
        if len(requests) == num_prompts:
            break
        prompt, completion = turns[0].get("value"), turns[1].get("value")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue
        prompt_len = len(tokenizer.encode(prompt).ids)
        new_tokens = len(tokenizer.encode(completion).ids) if output_len is None else output_len
        if (prompt_len < SHAREGPT_MIN_LEN or (output_len is None and new_tokens < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + new_tokens > SHAREGPT_MAX_TOTAL_LEN):
            continue
        requests.append(BenchRequest(prompt, prompt_len, new_tokens))
    if not requests:
        raise ValueError(f"--dataset-path {path}: no conversation passes vLLM's ShareGPT filter")
    if len(requests) < num_prompts:
        requests += random.Random(seed).choices(requests, k=num_prompts - len(requests))
    return requests


# ============================================================================ arrivals
def arrival_times(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """When each of ``count`` requests is due, in seconds from the run's start: 0 for the first,
    then the cumulative sum of gaps drawn from a gamma distribution of shape B = ``burstiness``
    and scale 1 / (rate * B), so of mean 1 / ``request_rate`` and coefficient of variation
    1 / sqrt(B) (B = 1: exponential gaps, a Poisson process). Rate inf: all 0; B inf: evenly
    1 / rate apart. ValueError for a rate or burstiness not above 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate: expected > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness: expected > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(count)
    if math.isinf(burstiness):
        gaps = np.full(count - 1, 1.0 / request_rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=count - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


# ============================================================================ one request
@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds (``start_time`` from the run's start,
    ``queue_time`` waiting for a concurrency slot, ``ttft``, ``itl`` and ``latency`` (E2EL) from
    the moment it was sent). ``prompt_len``: the server's usage.prompt_tokens when it reports it."""

    prompt_len: int
    success: bool = False
    error: str = ""
    start_time: float = math.nan
    queue_time: float = math.nan
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None with one output token or none."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_payload(backend: str, model: str, request: BenchRequest) -> dict:
    """The JSON body of ``request``: streamed with the usage in a final chunk, ``ignore_eos`` and
    ``max_tokens`` = its output length (chat: ``max_completion_tokens`` too, the name newer
    servers read), and vLLM's ``return_token_ids`` (a chunk whose tokens make no text yet, e.g.
    special tokens or half a UTF-8 character, still counts as content)."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "max_tokens": request.output_len, "return_token_ids": True}
    if backend == "openai":
        return {**body, "prompt": request.prompt}
    return {**body, "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.output_len}


def chunk_content(backend: str, event: dict) -> str:
    """What one stream chunk generated, as text: ``choices[0].text`` (completions) or
    ``choices[0].delta``'s content and reasoning (chat), else its ``token_ids`` written out when
    the server returns them; '' for the chat role chunk and the usage chunk."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if backend == "openai":
        text = choice.get("text") or ""
    else:
        delta = choice.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    token_ids = choice.get("token_ids") or (choice.get("delta") or {}).get("token_ids")
    return text or (" ".join(map(str, token_ids)) if token_ids else "")


async def _read_stream(session, api_url: str, backend: str, payload: dict, result: RequestResult,
                       sent: float) -> None:
    """POST ``payload`` and time its server-sent events (``data: <json>`` lines, ``data: [DONE]``
    last) into ``result``."""
    async with session.post(api_url, json=payload) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:ERROR_TEXT_LIMIT]}"
            return
        previous_content, content_chunks, usage = None, 0, None
        async for raw_line in response.content:
            received = time.perf_counter()
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                result.error = f"error event in the stream: {json.dumps(event['error'])[:ERROR_TEXT_LIMIT]}"
                return
            if chunk_content(backend, event):
                if previous_content is None:
                    result.ttft = received - sent
                else:
                    result.itl.append(received - previous_content)
                previous_content = received
                content_chunks += 1
            usage = event.get("usage") or usage
        result.latency = time.perf_counter() - sent
    if content_chunks == 0:
        result.error = "the stream ended without content"
        return
    usage = usage or {}
    result.output_tokens = int(usage.get("completion_tokens") or content_chunks)
    result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
    result.success = True


async def send_request(session, api_url: str, backend: str, payload: dict, result: RequestResult,
                       timeout_s: float) -> None:
    """Send one streamed request and fill ``result`` (see ``RequestResult``; TTFT, ITL and E2EL are
    measured from just before the POST). Any failure (HTTP status, error event, no content,
    connection error, malformed stream, no complete response within ``timeout_s``) is recorded
    as ``result.error``, never raised."""
    sent = time.perf_counter()
    try:
        await asyncio.wait_for(_read_stream(session, api_url, backend, payload, result, sent), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"no complete response within {timeout_s:g} s (--request-timeout)"
    except (aiohttp.ClientError, ValueError) as error:  # ValueError: a line that is not JSON
        result.error = f"{type(error).__name__}: {error}"[:ERROR_TEXT_LIMIT]
    if not result.success:
        result.ttft, result.latency, result.itl = math.nan, math.nan, []


# ============================================================================ the load
@dataclass
class InFlight:
    """Requests sent and not yet finished, and the most there were at once."""

    now: int = 0
    peak: int = 0

    @contextlib.contextmanager
    def request(self):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            yield
        finally:
            self.now -= 1


async def run_load(requests: list[BenchRequest], due_times: np.ndarray, *, api_url: str, backend: str, model: str,
                   max_concurrency: int | None = None, warmup_requests: int = 0, request_timeout: float = 600.0,
                   progress: bool = True) -> tuple[list[RequestResult], float, int]:
    """Send ``warmup_requests`` (the dataset's first prompts, cyclically; all at once; not
    returned), then every request of ``requests`` at its ``due_times`` (seconds from the start),
    at most ``max_concurrency`` in flight (None: no limit). Returns (one ``RequestResult`` per
    request in order, duration from the start to the last finish in seconds, peak in flight)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = InFlight()
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # aiohttp's default caps at 100
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def send(request: BenchRequest, result: RequestResult, origin: float, due: float) -> None:
            async with slots:
                result.queue_time = time.perf_counter() - due
                result.start_time = time.perf_counter() - origin
                with in_flight.request():
                    await send_request(session, api_url, backend, request_payload(backend, model, request), result,
                                       request_timeout)

        if warmup_requests:
            warmup = [(requests[i % len(requests)], RequestResult(0)) for i in range(warmup_requests)]
            started = time.perf_counter()
            await asyncio.gather(*(send(request, result, started, started) for request, result in warmup))
            failed = [result.error for _, result in warmup if not result.success]
            note = f"; {len(failed)} failed, first: {failed[0]}" if failed else ""
            print(f"warm-up: {warmup_requests} requests in {time.perf_counter() - started:.2f} s{note}", flush=True)

        in_flight.peak = 0
        results = [RequestResult(request.prompt_len) for request in requests]
        with tqdm(total=len(requests), desc="requests", unit="req", disable=not progress) as bar:
            started = time.perf_counter()
            tasks = []
            for request, result, offset in zip(requests, results, due_times.tolist()):
                due = started + offset
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                task = asyncio.create_task(send(request, result, started, due))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - started
    return results, duration, in_flight.peak


async def first_served_model(base_url: str, timeout_s: float) -> str:
    """The id of the first model GET ``base_url``/v1/models lists. ValueError when the server
    cannot be reached or lists none."""
    url = base_url + "/v1/models"
    try:
        async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url) as response:
                response.raise_for_status()
                models = (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        raise ValueError(f"{url}: cannot list the served models ({type(error).__name__}: {error}); give --model") \
            from None
    if not models:
        raise ValueError(f"{url}: the server lists no model; give --model")
    return models[0]["id"]


# ============================================================================ metrics
def parse_goodput(specs) -> dict[str, float]:
    """``['ttft:500', 'tpot:50']`` -> {'ttft': 500.0, 'tpot': 50.0}: service-level objectives in
    ms of TTFT, TPOT and E2EL. ValueError on another name, a value that is not a number >= 0 or a
    name given twice."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, _, value = spec.partition(":")
        name = name.strip().lower()
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        if name in slos:
            raise ValueError(f"--goodput: {name} given twice")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if not slos[name] >= 0:
            raise ValueError(f"--goodput {spec!r}: expected a value >= 0")
    return slos


def parse_percentiles(spec: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0], with 99 added when missing (the report always has
    p99), sorted. ValueError for a value outside [0, 100] or not a number."""
    try:
        values = {float(part) for part in spec.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--percentiles {spec!r}: expected comma-separated numbers, e.g. 50,90,99") from None
    if any(not 0 <= value <= 100 for value in values):
        raise ValueError(f"--percentiles {spec!r}: expected values in [0, 100]")
    return sorted(values | {99.0})


def percentile_key(percentile: float) -> str:
    """'p99' for 99, 'p99.9' for 99.9."""
    return f"p{percentile:g}"


def latency_statistics(key: str, seconds: list[float], percentiles: list[float]) -> dict:
    """mean, median, std, max and the ``percentiles`` of ``seconds``, in ms, as
    ``{stat}_{key}_ms`` (all None when there is no value)."""
    values = np.asarray(seconds, dtype=np.float64) * 1e3
    stats = {"mean": np.mean, "median": np.median, "std": np.std, "max": np.max}
    result = {f"{name}_{key}_ms": float(reduce(values)) if values.size else None for name, reduce in stats.items()}
    for percentile in percentiles:
        result[f"{percentile_key(percentile)}_{key}_ms"] = float(np.percentile(values, percentile)) if values.size \
            else None
    return result


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request's TTFT, TPOT and E2EL are each at most its SLO in ``slos_ms``
    (a metric without an SLO is not checked; a request without TPOT meets a TPOT SLO)."""
    observed_ms = {"ttft": 1e3 * result.ttft, "tpot": 1e3 * (result.tpot or 0.0), "e2el": 1e3 * result.latency}
    return all(observed_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    slos_ms: dict[str, float], max_concurrent_requests: int) -> dict:
    """The run's figures (see the module docstring for their names and definitions): counts,
    token totals over completed requests, throughputs over ``duration``, goodput (None without
    ``slos_ms``) and the TTFT / TPOT / ITL / E2EL statistics of the completed requests."""
    completed = [result for result in results if result.success]
    input_tokens = sum(result.prompt_len for result in completed)
    output_tokens = sum(result.output_tokens for result in completed)
    metrics = {
        "duration": duration, "completed": len(completed), "failed": len(results) - len(completed),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(completed) / duration,
        "request_goodput": (sum(meets_slos(result, slos_ms) for result in completed) / duration) if slos_ms
        else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_concurrent_requests": max_concurrent_requests,
    }
    samples = {"ttft": [result.ttft for result in completed],
               "tpot": [result.tpot for result in completed if result.tpot is not None],
               "itl": [gap for result in completed for gap in result.itl],
               "e2el": [result.latency for result in completed]}
    for key, _, _ in LATENCY_METRICS:
        metrics.update(latency_statistics(key, samples[key], percentiles))
    return metrics


def per_request_fields(results: list[RequestResult]) -> dict:
    """The per-request lists of the JSON (None for a failed request's timings)."""

    def seconds(value: float) -> float | None:
        return None if math.isnan(value) else value

    return {"input_lens": [result.prompt_len for result in results],
            "output_lens": [result.output_tokens for result in results],
            "ttfts": [seconds(result.ttft) for result in results],
            "itls": [result.itl for result in results],
            "latencies": [seconds(result.latency) for result in results],
            "start_times": [seconds(result.start_time) for result in results],
            "queue_times": [seconds(result.queue_time) for result in results],
            "errors": [result.error for result in results]}


# ============================================================================ report
def format_report(results: dict) -> str:
    """The vLLM-style table of a run's ``results`` (p50 is left to the median's row), then its
    most frequent errors."""

    def row(label: str, value) -> str:
        if value is None:
            text = "n/a"
        elif isinstance(value, float):
            text = f"{value:.2f}"
        else:
            text = str(value)
        return f"{label:<40} {text}"

    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             row("Successful requests:", results["completed"]),
             row("Failed requests:", results["failed"]),
             row("Maximum request concurrency:", results["max_concurrency"] or "unlimited"),
             row("Peak concurrent requests:", results["max_concurrent_requests"]),
             row("Request rate configured (RPS):", results["request_rate"]),
             row("Burstiness:", float(results["burstiness"])),
             row("Benchmark duration (s):", results["duration"]),
             row("Total input tokens:", results["total_input_tokens"]),
             row("Total generated tokens:", results["total_output_tokens"]),
             row("Request throughput (req/s):", results["request_throughput"])]
    if results["goodput_slos_ms"]:
        lines += [row("Goodput SLOs (ms):", " ".join(f"{name}:{limit:g}"
                                                     for name, limit in results["goodput_slos_ms"].items())),
                  row("Request goodput (req/s):", results["request_goodput"])]
    lines += [row("Output token throughput (tok/s):", results["output_throughput"]),
              row("Total token throughput (tok/s):", results["total_token_throughput"])]
    for key, name, heading in LATENCY_METRICS:
        lines += ["{:-^50}".format(heading),
                  row(f"Mean {name} (ms):", results[f"mean_{key}_ms"]),
                  row(f"Median {name} (ms):", results[f"median_{key}_ms"])]
        lines += [row(f"P{percentile:g} {name} (ms):", results[f"{percentile_key(percentile)}_{key}_ms"])
                  for percentile in results["percentiles"] if percentile != 50]
        lines.append(row(f"Max {name} (ms):", results[f"max_{key}_ms"]))
    lines.append("=" * 50)
    errors = collections.Counter(error for error in results["errors"] if error)
    if errors:
        lines.append(f"errors ({sum(errors.values())} requests; the 5 most frequent):")
        lines += [f"  {count} x {error}" for error, count in errors.most_common(5)]
    return "\n".join(lines)


def plot_results(results: dict, path: Path) -> bool:
    """Four panels of a run's per-request ``results`` as a PNG at ``path``: TTFT and E2EL of each
    request by its start time (failures marked on the axis), the TTFT and the ITL distributions
    (median and p99 marked), and requests in flight with output tokens/s over the run (each
    request's tokens spread evenly over its content chunks). False, writing nothing, without
    matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    completed = [i for i, error in enumerate(results["errors"]) if not error]
    failed = [i for i, error in enumerate(results["errors"]) if error]
    starts = np.array([results["start_times"][i] for i in completed])
    ttft_ms = np.array([results["ttfts"][i] for i in completed]) * 1e3
    e2el_ms = np.array([results["latencies"][i] for i in completed]) * 1e3
    itl_ms = np.array([gap for i in completed for gap in results["itls"][i]]) * 1e3

    figure = Figure(figsize=(13, 8.5), layout="constrained")
    figure.suptitle(f"fuselm bench-serve: {results['model']} at {results['base_url']} ({results['backend']}); "
                    f"{results['completed']} completed, {results['failed']} failed; rate {results['request_rate']} "
                    f"req/s, max concurrency {results['max_concurrency'] or 'unlimited'}")
    by_start, ttft_axis, itl_axis, load_axis = figure.subplots(2, 2).ravel()

    by_start.scatter(starts, e2el_ms, s=10, label="E2EL", color="tab:orange")
    by_start.scatter(starts, ttft_ms, s=10, label="TTFT", color="tab:blue")
    failed_starts = [results["start_times"][i] for i in failed if results["start_times"][i] is not None]
    if failed_starts:
        by_start.scatter(failed_starts, np.zeros(len(failed_starts)), marker="x", color="tab:red", label="failed")
    by_start.set(title="Latency by request start", xlabel="request sent (s from start)", ylabel="ms")
    by_start.legend()

    for axis, values, name, color in ((ttft_axis, ttft_ms, "TTFT", "tab:blue"), (itl_axis, itl_ms, "ITL", "tab:green")):
        axis.set(title=f"{name} distribution ({values.size} values)", xlabel=f"{name} (ms)", ylabel="count")
        if values.size:
            axis.hist(values, bins=50, color=color)
            for percentile, style in ((50, "--"), (99, ":")):
                position = np.percentile(values, percentile)
                axis.axvline(position, color="black", linestyle=style, label=f"p{percentile} {position:.1f} ms")
            axis.legend()
    itl_axis.set_yscale("log")

    ends = starts + e2el_ms / 1e3
    horizon = max(results["duration"], 1e-3)
    edges = np.linspace(0.0, horizon, 51)
    in_flight = [np.sum((starts <= t) & (ends > t)) for t in edges[:-1]]
    chunk_times, chunk_tokens = [], []
    for i in completed:
        times = results["start_times"][i] + results["ttfts"][i] + np.concatenate(([0.0], np.cumsum(results["itls"][i])))
        chunk_times.append(times)
        chunk_tokens.append(np.full(times.size, results["output_lens"][i] / times.size))
    tokens_per_bin = np.histogram(np.concatenate(chunk_times or [[]]), bins=edges,
                                  weights=np.concatenate(chunk_tokens or [[]]))[0]
    load_axis.step(edges[:-1], in_flight, where="post", color="tab:purple", label="requests in flight")
    load_axis.set(title="Load over the run", xlabel="s from start", ylabel="requests in flight")
    throughput_axis = load_axis.twinx()
    throughput_axis.plot((edges[:-1] + edges[1:]) / 2, tokens_per_bin / np.diff(edges), color="tab:olive",
                         label="output tok/s")
    throughput_axis.set_ylabel("output tokens/s")
    load_axis.legend(loc="upper left")
    throughput_axis.legend(loc="upper right")
    figure.savefig(path, dpi=110)
    return True


# ============================================================================ the command
def api_url_of(base_url: str, endpoint: str) -> str:
    """``base_url`` + ``endpoint`` after checking that the first is an http(s) URL without query
    and the second a path (so nothing but ``base_url`` is contacted). ValueError otherwise."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"{base_url!r}: expected a base URL like {DEFAULT_BASE_URL}")
    if not endpoint.startswith("/") or "://" in endpoint:
        raise ValueError(f"--endpoint {endpoint!r}: expected a path such as /v1/completions")
    return base_url.rstrip("/") + endpoint


def run_bench_serve(base_url: str = DEFAULT_BASE_URL, *, backend: str = "openai", endpoint: str | None = None,
                    model: str | None = None, tokenizer: str | Path | None = None, dataset_name: str = "random",
                    dataset_path: str | Path | None = None, sharegpt_output_len: int | None = None,
                    num_prompts: int = 200, random_input_len: int = 512, random_output_len: int = 256,
                    random_range_ratio: float = 0.0,
                    random_vocab_size: int | None = None, seed: int = 0, request_rate: float = math.inf,
                    burstiness: float = 1.0, max_concurrency: int | None = None, warmup_requests: int = 0,
                    request_timeout: float = 600.0, goodput=(), percentiles: str = "50,90,99",
                    out: Path | None = None, label: str = "bench_serve", progress: bool = True) -> dict:
    """Run the benchmark described in the module docstring against ``base_url``, print its table,
    write ``out/<label>.{json,md,png}`` when ``out`` is given, and return the results (the JSON's
    fields). ``goodput``: 'NAME:MS' strings (``parse_goodput``); ``percentiles``: '50,90,99'.
    ValueError for a bad setting or when the model cannot be found; FileNotFoundError for a
    missing tokenizer. Failed requests are counted, not raised."""
    if backend not in BACKEND_ENDPOINTS:
        raise ValueError(f"--backend {backend!r}: expected one of {', '.join(BACKEND_ENDPOINTS)}")
    endpoint = endpoint or BACKEND_ENDPOINTS[backend]
    api_url = api_url_of(base_url, endpoint)
    base_url = base_url.rstrip("/")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency: expected >= 1, got {max_concurrency}")
    if warmup_requests < 0:
        raise ValueError(f"--warmup-requests: expected >= 0, got {warmup_requests}")
    if not request_timeout > 0:
        raise ValueError(f"--request-timeout: expected > 0 seconds, got {request_timeout}")
    slos_ms = parse_goodput(goodput)
    percentile_list = parse_percentiles(percentiles)
    loaded_tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
    if dataset_name == "random":
        requests = random_requests(num_prompts, random_input_len, random_output_len, random_range_ratio, seed=seed,
                                   tokenizer=loaded_tokenizer, vocab_size=random_vocab_size,
                                   as_text=backend == "openai-chat")
        dataset = (f"{num_prompts} random prompts, input {random_input_len}, output {random_output_len}, range ratio "
                   f"{random_range_ratio:g}, seed {seed}")
    elif dataset_name == "sharegpt":
        if dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        requests = sharegpt_requests(dataset_path, num_prompts, loaded_tokenizer, seed=seed,
                                     output_len=sharegpt_output_len)
        outputs = "the replies' lengths" if sharegpt_output_len is None else sharegpt_output_len
        dataset = f"{num_prompts} ShareGPT prompts of {Path(dataset_path).name}, seed {seed}, output {outputs}"
    else:
        raise ValueError(f"--dataset-name {dataset_name!r}: expected random or sharegpt")
    due_times = arrival_times(num_prompts, request_rate, burstiness, seed)
    model = model or asyncio.run(first_served_model(base_url, request_timeout))

    arrival = "all at once" if math.isinf(request_rate) else \
        f"{request_rate:g} req/s ({'Poisson' if burstiness == 1 else f'gamma, burstiness {burstiness:g}'})"
    print(f"fuselm bench-serve: {backend} at {api_url}, model {model}; {dataset}, {arrival}, max concurrency "
          f"{max_concurrency or 'unlimited'}, {warmup_requests} warm-up", flush=True)
    request_results, duration, peak = asyncio.run(run_load(
        requests, due_times, api_url=api_url, backend=backend, model=model, max_concurrency=max_concurrency,
        warmup_requests=warmup_requests, request_timeout=request_timeout, progress=progress))

    results = {"backend": backend, "base_url": base_url, "endpoint": endpoint, "model": model, "dataset": dataset_name,
               "dataset_path": None if dataset_path is None else str(dataset_path),
               "sharegpt_output_len": sharegpt_output_len, "num_prompts": num_prompts,
               "random_input_len": random_input_len,
               "random_output_len": random_output_len, "random_range_ratio": random_range_ratio, "seed": seed,
               "request_rate": "inf" if math.isinf(request_rate) else request_rate,
               "burstiness": "inf" if math.isinf(burstiness) else burstiness, "max_concurrency": max_concurrency,
               "warmup_requests": warmup_requests, "request_timeout": request_timeout, "goodput_slos_ms": slos_ms,
               "percentiles": percentile_list, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               **compute_metrics(request_results, duration, percentile_list, slos_ms, peak),
               **per_request_fields(request_results)}
    report = format_report(results)
    print(report, flush=True)
    if out is not None:
        markdown = (f"## fuselm bench-serve: {model} ({backend}, {api_url})\n\n{dataset}; {arrival}; "
                    f"max concurrency {max_concurrency or 'unlimited'}\n\n```\n{report}\n```\n")
        write_results(out, label, results, markdown)
        plot = Path(out) / f"{label}.png"
        if plot_results(results, plot):
            print(f"wrote {plot}")
        else:
            print("no plot: matplotlib is not installed (pip install matplotlib)")
    return results
