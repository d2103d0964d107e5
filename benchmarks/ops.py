"""Time fuselm's elementwise/norm ops against eager PyTorch, torch.compile of the same eager code,
and Liger-Kernel (when installed), in one run, beside the copy bandwidth measured in that run.

    python benchmarks/ops.py [--quick] [--out DIR]

Writes ``ops.json``, ``ops.md`` and ``ops.png`` to DIR (default benchmarks/results/<gpu>/).
Each call is timed twice, both as ``triton.testing.do_bench`` medians (ms) after warm-up:
- GPU time: the call captured once in a CUDA graph, the graph replayed. The device work alone,
  as a model running in a CUDA graph sees it.
- As called: the Python call itself. Where the host takes longer to issue the call than the
  GPU to run it (kernels under ~0.1 ms on our H100 host), this is host time, and it varies with
  the host from run to run.
Ratios are time(baseline) / time(fuselm); "% copy" is bytes moved (each input read once, each
output written once) over GPU time, against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from importlib.metadata import version as package_version
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import fuselm
from fuselm import add_rms_norm, rms_norm, silu_mul
from fuselm.runtime import copy_bandwidth
from timing import results_dir, bench, capture, capture_stream, graph_bench, host_us

try:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
except ImportError:  # the comparison is skipped, and the table says so
    LigerSiLUMulFunction = LigerRMSNormFunction = LigerFusedAddRMSNormFunction = None

EPS = 1e-6
DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- eager baselines (HF)
def eager_silu_mul(gate, up):
    return F.silu(gate) * up


def eager_rms_norm(x, weight):
    """HF LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def eager_add_rms_norm(x, residual, weight):
    s = x + residual
    return eager_rms_norm(s, weight), s


_compiled = {}


