"""Plots from committed benchmark JSON (no GPU needed).

    python benchmarks/plots.py benchmarks/results/<gpu>

Renders swap_ffn.png (from swap_ffn.json, written by `fuselm swapffn --out`) and gdn.png (from
gdn.json, written by benchmarks/gdn.py) when those files are there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


# Issue 4's speed targets: at least this many times faster than the better torch.compile mode.
SWAP_FFN_TARGET_VS_COMPILE = {"1": 2.2, "8": 1.3}


def swap_ffn(data: dict, path: Path) -> None:
    batches = sorted(data["batches"], key=int)
    fig, axes = plt.subplots(1, len(batches), figsize=(7.5 * len(batches), 4))
    for ax, batch in zip(axes if len(batches) > 1 else [axes], batches):
        row = data["batches"][batch]
        names = list(row["ms_per_step"])
        ax.barh(names, [row["ms_per_step"][n] for n in names])
        ax.axvline(row["floor_ms"], color="k", ls="--", label=f"compute floor {row['floor_ms']:.3f} ms")
        compile_ms = [ms for name, ms in row["ms_per_step"].items() if "compile" in name]
        if compile_ms and batch in SWAP_FFN_TARGET_VS_COMPILE:
            ratio = SWAP_FFN_TARGET_VS_COMPILE[batch]
            ax.axvline(min(compile_ms) / ratio, color="r", ls=":",
                       label=f"target: {ratio}x the best torch.compile, {min(compile_ms) / ratio:.3f} ms")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("ms per token step (log)")
        ax.set_title(f"Swap-FFN seed config, batch {batch}, bf16, {data['gpu']}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gdn(data: dict, path: Path) -> None:
    chunk = [r for r in data["rows"] if r["case"].startswith("chunk B1")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    ts = [int(r["case"].split("T")[1].split()[0]) for r in chunk]
    for name in ("fuselm graph", "fla graph", "fuselm", "fla"):
        axes[0].plot(ts, [r["ms"].get(name, float("nan")) for r in chunk], marker="o",
                     label=name.replace(" graph", " GPU time") if "graph" in name else name + " as called")
    axes[0].set(xscale="log", yscale="log", xlabel="T (B=1, H=16, K=V=128)", ylabel="ms", title="chunked prefill")
    axes[0].legend()
    decode = [r for r in data["rows"] if r["case"].startswith("decode")]
    labels = [f"{r['case'].split()[1]} {k}" for r in decode for k in r["ms"]]
    axes[1].barh(labels, [v * 1e3 for r in decode for v in r["ms"].values()])
    axes[1].set(xscale="log", xlabel="µs (log)", title="decode, HV=32, K=V=128")
    fig.suptitle(f"Gated DeltaNet vs fla-core, bf16, {data['meta']['gpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(folder: str) -> int:
    folder = Path(folder)
    for name, render in (("swap_ffn", swap_ffn), ("gdn", gdn)):
        source = folder / f"{name}.json"
        if source.exists():
            render(json.loads(source.read_text()), folder / f"{name}.png")
            print(f"wrote {folder / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/NVIDIA_H100_80GB_HBM3"))
