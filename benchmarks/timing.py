"""Timing helpers shared by the benchmark scripts (all on the current CUDA device)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

_capture_stream = None


def bench(fn) -> float:
    """``triton.testing.do_bench`` median in ms, after warm-up."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def capture_stream() -> torch.cuda.Stream:
    """The stream graphs are captured on. A backward timed in a graph needs its forward built on
    it too: autograd runs each backward op on its forward op's stream, which must be capturing."""
    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream()
    return _capture_stream


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured in one CUDA graph (after a warm-up call)."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph


def graph_bench(fn) -> float:
    """GPU time of one call: do_bench of ``fn`` replayed from a CUDA graph, in ms."""
    return bench(capture(fn).replay)


def interleaved_graph_bench(providers: dict, rounds: int = 3) -> dict:
    """``graph_bench`` of every provider, in ``rounds`` rounds that each time every provider once
    (so clock drift over the run, e.g. a GPU warming up under GEMMs, hits all alike): the median
    per provider, in ms."""
    graphs = {name: capture(fn) for name, fn in providers.items()}
    times = defaultdict(list)
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(bench(graph.replay))
    return {name: sorted(samples)[len(samples) // 2] for name, samples in times.items()}


def graph_per_call_ms(fn, calls: int = 20) -> float:
    """GPU time per call of ``calls`` calls of ``fn`` captured in one CUDA graph (the graph launch
    amortised over them): do_bench of its replay / calls, in ms."""
    return bench(capture(fn, calls).replay) / calls


def _loop_us(fn, calls: int, include_gpu: bool) -> float:
    """Median of 5 loops of ``calls`` calls, µs per call; the clock stops before (host time) or
    after (``include_gpu``) waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if include_gpu:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[2]


def host_us(fn, calls: int = 200) -> float:
    """Host time per call in µs: median of 5 loops of ``calls`` calls that never wait on the GPU."""
    return _loop_us(fn, calls, include_gpu=False)


def loop_us(fn, calls: int = 200) -> float:
    """Time per call of a Python loop of ``calls`` calls, waiting for the GPU at the end: what a
    caller pays per call, host- or GPU-bound. Median of 5 loops, in µs."""
    return _loop_us(fn, calls, include_gpu=True)


def kernel_breakdown(fn, calls: int = 5, launches: bool = False) -> dict:
    """GPU microseconds per call of each kernel ``fn`` launches (torch.profiler), by the first 60
    characters of its name (kernels that share them add up); with ``launches``, (microseconds,
    launches) per call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us, count = defaultdict(float), defaultdict(int)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            us[e.key[:60]] += e.device_time_total / calls
            count[e.key[:60]] += e.count
    if launches:
        return {name: (round(t, 1), count[name] // calls) for name, t in us.items()}
    return {name: round(t, 1) for name, t in us.items()}


def results_dir(out: Path | None) -> Path:
    """``out``, or benchmarks/results/<gpu name>/; created."""
    out = out or Path(__file__).parent / "results" / torch.cuda.get_device_name().replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_table(out: Path, name: str, table: str, results) -> None:
    """Print a benchmark's markdown ``table`` and write it to ``out``/<name>.md, its ``results``
    to ``out``/<name>.json (``out`` created)."""
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))


def graph_timeline(graph: torch.cuda.CUDAGraph, replays: int = 3) -> list[tuple[str, int, float, float]]:
    """The kernels (and memcpy / memset nodes) of the last of ``replays`` replays of ``graph``
    as (name, stream, start us, end us), start 0 at the replay's first node, from torch.profiler's
    trace (CUPTI records a graph's nodes with their streams)."""
    import json
    import tempfile

    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    events = sorted((e["ts"], e["ts"] + e["dur"], e["name"], int(e["args"].get("stream", e.get("tid", 0))))
                    for e in trace["traceEvents"]
                    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not events:
        return []
    # replays are separated by a host synchronize: split at the largest gaps, keep the last replay
    reach, gap = [], events[0][1]
    for start, end, _, _ in events:
        reach.append(gap)
        gap = max(gap, end)
    largest = sorted(range(1, len(events)), key=lambda i: events[i][0] - reach[i])[-(replays - 1):]
    last = events[max(largest) if replays > 1 and largest else 0:]
    t0 = last[0][0]
    return [(name, stream, start - t0, end - t0) for start, end, name, stream in last]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
