"""The bodies of the ``fuselm`` commands that measure (``fuselm.cli`` parses and dispatches to them).

    ops_demo.py   ``fuselm demo``: every op on random inputs vs its float64 reference (error, time)
    swap_ffn.py   ``fuselm swapffn``: Swap-FFN seed config, tokens/s of each path, kernels, parity
    generate.py   ``fuselm generate --config``: random-weight Qwen3.5 throughput through the Engine
                  (prefill and decode tok/s, share of the weight-bandwidth floor)

``fuselm audit``'s body is ``fuselm.engine.audit`` (it counts what the engine launches).
"""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: Path | None, name: str, results: dict, markdown: str) -> None:
    """Write ``out/<name>.json`` and ``out/<name>.md`` (``out`` is created; None writes nothing)
    and say so on stdout."""
    if out is None:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"{name}.md").write_text(markdown)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.md')}")
