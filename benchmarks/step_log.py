"""Summarise an engine step log (``fuselm serve --step-log PATH``): how long each kind of step
takes as a decoding request sees it, and which steps make the slowest 1%.

    python benchmarks/step_log.py PATH [--skip-first 0] [--split-gap 1.0]

The engine enqueues step n and then reads step n-1's ids, so the gap between the "read" times of
steps n-1 and n is step n-1's duration (its GPU time when the GPU is the bottleneck, else the
host's work) — the inter-token latency of every request decoding in it. Gaps are attributed to
the kind of the step they time: decode, mixed (prompt chunks + decode in one pass), prefill (no
decode rows), prefill+decode (a prefill step with a decode step behind it). Idle steps (nothing
to run) and the gap after them are left out. Prints a markdown table per kind (count, share,
median, p90, p99, max, mean prompt tokens, mean decode rows; and the host's share of each step:
median ms from the step's start to its last launch, "host launch", and from there to having read
the step before's ids, "wait": a server's streaming of the tokens read before is in it), the
decode rows a step and the decode tokens/s they make over the run's time, where the requests were
(decoding, prefilling, queued: ``occupancy``), how long closed-loop clients took from a step
that finished their request to their next submission (``round_trips``), each kind's GPU time a
step (CUDA events,
``gpu_times``), the steps over their kind's median + 1 ms by the part that grew (``slow_steps``),
and the kinds / sizes of the slowest 1% of gaps, each with its GPU time, the host's span from
reading the step before to launching the next (longer than the step's GPU time: the GPU waited
for the host), the engine thread's CPU time, page faults and context switches over it
(``host_spans`` sets the spans over 10 ms apart from the rest) and the garbage collections within
it (the log's "gc" entries, which ``fuselm serve --step-log`` records in the engine process and,
marked "process": "http", in the HTTP process), for each run of steps
without a pause of more than --split-gap seconds (a server's benchmarks, one after another, come
out as separate runs).
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import Counter

SLOW_HOST_MS = 10.0  # host spans longer than this are set apart in host_spans


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_pairs(steps: list[dict]) -> list[tuple[float, dict, dict]]:
    """(duration in ms, the step it times, the step after) for each pair of consecutive non-idle steps."""
    return [(1e3 * (after["read"] - before["read"]), before, after) for before, after in zip(steps, steps[1:])
            if before["kind"] != "idle" and after["kind"] != "idle"]


def gaps(steps: list[dict]) -> list[tuple[float, dict]]:
    """(duration in ms, the step it times) for each pair of consecutive non-idle steps."""
    return [(gap, before) for gap, before, _ in timed_pairs(steps)]


def gc_ms(pauses: list[dict], start: float, end: float) -> float:
    """Milliseconds of the garbage collections in ``pauses`` that fall within [start, end]."""
    return 1e3 * sum(max(0.0, min(end, p["read"]) - max(start, p["began"])) for p in pauses)


def span_usage(before: dict, after: dict) -> list[float] | None:
    """The engine thread's use over the host span from ``before``'s read to ``after``'s launch
    (logs with usage_read / usage_launched): [CPU ms, minor page faults, voluntary context
    switches, involuntary ones]."""
    return usage_between(before.get("usage_read"), after.get("usage_launched"))


def usage_between(first: list[float] | None, last: list[float] | None) -> list[float] | None:
    """The engine thread's use from one ``thread_usage`` reading to a later one: [CPU ms, minor
    page faults, voluntary context switches, involuntary ones] (None without both)."""
    if not first or not last:
        return None
    return [1e3 * (last[0] - first[0])] + [b - a for a, b in zip(first[1:], last[1:])]


def wait_usage(items: list[tuple[float, dict, dict]]) -> str | None:
    """The mean wait (from a step's launches to its read) of ``items`` (timed pairs), with the
    engine thread's CPU time and voluntary switches over it (None without usage readings)."""
    usages = [usage for _, _, after in items
              if (usage := usage_between(after.get("usage_launched"), after.get("usage_read"))) is not None]
    if not usages:
        return None
    wait_ms = sum(1e3 * (after["read"] - after["launched"]) for _, _, after in items) / len(items)
    return (f"wait {wait_ms:.2f} ms, CPU {sum(u[0] for u in usages) / len(usages):.2f} ms, "
            f"{sum(u[2] for u in usages) / len(usages):.1f} voluntary switches")


def usage_text(usage: list[float]) -> str:
    count = lambda n: f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"  # noqa: E731 (means are not whole)
    return (f"CPU {usage[0]:.1f} ms, faults {count(usage[1])}, switches {count(usage[2])} voluntary / "
            f"{count(usage[3])} involuntary")


def why(before: dict, after: dict, pauses: list[dict]) -> str:
    """What a gap's host did: the span from reading the step before to launching the next one
    (when it is longer than the GPU's step, the GPU waited), the engine thread's CPU use and
    context switches over that span, and the collections within the gap."""
    parts = []
    if "gpu_ms" in before:
        parts.append(f"GPU {before['gpu_ms']:.1f} ms")
    if "launched" in after:
        parts.append(f"host {1e3 * (after['launched'] - before['read']):.1f} ms")
    usage = span_usage(before, after)
    if usage is not None:
        parts.append(usage_text(usage))
    if pauses:
        parts.append(f"gc {gc_ms(pauses, before['read'], after['read']):.1f} ms")
    return f"; {', '.join(parts)}" if parts else ""


def occupancy(timed: list[tuple[float, dict]]) -> list[str]:
    """Where the requests were, on average over the timed steps (logs with running / waiting):
    decoding, holding a slot while their prompt goes in, queued for a slot; and how long the
    requests each step admitted had waited since the server took them (admission_waits_ms)."""
    if not timed or "running" not in timed[0][1]:
        return []
    count = len(timed)
    decoding = sum(step["decode_rows"] for _, step in timed) / count
    running = sum(step["running"] for _, step in timed) / count
    waiting = sum(step["waiting"] for _, step in timed) / count
    waits = [ms for _, step in timed for ms in step["admission_waits_ms"]]
    line = (f"requests a step: {decoding:.2f} decoding, {running - decoding:.2f} prefilling (a slot, no decode row), "
            f"{waiting:.2f} queued")
    if waits:
        line += (f"; {len(waits)} admitted, waited {percentile(waits, 0.5):.1f} ms median, p90 "
                 f"{percentile(waits, 0.9):.1f}, max {max(waits):.1f} from submission to the step that took them")
    return ["", line]


def gpu_times(timed: list[tuple[float, dict]]) -> list[str]:
    """Each kind's GPU time a step (logs with gpu_ms: CUDA events around a step's launches)
    beside its duration: a step longer than its GPU time waited for the host; a GPU time longer
    than usual is the device's (or its queue's) own."""
    parts = []
    for kind in Counter(step["kind"] for _, step in timed):
        ms = [step["gpu_ms"] for _, step in timed if step["kind"] == kind and "gpu_ms" in step]
        if ms:
            parts.append(f"{kind} median {percentile(ms, 0.5):.2f}, p99 {percentile(ms, 0.99):.2f}, "
                         f"max {max(ms):.2f}")
    return ["", "GPU ms a step: " + "; ".join(parts)] if parts else []


def round_trips(timed: list[tuple[float, dict]]) -> list[str]:
    """From each step that finished requests to each later submission (logs with ``finished``):
    with closed-loop clients, how long one took to send its next request after its last token
    was read. The engine's admission wait catches those that come within it; a later one waits
    a step more (and, the prompts going in one chunk a step, may push the next ones too)."""
    if not timed or "finished" not in timed[0][1]:
        return []
    finishes = [step["read"] for _, step in timed if step["finished"]]
    gaps = []
    for _, step in timed:
        for waited_ms in step["admission_waits_ms"]:
            submitted = step["began"] - waited_ms / 1e3
            last = bisect.bisect_right(finishes, submitted) - 1
            if last >= 0:
                gaps.append(1e3 * (submitted - finishes[last]))
    if not gaps:
        return []
    return ["", f"from the last step that finished requests to each submission (closed-loop clients: their round "
                f"trip): median {percentile(gaps, 0.5):.2f} ms, p90 {percentile(gaps, 0.9):.2f}, p99 "
                f"{percentile(gaps, 0.99):.2f}, max {max(gaps):.2f}; over 3 ms {sum(gap > 3 for gap in gaps)}, "
                f"over 5 ms {sum(gap > 5 for gap in gaps)} of {len(gaps)}"]


def gc_line(label: str, pauses: list[dict], start: float, end: float) -> list[str]:
    inside = [p for p in pauses if start <= p["began"] <= end]
    if not inside:
        return []
    longest = max(1e3 * (p["read"] - p["began"]) for p in inside)
    return ["", f"{label}: {gc_ms(inside, start, end):.1f} ms in all, the longest {longest:.1f} ms"]


def summarise(steps: list[dict], pauses: list[dict] = (), http_pauses: list[dict] = ()) -> str:
    """The tables of the module docstring for one run of ``steps``; ``pauses``: the run's garbage
    collections (``{"kind": "gc", "began", "read"}`` entries of the log) in the engine's process,
    ``http_pauses`` those of ``fuselm serve``'s HTTP process (``"process": "http"``)."""
    pauses = list(pauses)
    pairs = timed_pairs(steps)
    timed = [(gap, before) for gap, before, _ in pairs]
    if not timed:
        return "no timed steps"
    lines = ["| step kind | steps | share | median ms | p90 ms | p99 ms | max ms | mean prompt tokens "
             "| mean decode rows | host launch ms | wait ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    kinds = Counter(step["kind"] for _, step in timed)
    for kind, count in kinds.most_common():
        ms = [gap for gap, step in timed if step["kind"] == kind]
        mine = [step for _, step in timed if step["kind"] == kind]
        tokens = sum(step["prompt_tokens"] for step in mine)
        rows = sum(step["decode_rows"] for step in mine)
        split = "| |"
        if all("launched" in step for step in mine):
            host = [1e3 * (step["launched"] - step["began"]) for step in mine]
            wait = [1e3 * (step["read"] - step["launched"]) for step in mine]
            split = f"{percentile(host, 0.5):.2f} | {percentile(wait, 0.5):.2f} |"
        lines.append(f"| {kind} | {count} | {count / len(timed):.1%} | {percentile(ms, 0.5):.2f} | "
                     f"{percentile(ms, 0.9):.2f} | {percentile(ms, 0.99):.2f} | {max(ms):.2f} | "
                     f"{tokens / count:.0f} | {rows / count:.1f} | {split}")
    every = [gap for gap, _ in timed]
    rows = sum(step["decode_rows"] for _, step in timed)
    lines.append(f"| all | {len(timed)} | 100% | {percentile(every, 0.5):.2f} | {percentile(every, 0.9):.2f} | "
                 f"{percentile(every, 0.99):.2f} | {max(every):.2f} | | {rows / len(timed):.1f} | | |")
    # Decode rows over the run's time: the rate at which running requests got tokens (each prompt's
    # first token, from its last chunk, comes beside them).
    lines += ["", f"decode rows a step {rows / len(timed):.2f}, mean step {sum(every) / len(every):.2f} ms: "
                  f"{1e3 * rows / sum(every):,.0f} decode tokens/s"]
    lines += occupancy(timed)
    lines += round_trips(timed)
    lines += gpu_times(timed)
    slowest = sorted(pairs, key=lambda item: -item[0])[:max(1, len(pairs) // 100)]
    lines += ["", f"slowest 1% ({len(slowest)} steps): " + ", ".join(
        f"{gap:.1f} ms {step['kind']} (rows {step['decode_rows']}, chunks {step['chunks']}, "
        f"prompt tokens {step['prompt_tokens']}{why(step, after, pauses)})" for gap, step, after in slowest[:20])]
    lines += host_spans(pairs)
    lines += slow_steps(pairs)
    lines += gc_line("garbage collection in the run", pauses, steps[0]["began"], steps[-1]["read"])
    lines += gc_line("the HTTP process's garbage collection in the run", list(http_pauses), steps[0]["began"],
                     steps[-1]["read"])
    return "\n".join(lines)


def host_spans(pairs: list[tuple[float, dict, dict]], slow_ms: float = SLOW_HOST_MS) -> list[str]:
    """The engine thread's use over its host spans longer than ``slow_ms`` against the others'
    (logs with usage): is a slow span the thread's own work, the kernel's, a wait for a lock (the
    GIL: voluntary switches with little CPU) or a preemption?"""
    spans = [(1e3 * (after["launched"] - before["read"]), span_usage(before, after)) for _, before, after in pairs]
    spans = [(ms, usage) for ms, usage in spans if usage is not None]
    if not spans:
        return []
    lines = []
    for label, chosen in ((f"over {slow_ms:g} ms", [s for s in spans if s[0] > slow_ms]),
                          (f"up to {slow_ms:g} ms", [s for s in spans if s[0] <= slow_ms])):
        if chosen:
            n = len(chosen)
            mean = [sum(values) / n for values in zip(*(usage for _, usage in chosen))]
            lines.append(f"host spans {label}: {n}, mean {sum(ms for ms, _ in chosen) / n:.2f} ms; per span "
                         + usage_text(mean))
    return ["", "engine thread: " + "; ".join(lines)]


def slow_steps(pairs: list[tuple[float, dict, dict]], over_ms: float = 1.0) -> list[str]:
    """The steps more than ``over_ms`` over their kind's median (decode and mixed), split by what
    was longer: the host's span before the next launch (the GPU waited for the host) or the wait
    for the step (its GPU time, or the engine thread getting back to it late); with the engine
    thread's CPU time and voluntary switches in those waits against the other waits' (a wait
    that spins on the GPU has none: switches mean it blocked, on a lock such as the GIL) and,
    with gpu_ms, the steps' GPU time against the others'."""
    lines = []
    for kind in ("decode", "mixed"):
        mine = [(gap, before, after) for gap, before, after in pairs if before["kind"] == kind]
        if len(mine) < 2 or not all("launched" in after for _, _, after in mine):
            continue
        median = percentile([gap for gap, _, _ in mine], 0.5)
        slow = [item for item in mine if item[0] > median + over_ms]
        if not slow:
            lines.append(f"slow {kind} steps (over the median {median:.2f} ms + {over_ms:g}): none")
            continue
        # Which part grew: the host's span or the wait, each against its own median over the kind.
        span_median = percentile([after["launched"] - before["read"] for _, before, after in mine], 0.5)
        wait_median = percentile([after["read"] - after["launched"] for _, _, after in mine], 0.5)
        host_late = sum(after["launched"] - before["read"] - span_median
                        > after["read"] - after["launched"] - wait_median for _, before, after in slow)
        text = (f"slow {kind} steps (over the median {median:.2f} ms + {over_ms:g}): {len(slow)}, "
                f"{sum(gap - median for gap, _, _ in slow):.0f} ms over the median; in {host_late} the host's span "
                f"grew more than the wait, in {len(slow) - host_late} the wait")
        normal = [item for item in mine if item[0] <= median + over_ms]
        slow_waits, normal_waits = wait_usage(slow), wait_usage(normal)
        if slow_waits and normal_waits:
            text += f"; in their waits {slow_waits} (the others: {normal_waits})"
        gpu = [before["gpu_ms"] for _, before, _ in slow if "gpu_ms" in before]
        others = [before["gpu_ms"] for _, before, _ in normal if "gpu_ms" in before]
        if gpu and others:
            text += f"; GPU {sum(gpu) / len(gpu):.2f} ms a step (the others: {sum(others) / len(others):.2f})"
        lines.append(text)
    return [""] + lines if lines else []


def runs(steps: list[dict], split_gap: float) -> list[list[dict]]:
    """The steps cut wherever the engine paused (nothing to do) for more than ``split_gap`` s."""
    out = [[]]
    for step in steps:
        if out[-1] and step["began"] - out[-1][-1]["read"] > split_gap:
            out.append([])
        out[-1].append(step)
    return [run for run in out if run]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--skip-first", type=int, default=0, help="steps to leave out at the start (warm-up)")
    parser.add_argument("--split-gap", type=float, default=1.0, help="a pause (s) that starts a new run")
    args = parser.parse_args()
    with open(args.path) as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    steps = [entry for entry in entries if entry["kind"] != "gc"]
    pauses = [entry for entry in entries if entry["kind"] == "gc" and entry.get("process") != "http"]
    http_pauses = [entry for entry in entries if entry["kind"] == "gc" and entry.get("process") == "http"]
    for i, run in enumerate(runs(steps[args.skip_first:], args.split_gap)):
        print(f"### run {i + 1}: {len(run)} steps over {run[-1]['read'] - run[0]['began']:.1f} s\n")
        print(summarise(run, pauses, http_pauses) + "\n")


if __name__ == "__main__":
    main()
