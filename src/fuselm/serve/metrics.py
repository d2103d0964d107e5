"""The server's Prometheus metrics (``GET /metrics``, Prometheus' text format): vLLM's, named as
vLLM names them with ``fuselm:`` in place of ``vllm:``, each labelled with ``model_name``.

    fuselm:num_requests_running         gauge      requests holding an engine slot (prefilling or decoding)
    fuselm:num_requests_waiting         gauge      requests queued for a slot
    fuselm:kv_cache_usage_perc          gauge      the fraction (0-1, as vLLM's) of K/V pages requests hold
    fuselm:prompt_tokens_total          counter    prompt tokens of the requests that drew a first token
                                                   (each sample's, shared prefill or not, as vLLM counts them)
    fuselm:generation_tokens_total      counter    tokens generated
    fuselm:request_success_total        counter    requests ended, by finished_reason: stop, length, abort
    fuselm:time_to_first_token_seconds  histogram  submission to the first token's arrival here
    fuselm:inter_token_latency_seconds  histogram  between two arrivals of a request's tokens (one
                                                   observation an engine step: a step's tokens arrive together)
    fuselm:e2e_request_latency_seconds  histogram  submission to the last token's arrival
    fuselm:request_prompt_tokens        histogram  a finished request's prompt length
    fuselm:request_generation_tokens    histogram  a finished request's output length

The latencies are the HTTP process's clock (``time.perf_counter``): what a client sees, less the
network. The gauges are the engine's, sent with each step's tokens (``EngineLoop``). Recording
costs the HTTP process a few microseconds a step and request, none of the engine's time.
Needs ``prometheus_client`` (``metrics_available``); without it the server runs without
/metrics.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

# vLLM's buckets, with finer ones below 10 ms where a decode step's interval falls
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


def metrics_available() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


def token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class EngineStats:
    """The engine's state after a step, as the engine loop sends it."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class _Timing:
    prompt_tokens: int
    submitted: float
    last: float | None = None  # the arrival of its last tokens so far
    generated: int = 0


class ServerMetrics:
    """The metrics of one served model (module docstring): ``submitted``, ``delta`` and ``refused``
    record a request's life as the engine client sees it, ``engine_stats`` holds the engine's last
    state; ``render()`` is the /metrics answer."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str, max_len: int):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import GaugeMetricFamily

        self.registry = CollectorRegistry()
        self.engine_stats = EngineStats()
        self._model = model_name
        self._requests: dict[str, _Timing] = {}
        labels, values = ["model_name"], [model_name]

        def counter(name, documentation, extra_labels=()):
            return Counter(name, documentation, labels + list(extra_labels), registry=self.registry)

        def histogram(name, documentation, buckets):
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry).labels(*values)

        self._prompt_tokens = counter("fuselm:prompt_tokens", "Prompt tokens of requests that drew a first token.") \
            .labels(*values)
        self._generation_tokens = counter("fuselm:generation_tokens", "Tokens generated.").labels(*values)
        self._success = counter("fuselm:request_success", "Requests ended, by finished_reason.", ["finished_reason"])
        self._ttft = histogram("fuselm:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        self._itl = histogram("fuselm:inter_token_latency_seconds", "Time between a request's token arrivals.",
                              ITL_BUCKETS)
        self._e2e = histogram("fuselm:e2e_request_latency_seconds", "Submission to the last token.", E2E_BUCKETS)
        self._prompt_length = histogram("fuselm:request_prompt_tokens", "A finished request's prompt tokens.",
                                        token_buckets(max_len))
        self._output_length = histogram("fuselm:request_generation_tokens", "A finished request's output tokens.",
                                        token_buckets(max_len))

        metrics = self

        class EngineGauges:  # read at each scrape
            def collect(self):
                stats = metrics.engine_stats
                for name, documentation, value in (
                        ("fuselm:num_requests_running", "Requests holding an engine slot.", stats.running),
                        ("fuselm:num_requests_waiting", "Requests queued for a slot.", stats.waiting),
                        ("fuselm:kv_cache_usage_perc", "Fraction of K/V cache pages in use (0-1).",
                         stats.kv_cache_usage)):
                    family = GaugeMetricFamily(name, documentation, labels=labels)
                    family.add_metric(values, value)
                    yield family

        self.registry.register(EngineGauges())

    def submitted(self, request_id: str, prompt_tokens: int, when: float) -> None:
        self._requests[request_id] = _Timing(prompt_tokens, when)

    def refused(self, request_id: str) -> None:
        """A submission the engine did not take (nothing of it is counted)."""
        self._requests.pop(request_id, None)

    def delta(self, request_id: str, delta, when: float) -> None:
        """A ``RequestDelta`` of the request arrived at ``when``."""
        timing = self._requests.get(request_id)
        if timing is None:
            return
        if delta.token_ids:
            if timing.last is None:
                self._ttft.observe(when - timing.submitted)
                self._prompt_tokens.inc(timing.prompt_tokens)
            else:
                self._itl.observe(when - timing.last)
            timing.last = when
            timing.generated += len(delta.token_ids)
            self._generation_tokens.inc(len(delta.token_ids))
        if delta.last:
            del self._requests[request_id]
            reason = delta.finish_reason if delta.error is None else "abort"
            self._success.labels(self._model, reason).inc()
            self._e2e.observe(when - timing.submitted)
            self._prompt_length.observe(timing.prompt_tokens)
            self._output_length.observe(timing.generated)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
