"""``fuselm.bench.serve`` (``fuselm bench-serve``) against a fake OpenAI-compatible server.

The fake server runs in-process on 127.0.0.1 (aiohttp, in a thread with its own event loop): it
streams ``max_tokens`` tokens, ``tokens_per_chunk`` per chunk, the first chunk after
``first_token_delay`` and each next one ``token_delay`` per token later, then a usage chunk and
``[DONE]``; it can answer every ``fail_every``-th request with HTTP 400 or stall every
``stall_every``-th one, and it records each request's body and the peak of requests in flight.
The load generator's figures must match those delays, counts and limits; the arrival process and
the dataset are checked on their own with a seed.
"""

import asyncio
import contextlib
import importlib.util
import io
import json
import math
import sys
import threading

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fuselm.bench.serve import (  # noqa: E402
    RequestResult,
    arrival_times,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    random_requests,
    run_bench_serve,
    sharegpt_requests,
)

MODEL = "fake-model"
FIRST_TOKEN_DELAY, TOKEN_DELAY = 0.05, 0.01  # seconds
SLACK = 0.02  # seconds a measured time may exceed the server's delay (client and loop overhead)


class FakeServer:
    """An OpenAI-compatible streaming server (GET /v1/models, POST /v1/completions and
    /v1/chat/completions) with known delays; see the module docstring."""

    def __init__(self):
        self.first_token_delay, self.token_delay, self.tokens_per_chunk = FIRST_TOKEN_DELAY, TOKEN_DELAY, 1
        self.fail_every = self.stall_every = 0
        self.payloads: list[dict] = []
        self.in_flight = self.peak_in_flight = 0

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(self, request):
        payload = await request.json()
        self.payloads.append(payload)
        number = len(self.payloads)
        if self.fail_every and number % self.fail_every == 0:
            return web.json_response({"error": {"message": f"request {number} refused", "code": 400}}, status=400)
        chat = request.path.endswith("/chat/completions")
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        prompt_tokens = len(prompt.split()) + 3 * chat if isinstance(prompt, str) else len(prompt)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if self.stall_every and number % self.stall_every == 0:
                await asyncio.sleep(2.0)
            await asyncio.sleep(self.first_token_delay)
            remaining = payload["max_tokens"]
            while remaining:
                tokens = min(self.tokens_per_chunk, remaining)
                text = " tok" * tokens
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                remaining -= tokens
                if remaining:
                    await asyncio.sleep(self.token_delay * min(self.tokens_per_chunk, remaining))
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": payload["max_tokens"],
                     "total_tokens": prompt_tokens + payload["max_tokens"]}
            await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.in_flight -= 1


@pytest.fixture
def server():
    """(FakeServer, its base URL), serving from a thread of its own until the test ends."""
    fake = FakeServer()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.generate)
    app.router.add_post("/v1/chat/completions", fake.generate)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    asyncio.run_coroutine_threadsafe(site.start(), loop).result()
    host, port = runner.addresses[0][:2]
    yield fake, f"http://{host}:{port}"

    async def shutdown():  # handlers still running (a stalled request) are cancelled
        await runner.cleanup()
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(shutdown(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def bench(base_url, **settings):
    """``run_bench_serve`` without the progress bar, its printing captured: (results, printed)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = run_bench_serve(base_url, progress=False, **settings)
    return results, printed.getvalue()


def write_word_tokenizer(path):
    """A word-level tokenizer.json of 50 words w0..w49 (ids 0..49, [UNK] 50) and one special token
    (id 51)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(50)}, "[UNK]": 50}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|end|>"])
    tokenizer.save(str(path))
    return path


