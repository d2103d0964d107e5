"""Group the stacks of `fuselm serve --stall-dump PATH`: where the engine thread was, and what
the other threads were doing, when its host work between two steps passed --stall-dump-ms.

    python3 benchmarks/stall_dump.py PATH [--frames 4]

Each dump ("Stall (...)" block, ``Engine.watch_host_stalls``) holds one stack a thread, innermost
frame first; the engine thread's is marked "(engine)". Prints a markdown table of the engine
thread's innermost frames by count, then one of the other threads'.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


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


def summarise(dumps: list[list[tuple[str, list[str]]]], frames: int = 4) -> str:
    engine, others = collections.Counter(), collections.Counter()
    for dump in dumps:
        for thread, stack in dump:
            where = " < ".join(stack[:frames]) or "(no Python frame)"
            if thread.endswith("(engine)"):
                engine[where] += 1
            else:
                others[f"{thread}: {where}"] += 1
    lines = [f"{len(dumps)} stall dumps (innermost {frames} frames, innermost first)", ""]
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
    print(summarise(parse(Path(args.path).read_text()), args.frames))


if __name__ == "__main__":
    main()
