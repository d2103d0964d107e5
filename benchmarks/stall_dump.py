"""Group the stacks of `fuselm serve --stall-dump PATH`: where the engine thread was, and what
the other threads were doing, when its host work between two steps passed --stall-dump-ms.

    python3 benchmarks/stall_dump.py PATH [--frames 4]

Each dump ("Stall (...)" block, ``Engine.watch_host_stalls``) holds one stack a thread, innermost
frame first; the engine thread's is marked "(engine)". A dump is of a host span (between a read
and the next launches) or of a wait (a step's wait for the one before it, with --stall-dump-wait-ms).
Prints a markdown table of the engine thread's innermost frames by count, then one of the other
threads'.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def dump_phases(text: str) -> list[str]:
    """Each dump's phase: "span" (the host's work between two steps) or "wait" (a step's wait for
    the one before it, and reading its ids)."""
    return ["wait" if " into the wait" in line else "span" for line in text.splitlines() if line.startswith("Stall (")]


def parse(text: str) -> list[list[tuple[str, list[str]]]]:
    """The dumps in ``text``: each a list of (thread, stack), the engine thread's name ending in
    "(engine)", each stack a list of frames ("file.py:line name", innermost first)."""
    dumps: list[list[tuple[str, list[str]]]] = []
    for line in text.splitlines():
        if line.startswith("Stall ("):
            dumps.append([])
        elif line.startswith("Thread ") and dumps:
            dumps[-1].append((line[len("Thread "):].removesuffix(" (most recent call first):"), []))
        elif dumps and dumps[-1] and (match := FRAME.match(line)):
            dumps[-1][-1][1].append(f"{Path(match['path']).name}:{match['line']} {match['name']}")
    return dumps


def summarise(dumps: list[list[tuple[str, list[str]]]], frames: int = 4, phases: list[str] | None = None) -> str:
    """Tables of where the threads were, by count; ``phases``: each dump's ("span" or "wait"), to
    tell a stalled host span from a slow wait."""
    engine, others = collections.Counter(), collections.Counter()
    phases = phases or [""] * len(dumps)
    for dump, phase in zip(dumps, phases):
        for thread, stack in dump:
            where = (f"{phase}: " if phase else "") + (" < ".join(stack[:frames]) or "(no Python frame)")
            if thread.endswith("(engine)"):
                engine[where] += 1
            else:
                others[f"{thread}: {where}"] += 1
    counts = collections.Counter(phases)
    lines = [f"{len(dumps)} stall dumps (innermost {frames} frames, innermost first)"
             + (f": {counts['span']} in host spans, {counts['wait']} in waits" if any(phases) else ""), ""]
    for title, counts in (("engine thread", engine), ("other threads", others)):
        lines += [f"| {title}: where | dumps |", "|---|---|"]
        lines += [f"| `{where}` | {count} |" for where, count in counts.most_common(20)]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--frames", type=int, default=4, help="innermost frames that name a place (4)")
    args = parser.parse_args()
    text = Path(args.path).read_text()
    print(summarise(parse(text), args.frames, dump_phases(text)))


if __name__ == "__main__":
    main()