# ============================================================================ arrivals and dataset
@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_the_rate_and_burstiness_asked_for(burstiness):
    """Gamma gaps of shape B and mean 1/R: mean 1/R, coefficient of variation 1/sqrt(B); B = 1 is
    Poisson (exponential gaps, CV 1). The first request is due at 0; the seed fixes the times."""
    rate = 20.0
    times = arrival_times(20001, rate, burstiness, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    np.testing.assert_array_equal(times, arrival_times(20001, rate, burstiness, seed=7))
    assert not np.array_equal(times, arrival_times(20001, rate, burstiness, seed=8))


def test_arrival_times_at_infinite_rate_or_burstiness():
    np.testing.assert_array_equal(arrival_times(5, math.inf), np.zeros(5))
    np.testing.assert_allclose(arrival_times(5, 4.0, math.inf), [0, 0.25, 0.5, 0.75, 1.0])
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(5, rate, burstiness)


def test_random_requests_lengths_ids_and_seed(tmp_path):
    exact = random_requests(20, 16, 8, seed=1, vocab_size=100)
    assert [(r.prompt_len, len(r.prompt), r.output_len) for r in exact] == [(16, 16, 8)] * 20
    assert all(0 <= i < 100 for r in exact for i in r.prompt)
    assert [r.prompt for r in exact] == [r.prompt for r in random_requests(20, 16, 8, seed=1, vocab_size=100)]

    spread = random_requests(400, 100, 40, 0.2, seed=2, vocab_size=100)
    input_lens, output_lens = [r.prompt_len for r in spread], [r.output_len for r in spread]
    assert min(input_lens) == 80 and max(input_lens) == 120  # every integer in [80, 120] is drawn
    assert min(output_lens) == 32 and max(output_lens) == 48

    from fuselm.bench.serve import load_tokenizer

    tokenizer = load_tokenizer(write_word_tokenizer(tmp_path / "tokenizer.json").parent)
    ids = [i for r in random_requests(50, 30, 4, seed=3, tokenizer=tokenizer) for i in r.prompt]
    assert set(ids) <= set(range(51))  # never the special token 51
    texts = random_requests(5, 30, 4, seed=3, tokenizer=tokenizer, as_text=True)
    assert all(isinstance(r.prompt, str) and r.prompt_len == 30 for r in texts)

    for bad in (dict(num_prompts=0), dict(input_len=0), dict(output_len=0), dict(range_ratio=1.0)):
        with pytest.raises(ValueError):
            random_requests(**{"num_prompts": 2, "input_len": 4, "output_len": 4, **bad})
    with pytest.raises(ValueError, match="--tokenizer"):
        random_requests(2, 4, 4, as_text=True)


def sharegpt_file(path, conversations):
    roles = ("human", "gpt", "human")
    path.write_text(json.dumps([{"id": str(i), "conversations": [{"from": who, "value": text}
                                                                 for who, text in zip(roles, turns)]}
                                for i, turns in enumerate(conversations)]))
    return path


def words(n, start=0):
    return " ".join(f"w{(start + i) % 50}" for i in range(n))


def test_sharegpt_requests_follow_vllms_filter_and_shuffle(tmp_path):
    """vLLM's ShareGPT sampling: two turns or more; prompt >= 4 and <= 1024 tokens, reply >= 4 (unless
    the output length is fixed), both <= 2048; the order of random.seed(seed) + random.shuffle."""
    from fuselm.bench.serve import load_tokenizer

    tokenizer = load_tokenizer(write_word_tokenizer(tmp_path / "tokenizer.json"))
    valid = [(words(5 + i, i), words(4 + i)) for i in range(6)]
    invalid = [(words(3), words(10)), (words(10), words(3)), (words(1025), words(10)), (words(1000), words(1049))]
    conversations = valid + invalid + [(words(8),)]  # the last: one turn
    path = sharegpt_file(tmp_path / "sharegpt.json", conversations)
    requests = sharegpt_requests(path, 6, tokenizer, seed=7)
    order = [c for c in conversations if len(c) >= 2]
    import random
    random.seed(7)
    random.shuffle(order)
    expected = [c for c in order if c in valid]
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [
        (p, len(p.split()), len(c.split())) for p, c in expected]
    # output 2 tokens: the reply's minimum is not applied ((10, 3) passes) and 1000 + 2 fit in 2048
    fixed = sharegpt_requests(path, 8, tokenizer, seed=7, output_len=2)
    passing = valid + [(words(10), words(3)), (words(1000), words(1049))]
    assert [(r.prompt, r.prompt_len, r.output_len) for r in fixed] == [
        (p, len(p.split()), 2) for p, *_ in (c for c in order if c in passing)]
    more = sharegpt_requests(path, 20, tokenizer, seed=7)  # 6 pass: 14 drawn again
    assert len(more) == 20 and set(r.prompt for r in more) == {p for p, _ in valid}
    for call, message in [(lambda: sharegpt_requests(path, 2, None), "--tokenizer"),
                          (lambda: sharegpt_requests(tmp_path / "none.json", 2, tokenizer), "--dataset-path"),
                          (lambda: sharegpt_requests(sharegpt_file(tmp_path / "bad.json", invalid), 2, tokenizer),
                           "no conversation passes"),
                          (lambda: sharegpt_requests(path, 0, tokenizer), "--num-prompts"),
                          (lambda: sharegpt_requests(path, 2, tokenizer, output_len=0), "--sharegpt-output-len")]:
        with pytest.raises(ValueError, match=message):
            call()


def test_sharegpt_prompts_go_as_text_with_their_reply_lengths(server, tmp_path):
    fake, url = server
    write_word_tokenizer(tmp_path / "tokenizer.json")
    path = sharegpt_file(tmp_path / "sharegpt.json", [(words(6 + i), words(4 + i)) for i in range(3)])
    results, printed = bench(url, model=MODEL, tokenizer=tmp_path, dataset_name="sharegpt", dataset_path=path,
                             num_prompts=3)
    assert results["completed"] == 3 and results["dataset"] == "sharegpt" and "ShareGPT prompts" in printed
    sent = sorted((len(body["prompt"].split()), body["max_tokens"]) for body in fake.payloads)
    assert sent == [(6, 4), (7, 5), (8, 6)] and sorted(results["input_lens"]) == [6, 7, 8]
    with pytest.raises(ValueError, match="--dataset-path"):
        bench(url, model=MODEL, tokenizer=tmp_path, dataset_name="sharegpt", num_prompts=1)
    with pytest.raises(ValueError, match="--dataset-name"):
        bench(url, model=MODEL, dataset_name="sonnet", num_prompts=1)


# ============================================================================ metrics
def finished(ttft, latency, output_tokens, itl=()):
    return RequestResult(10, success=True, start_time=0.0, queue_time=0.0, ttft=ttft,
                         latency=latency, itl=list(itl), output_tokens=output_tokens)


def test_goodput_counts_requests_meeting_every_slo():
    results = [finished(0.1, 1.0, 11),   # TPOT 90 ms
               finished(0.3, 0.8, 11),   # TTFT 300 ms, TPOT 50 ms
               finished(0.1, 0.4, 11),   # TPOT 30 ms
               finished(0.2, 0.2, 1),    # one token: no TPOT, meets any TPOT SLO
               RequestResult(10, error="HTTP 400")]
    for slos, good in (({"ttft": 200}, 3), ({"tpot": 60}, 3), ({"ttft": 200, "tpot": 60}, 2),
                       ({"e2el": 500}, 2), ({"ttft": 250, "tpot": 40, "e2el": 1000}, 2), ({"ttft": 50}, 0)):
        metrics = compute_metrics(results, 2.0, [99.0], slos, 4)
        assert metrics["request_goodput"] == pytest.approx(good / 2.0), slos
    metrics = compute_metrics(results, 2.0, [50.0, 99.0], {}, 4)
    assert metrics["request_goodput"] is None and (metrics["completed"], metrics["failed"]) == (4, 1)
    assert metrics["mean_tpot_ms"] == pytest.approx((90 + 50 + 30) / 3)  # the one-token request has none
    assert metrics["median_ttft_ms"] == pytest.approx(150) and metrics["max_e2el_ms"] == pytest.approx(1000)
    assert metrics["total_output_tokens"] == 34 and metrics["output_throughput"] == pytest.approx(17)


def test_goodput_and_percentile_specs():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000.5"]) == {"ttft": 500, "tpot": 50, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"], ["ttft:1", "ttft:2"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50,90") == [50, 90, 99] and parse_percentiles("99.9, 50") == [50, 99, 99.9]
    for bad in ("x", "101", "-1"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


# ============================================================================ against the fake server
def test_completions_timings_tokens_throughput_and_concurrency(server, tmp_path):
    fake, url = server
    prompts, output_len = 12, 8
    results, printed = bench(url, num_prompts=prompts, random_input_len=16, random_output_len=output_len,
                             random_vocab_size=1000, max_concurrency=4, goodput=["ttft:1000", "tpot:1000"],
                             percentiles="50,90", out=tmp_path, label="run")

    assert (results["completed"], results["failed"]) == (prompts, 0)
    assert results["model"] == MODEL  # the first of /v1/models
    body = fake.payloads[0]
    assert body["model"] == MODEL and body["max_tokens"] == output_len and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert all(len(p["prompt"]) == 16 and all(isinstance(i, int) and 0 <= i < 1000 for i in p["prompt"])
               for p in fake.payloads)

    # every request was held to 4 in flight, and 12 sent at once do reach 4
    assert fake.peak_in_flight == 4 and results["max_concurrent_requests"] == 4

    expected_e2el = FIRST_TOKEN_DELAY + (output_len - 1) * TOKEN_DELAY
    # (the measured values in each message: on the lent GPU's machine this test failed on the TTFTs)
    ttfts = results["ttfts"]
    assert all(FIRST_TOKEN_DELAY * 0.95 <= t <= FIRST_TOKEN_DELAY + SLACK for t in ttfts), ttfts
    assert all(len(gaps) == output_len - 1 for gaps in results["itls"])
    assert TOKEN_DELAY * 0.9 <= results["median_itl_ms"] / 1e3 <= TOKEN_DELAY + SLACK / 4, results["median_itl_ms"]
    assert TOKEN_DELAY * 0.9 <= results["mean_tpot_ms"] / 1e3 <= TOKEN_DELAY + SLACK / 4, results["mean_tpot_ms"]
    latencies = results["latencies"]
    assert all(expected_e2el * 0.95 <= t <= expected_e2el + 2 * SLACK for t in latencies), latencies
    assert results["output_lens"] == [output_len] * prompts and results["input_lens"] == [16] * prompts

    duration = results["duration"]
    assert 3 * expected_e2el * 0.95 <= duration <= 3 * expected_e2el + 1.0  # three waves of four
    assert results["total_input_tokens"] == 16 * prompts and results["total_output_tokens"] == output_len * prompts
    assert results["request_throughput"] == pytest.approx(prompts / duration)
    assert results["output_throughput"] == pytest.approx(output_len * prompts / duration)
    assert results["total_token_throughput"] == pytest.approx((16 + output_len) * prompts / duration)
    assert results["request_goodput"] == pytest.approx(prompts / duration)

    assert "Serving Benchmark Result" in printed and "P90 TTFT (ms):" in printed and "P99 ITL (ms):" in printed
    written = json.loads((tmp_path / "run.json").read_text())
    documented = ["backend", "base_url", "endpoint", "model", "dataset", "dataset_path", "sharegpt_output_len",
                  "num_prompts", "random_input_len",
                  "random_output_len", "random_range_ratio", "seed", "request_rate", "burstiness", "max_concurrency",
                  "warmup_requests", "request_timeout", "goodput_slos_ms", "percentiles", "date", "duration",
                  "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                  "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
                  "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "errors"]
    documented += [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
                   for stat in ("mean", "median", "std", "max", "p50", "p90", "p99")]
    assert sorted(written) == sorted(documented)
    assert written["request_rate"] == "inf" and written["percentiles"] == [50, 90, 99]
    assert (tmp_path / "run.md").read_text().count("Serving Benchmark Result") == 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_run_notes_there_is_no_plot(server, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # its import now fails
    _, url = server
    results, printed = bench(url, model=MODEL, num_prompts=2, random_input_len=4, random_output_len=2, out=tmp_path)
    assert results["completed"] == 2 and "no plot: matplotlib is not installed" in printed
    assert (tmp_path / "bench_serve.json").is_file() and not (tmp_path / "bench_serve.png").exists()


def test_chat_backend_counts_tokens_from_usage_with_several_per_chunk(server, tmp_path):
    """Chat requests carry text from --tokenizer; the server streams 9 tokens in 3 chunks of 3:
    output tokens come from the usage chunk, an ITL spans a chunk (3 token delays), and TPOT is
    (E2EL - TTFT) / 8 = 6 token delays / 8 (the first chunk brought 3 tokens at TTFT)."""
    fake, url = server
    fake.tokens_per_chunk = 3
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    results, _ = bench(url, backend="openai-chat", model="named", tokenizer=tmp_path, num_prompts=4,
                       random_input_len=20, random_output_len=9)
    assert results["completed"] == 4 and results["output_lens"] == [9] * 4
    body = fake.payloads[0]
    assert body["model"] == "named" and body["max_tokens"] == body["max_completion_tokens"] == 9
    assert len(body["messages"][0]["content"].split()) == 20 and tokenizer.is_file()
    assert results["input_lens"] == [23] * 4  # the server's prompt_tokens (20 words + its 3)
    assert all(len(gaps) == 2 for gaps in results["itls"])
    assert 3 * TOKEN_DELAY * 0.9 <= results["median_itl_ms"] / 1e3 <= 3 * TOKEN_DELAY + SLACK / 2
    assert 6 / 8 * TOKEN_DELAY * 0.9 <= results["median_tpot_ms"] / 1e3 <= 6 / 8 * TOKEN_DELAY + SLACK / 4


def test_failures_are_counted_with_their_error(server):
    fake, url = server
    fake.fail_every = 3
    results, printed = bench(url, model=MODEL, num_prompts=9, random_input_len=4, random_output_len=3,
                             max_concurrency=1)
    assert (results["completed"], results["failed"]) == (6, 3)
    failed = [i for i, error in enumerate(results["errors"]) if error]
    assert failed == [2, 5, 8]
    assert all(results["errors"][i].startswith("HTTP 400") and "refused" in results["errors"][i] for i in failed)
    assert all(results["ttfts"][i] is None and results["output_lens"][i] == 0 for i in failed)
    assert results["total_output_tokens"] == 18 and results["request_throughput"] == pytest.approx(
        6 / results["duration"])
    assert "3 requests" in printed and "request 3 refused" in printed


def test_request_timeout_and_an_unreachable_server_fail_requests_not_the_run(server):
    fake, url = server
    fake.stall_every = 2
    results, _ = bench(url, model=MODEL, num_prompts=4, random_input_len=4, random_output_len=2,
                       request_timeout=0.5)
    assert (results["completed"], results["failed"]) == (2, 2)
    assert all("no complete response within 0.5 s" in results["errors"][i] for i in (1, 3))
    assert results["duration"] < 1.5

    results, _ = bench(f"http://127.0.0.1:{closed_port()}", model=MODEL, num_prompts=3, random_input_len=4,
                       random_output_len=2)
    assert (results["completed"], results["failed"]) == (0, 3) and all(results["errors"])
    assert results["mean_ttft_ms"] is None and results["request_throughput"] == 0


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_requests_are_sent_at_their_arrival_times_and_warmup_is_not_counted(server):
    fake, url = server
    fake.first_token_delay = fake.token_delay = 0.001
    results, printed = bench(url, model=MODEL, num_prompts=10, random_input_len=4, random_output_len=2,
                             request_rate=40.0, burstiness=2.0, seed=5, warmup_requests=3)
    assert len(fake.payloads) == 13 and results["completed"] == 10 and "warm-up: 3 requests" in printed
    np.testing.assert_allclose(results["start_times"], arrival_times(10, 40.0, 2.0, seed=5), atol=0.015)


def test_bad_settings_raise_value_error(server, tmp_path):
    _, url = server
    for settings in (dict(backend="tgi"), dict(endpoint="v1/completions"), dict(endpoint="http://elsewhere/x"),
                     dict(max_concurrency=0), dict(request_timeout=0), dict(goodput=["ttft=5"]),
                     dict(backend="openai-chat"), dict(request_rate=0.0)):
        with pytest.raises(ValueError):
            bench(url, model=MODEL, num_prompts=1, **settings)
    with pytest.raises(ValueError, match="expected a base URL"):
        bench("ftp://127.0.0.1:1", model=MODEL)
    with pytest.raises(FileNotFoundError):
        bench(url, model=MODEL, tokenizer=tmp_path / "missing")
    with pytest.raises(ValueError, match="give --model"):
        bench(f"http://127.0.0.1:{closed_port()}")


def test_cli_bench_serve(server, tmp_path):
    """``fuselm bench-serve URL ...`` parses, runs and writes its files (once the subcommand is in
    fuselm.cli)."""
    from fuselm.cli import build_parser, main

    commands = next(action for action in build_parser()._actions if action.dest == "command")
    if "bench-serve" not in commands.choices:
        pytest.skip("fuselm.cli has no bench-serve subcommand yet")
    _, url = server
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["bench-serve", url, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len",
                       "2", "--max-concurrency", "2", "--goodput", "ttft:1000", "--out", str(tmp_path)])
    assert status == 0 and json.loads((tmp_path / "bench_serve.json").read_text())["completed"] == 3
