"""The serving workload on the engine alone (no HTTP, no asyncio): what each kind of step costs
when requests arrive in a burst, beside the static batch-32 decode step. GPU only.

    python benchmarks/engine_steps.py [--requests 96] [--budget 512] [--prompt-len 512] [--output-len 256]

9B config, random bf16 weights; an ``Engine`` of 32 slots x 1024 tokens with ``max_prefill_tokens
= --budget`` (the mixed graphs captured first, as ``fuselm serve`` does); all requests queued at
once (random prompt ids, greedy, ignore_eos), stepped to the end with the step log on. Prints the
output tok/s, then ``benchmarks/step_log.py``'s table: per step kind the duration a decoding
request sees, split into the host's launch work and the wait for the step before; then each
model call the runner made as an eager run or a graph capture (host ms), and the slowest steps
with the runner calls of that step and of the next one (a gap times the step before's GPU work
and the next step's host work). ``--log PATH``: the step log and the runner calls as JSON. ``--sampled``: the served requests'
sampling (the checkpoint's generation_config: temperature 0.6, top-k 20, top-p 0.95) instead of
greedy. Also printed: each runner call (prefill, mixed, decode) on the GPU's clock (CUDA events
before and after it): its host time, its GPU time, the GPU's idle time before it, and the host
syncs made inside the measured run (``torch.cuda.set_sync_debug_mode("warn")``, by call site).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from collections import Counter, defaultdict

import torch

from fuselm.engine import Engine, SamplingParams
from fuselm.models.qwen35.presets import config_9b, random_qwen35
from step_log import gaps, summarise


def record_runner_calls(engine: Engine) -> list[dict]:
    """Wrap ``engine.runner._run_graph`` (a diagnostic hook): each call's graph key, how it ran
    (eager, capture, replay), its host ms and the step it belongs to."""
    calls, runner = [], engine.runner
    run_graph = runner._run_graph

    def logged(key, packed, body):
        mode = "eager" if not key[-1] else "replay" if key in runner._graphs else "capture"
        began = time.perf_counter()
        result = run_graph(key, packed, body)
        calls.append({"step": len(engine.step_log or []), "key": list(key), "mode": mode,
                      "host_ms": 1e3 * (time.perf_counter() - began)})
        return result

    runner._run_graph = logged
    return calls


def record_gpu_timeline(engine: Engine) -> list[dict]:
    """Wrap the runner's prefill, mixed and decode (a diagnostic hook): CUDA events and host
    clock before and after each call. ``gpu_timeline`` turns them into milliseconds."""
    calls, runner = [], engine.runner
    for name in ("prefill", "mixed", "decode"):
        method = getattr(runner, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host_start = time.perf_counter()
            start.record()
            result = _method(*args, **kwargs)
            end.record()
            calls.append({"name": _name, "start": start, "end": end, "host_start": host_start,
                          "host_end": time.perf_counter()})
            return result

        setattr(runner, name, timed)
    return calls


def gpu_timeline(calls: list[dict]) -> str:
    """Per runner call kind: host ms inside the call, GPU ms from its first to its last
    enqueued work (any idle inside included), and the GPU's idle ms before it (from the end of
    the call before: the host was late)."""
    torch.cuda.synchronize()
    rows = defaultdict(lambda: defaultdict(list))
    for before, call in zip([None] + calls, calls):
        row = rows[call["name"]]
        row["host"].append(1e3 * (call["host_end"] - call["host_start"]))
        row["gpu"].append(call["start"].elapsed_time(call["end"]))
        if before is not None:
            row["idle"].append(before["end"].elapsed_time(call["start"]))

    def stats(values):
        ordered = sorted(values) or [float("nan")]
        return " / ".join(f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.2f}" for q in (0.5, 0.9, 0.99))

    lines = ["| runner call | calls | host ms (median / p90 / p99) | GPU ms | GPU idle before ms |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {len(row['host'])} | {stats(row['host'])} | {stats(row['gpu'])} | {stats(row['idle'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--log", default=None, help="write the step log and the runner calls here (JSON)")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.6, top-k 20, top-p 0.95 (else greedy)")
    args = parser.parse_args()
    model = random_qwen35(config_9b(), dtype=torch.bfloat16, device="cuda", seed=0)
    engine = Engine(model, max_batch=32, max_len=1024, max_prefill_tokens=args.budget, seed=0)
    began = time.perf_counter()
    captured = engine.capture_mixed_graphs()
    print(f"## engine steps: {args.requests} requests (prompt {args.prompt_len}, output {args.output_len}) at once, "
          f"budget {args.budget}, {torch.cuda.get_device_name()}\n")
    print(f"mixed graphs captured up front: {captured} in {time.perf_counter() - began:.1f} s\n")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.requests, args.prompt_len), generator=generator).tolist()
    sampling = dict(temperature=0.6, top_k=20, top_p=0.95) if args.sampled else dict(temperature=0.0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **sampling)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True, **sampling))  # warm-up
    engine.step_log = []
    calls = record_runner_calls(engine)
    timeline = record_gpu_timeline(engine)
    syncs = Counter()

    def note_sync(message, category, filename, lineno, file=None, line=None):
        frames = [f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}" for frame in traceback.extract_stack()[:-1]
                  if "warnings" not in frame.filename]
        syncs[f"{str(message)[:80]} <- " + " <- ".join(reversed(frames[-4:]))] += 1

    began = time.perf_counter()
    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = note_sync
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seconds = time.perf_counter() - began
    print(f"output: {args.requests * args.output_len / seconds:,.0f} tok/s over {seconds:.2f} s "
          f"({'sampled' if args.sampled else 'greedy'}; with the CUDA events and sync checks of the tables below)\n")
    print(summarise(engine.step_log))
    print("\n### runner calls on the GPU's clock (CUDA events around each call)\n")
    print(gpu_timeline(timeline))
    print("\n### host syncs in the measured run (sync debug mode, by call site)\n")
    for site, count in syncs.most_common(12):
        print(f"- {count} x {site}")
    if not syncs:
        print("none reported")
    unreplayed = defaultdict(list)
    for call in calls:
        if call["mode"] != "replay":
            unreplayed[(call["mode"], tuple(call["key"]))].append(call["host_ms"])
    print("\n### runner calls not replayed from a graph\n\n| mode | key | calls | host ms (first, median) |\n|---|---|---|---|")
    for (mode, key), host in sorted(unreplayed.items(), key=lambda item: -sum(item[1])):
        print(f"| {mode} | {key} | {len(host)} | {host[0]:.1f}, {sorted(host)[len(host) // 2]:.1f} |")
    by_step = defaultdict(list)
    for call in calls:
        by_step[call["step"]].append(f"{call['mode']} {tuple(call['key'])} {call['host_ms']:.1f} ms")
    index = {id(step): i for i, step in enumerate(engine.step_log)}
    print("\n### slowest 12 gaps: the step timed, then the runner calls of it and of the next step\n")
    for gap, step in sorted(gaps(engine.step_log), key=lambda item: -item[0])[:12]:
        i = index[id(step)]
        print(f"- {gap:.1f} ms, step {i} {step['kind']} (rows {step['decode_rows']}, chunks {step['chunks']}, "
              f"prompt tokens {step['prompt_tokens']}): {by_step.get(i, [])}; next: {by_step.get(i + 1, [])}")
    if args.log:
        with open(args.log, "w") as handle:
            json.dump({"steps": engine.step_log, "calls": calls}, handle)


if __name__ == "__main__":
    main()