def compiled(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


# ----------------------------------------------------------------------------- cases
def backward_timer(forward, inputs, grad):
    """A closure timing only the backward of ``forward(*inputs)`` (graph built once)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = forward(*leaves)
    torch.cuda.current_stream().wait_stream(stream)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def silu_mul_cases(shapes):
    for m, n in shapes:
        gate, up, grad = (torch.randn(m, n, device="cuda", dtype=DTYPE) for _ in range(3))
        fwd = {
            "fuselm": lambda: silu_mul(gate, up),
            "eager": lambda: eager_silu_mul(gate, up),
            "torch.compile": lambda: compiled(eager_silu_mul)(gate, up),
        }
        bwd = {
            "fuselm": backward_timer(silu_mul, (gate, up), grad),
            "eager": backward_timer(eager_silu_mul, (gate, up), grad),
            "torch.compile": backward_timer(compiled(eager_silu_mul), (gate, up), grad),
        }
        if LigerSiLUMulFunction is not None:
            fwd["liger"] = lambda: LigerSiLUMulFunction.apply(gate, up)
            bwd["liger"] = backward_timer(LigerSiLUMulFunction.apply, (gate, up), grad)
        elem = m * n * gate.element_size()
        yield "silu_mul fwd", f"{m}x{n}", 3 * elem, fwd
        yield "silu_mul bwd", f"{m}x{n}", 5 * elem, bwd


def rms_norm_cases(rows, n=4096):
    for m in rows:
        x, residual, grad = (torch.randn(m, n, device="cuda", dtype=DTYPE) for _ in range(3))
        weight = torch.randn(n, device="cuda", dtype=DTYPE)
        norm = {
            "fuselm": lambda: rms_norm(x, weight, EPS),
            "eager": lambda: eager_rms_norm(x, weight),
            "torch.compile": lambda: compiled(eager_rms_norm)(x, weight),
        }
        add = {
            "fuselm": lambda: add_rms_norm(x, residual, weight, EPS),
            "eager": lambda: eager_add_rms_norm(x, residual, weight),
            "torch.compile": lambda: compiled(eager_add_rms_norm)(x, residual, weight),
        }
        bwd = {
            "fuselm": backward_timer(lambda a, w: rms_norm(a, w, EPS), (x, weight), grad),
            "eager": backward_timer(eager_rms_norm, (x, weight), grad),
            "torch.compile": backward_timer(compiled(eager_rms_norm), (x, weight), grad),
        }
        if LigerRMSNormFunction is not None:
            norm["liger"] = lambda: LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "llama", False)
            add["liger"] = lambda: LigerFusedAddRMSNormFunction.apply(x, residual, weight, EPS, 0.0, "llama", False)
            bwd["liger"] = backward_timer(
                lambda a, w: LigerRMSNormFunction.apply(a, w, EPS, 0.0, "llama", False), (x, weight), grad
            )
        elem = m * n * x.element_size()
        yield "rms_norm fwd", f"{m}x{n}", 2 * elem + 2 * n, norm
        yield "add_rms_norm fwd", f"{m}x{n}", 4 * elem + 2 * n, add
        if m > 1:
            yield "rms_norm bwd", f"{m}x{n}", 3 * elem + 2 * n, bwd


# ----------------------------------------------------------------------------- decode: host vs GPU time
def decode_costs(fn, calls: int = 200) -> dict:
    """Host time per call (Python + launch, GPU not waited on), GPU time per call (the same
    call replayed from a CUDA graph), and kernels launched per call (profiler)."""
    host = host_us(fn, calls)
    gpu_us = bench(capture(fn, calls).replay) / calls * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"host_us": host, "gpu_us": gpu_us, "kernels": kernels}


def decode_table():
    x, residual = (torch.randn(1, 4096, device="cuda", dtype=DTYPE) for _ in range(2))
    weight = torch.randn(4096, device="cuda", dtype=DTYPE)
    gate, up = (torch.randn(1, 14336, device="cuda", dtype=DTYPE) for _ in range(2))
    x_grad = x.detach().clone().requires_grad_(True)
    rows = {
        ("rms_norm", "fuselm"): lambda: rms_norm(x, weight, EPS),
        ("rms_norm", "fuselm, input requires grad"): lambda: rms_norm(x_grad, weight, EPS),
        ("rms_norm", "fuselm, torch.ops custom op"): lambda: torch.ops.fuselm.rms_norm(x, weight, EPS, 0.0),
        ("rms_norm", "eager"): lambda: eager_rms_norm(x, weight),
        ("add_rms_norm", "fuselm"): lambda: add_rms_norm(x, residual, weight, EPS),
        ("add_rms_norm", "eager"): lambda: eager_add_rms_norm(x, residual, weight),
        ("silu_mul 1x14336", "fuselm"): lambda: silu_mul(gate, up),
        ("silu_mul 1x14336", "eager"): lambda: eager_silu_mul(gate, up),
    }
    if LigerRMSNormFunction is not None:
        rows[("rms_norm", "liger")] = lambda: LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "llama", False)
        rows[("add_rms_norm", "liger")] = lambda: LigerFusedAddRMSNormFunction.apply(x, residual, weight, EPS, 0.0, "llama", False)
        rows[("silu_mul 1x14336", "liger")] = lambda: LigerSiLUMulFunction.apply(gate, up)
    return [{"op": op, "provider": p, **decode_costs(fn)} for (op, p), fn in rows.items()]


# ----------------------------------------------------------------------------- report
def _table(meta, results, key, with_bandwidth):
    providers = ["fuselm", "liger", "eager", "torch.compile"]
    extra = " fuselm TB/s | % copy |" if with_bandwidth else ""
    lines = ["| op | shape | " + " | ".join(providers) + " |" + extra + " vs liger | vs eager | vs compile |",
             "|---|---|" + "---|" * (len(providers) + 3 + 2 * with_bandwidth)]
    for r in results:
        t = r[key]
        cells = [f"{t[p]:.4f}" if p in t else "-" for p in providers]
        ratio = lambda p: f"{t[p] / t['fuselm']:.2f}" if p in t else "-"  # noqa: E731
        row = f"| {r['op']} | {r['shape']} | " + " | ".join(cells) + " |"
        if with_bandwidth:
            tbps = r["bytes"] / t["fuselm"] / 1e9
            row += f" {tbps:.2f} | {100 * tbps / meta['copy_tbps']:.0f}% |" if r["bytes"] > 1e6 else " - | - |"
        lines.append(row + f" {ratio('liger')} | {ratio('eager')} | {ratio('torch.compile')} |")
    return lines


def render_markdown(meta, results, decode) -> str:
    lines = [
        f"# fuselm ops benchmark: {meta['gpu']}",
        "",
        f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, liger-kernel {meta['liger']}; bf16.",
        f"Command: `{meta['command']}`",
        f"Measured copy bandwidth (read + write): **{meta['copy_tbps']:.2f} TB/s**.",
        "Times: `triton.testing.do_bench` medians in ms. Ratio = time(baseline) / time(fuselm).",
        "",
        "## GPU time per call (the call replayed from a CUDA graph)",
        "",
        *_table(meta, results, "gpu_ms", True),
        "",
        "## As called from Python (do_bench of the eager call; host-bound where the GPU work is short)",
        "",
        *_table(meta, results, "ms", False),
    ]
    if decode:
        lines += [
            "",
            "## Decode shapes: host time vs GPU time per call",
            "Host: wall time per call of a Python loop that does not wait on the GPU (median of 5",
            "loops of 200). GPU: the same call replayed from a CUDA graph. Kernels: launches per call",
            "(torch.profiler).",
            "",
            "| op (1 row) | provider | host µs | GPU µs | kernels |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {d['op']} | {d['provider']} | {d['host_us']:.1f} | {d['gpu_us']:.2f} | {d['kernels']} |" for d in decode]
    return "\n".join(lines) + "\n"


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = ["fuselm", "liger", "eager", "torch.compile"]
    labels = [f"{r['op']}\n{r['shape']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(results)), 4.5))
    width = 0.2
    for i, p in enumerate(providers):
        speed = [r["gpu_ms"]["fuselm"] / r["gpu_ms"][p] if p in r["gpu_ms"] else 0 for r in results]
        ax.bar([j + (i - 1.5) * width for j in range(len(results))], speed, width, label=p)
    ax.set_xticks(range(len(results)), labels, fontsize=7)
    ax.set_ylabel("speed relative to fuselm (higher is faster)")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.legend()
    ax.set_title("fuselm ops, bf16: GPU time (CUDA-graph replay, do_bench medians, one run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the headline shapes only, no decode table")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/<gpu>)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/ops.py needs a CUDA device; nothing timed.")
        return 0
    gpu = torch.cuda.get_device_name()
    out = results_dir(args.out)
    meta = {
        "gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "fuselm": fuselm.__version__,
        "liger": "not installed" if LigerSiLUMulFunction is None else package_version("liger-kernel"),
        "command": " ".join(["python", *sys.argv]), "copy_tbps": copy_bandwidth(),
    }
    silu_shapes = [(8192, 14336), (4096, 4096)] if args.quick else [(8192, 14336), (8192, 18944), (4096, 4096)]
    # Cases are generated lazily: each holds its own tensors only while it is timed.
    cases = itertools.chain(silu_mul_cases(silu_shapes), rms_norm_cases([8192] if args.quick else [8192, 1]))
    results = []
    for op, shape, nbytes, providers in cases:
        ms = {name: bench(fn) for name, fn in providers.items()}
        gpu_ms = {name: graph_bench(fn) for name, fn in providers.items()}
        results.append({"op": op, "shape": shape, "bytes": nbytes, "ms": ms, "gpu_ms": gpu_ms})
        print(f"{op:18s} {shape:12s} " + "  ".join(f"{k}={v:.4f}" for k, v in ms.items()), flush=True)
    decode = [] if args.quick else decode_table()
    (out / "ops.json").write_text(json.dumps({"meta": meta, "results": results, "decode": decode}, indent=1))
    markdown = render_markdown(meta, results, decode)
    (out / "ops.md").write_text(markdown)
    plot(results, out / "ops.png")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
