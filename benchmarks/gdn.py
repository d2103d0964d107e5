"""Gated DeltaNet kernels against flash-linear-attention (fla-core), bf16, in one run.

    python benchmarks/gdn.py [--out DIR]

Chunked prefill (GPU time, do_bench median) over a T sweep at B=1 H=16 K=V=128 and at B=4
T=2048; decode (T=1, HV=32, K=V=128) as called from Python and replayed in a CUDA graph, with the
state's read+write bandwidth. Writes ``gdn.md`` and ``gdn.json``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from fuselm.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent, fused_recurrent_gated_delta_rule
from fuselm.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_kernels
from timing import bench, capture, copy_bandwidth, graph_bench, results_dir

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
except ImportError:
    fla_chunk = fla_recurrent = None

DT = torch.bfloat16
GRAPH_CALLS = 20  # decode calls per captured graph for the per-call GPU time
default_geometry = (fused_recurrent.BLOCK_V, fused_recurrent.NUM_WARPS)


def rel_rmse(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def make(B, T, H, HV, K=128, V=128):
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=DT) for _ in range(2))
    v = torch.randn(B, T, HV, V, device="cuda", dtype=DT)
    g = -torch.rand(B, T, HV, device="cuda") * 0.5
    beta = torch.rand(B, T, HV, device="cuda")
    return q, k, v, g, beta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gdn.py needs a CUDA device; nothing timed.")
        return 0
    out = results_dir(args.out)
    copy = copy_bandwidth()
    rows = []
    for B, T, H in [(1, 512, 16), (1, 2048, 16), (1, 8192, 16), (1, 32768, 16), (4, 2048, 16)]:
        q, k, v, g, beta = make(B, T, H, H)
        args = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        fns = {"fuselm": lambda: chunk_gated_delta_rule(q, k, v, g, beta, **args)}
        for block_v in (16, 32, 64):  # the recurrence's value-column split, swept
            fns[f"fuselm BV{block_v}"] = lambda bv=block_v: chunk_gated_delta_rule_kernels(
                *(t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)), 128**-0.5, None, True, True,
                torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32), block_v=bv)
        if fla_chunk is not None:
            fns["fla"] = lambda: fla_chunk(q, k, v, g, beta, **args)
        ms, err = {}, {}
        for name, fn in fns.items():
            try:
                ms[name] = bench(fn)
            except Exception as error:  # recorded, not fatal
                ms[name + " error"] = str(error).splitlines()[0][:120]
        if fla_chunk is not None:  # agreement of the two implementations, o and final state
            (o, s), (o_fla, s_fla) = fns["fuselm"](), fns["fla"]()
            err = {"o": rel_rmse(o, o_fla), "final_state": rel_rmse(s, s_fla)}
        rows.append({"case": f"chunk B{B} T{T} H{H}", "ms": ms, "rel_rmse_vs_fla": err})
        print(rows[-1], flush=True)
    for B in (1, 32):
        q, k, v, g, beta = make(B, 1, 16, 32)
        state = torch.randn(B, 32, 128, 128, device="cuda")
        fns = {"fuselm": lambda: fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)}
        if fla_recurrent is not None:
            fns["fla"] = lambda: fla_recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        ms = {}
        for name, fn in fns.items():
            ms[name + " as called"] = bench(fn)
            ms[name + " graph"] = graph_bench(fn)  # one call per replay (the anchors' measure)
            ms[name + " graph per call"] = bench(capture(fn, calls=GRAPH_CALLS).replay) / GRAPH_CALLS
        sweep = {}
        for block_v, warps in itertools.product((8, 16, 32, 64), (1, 2, 4, 8)):
            fused_recurrent.BLOCK_V, fused_recurrent.NUM_WARPS = block_v, warps
            sweep[f"BV{block_v} w{warps}"] = bench(capture(fns["fuselm"], calls=GRAPH_CALLS).replay) / GRAPH_CALLS
        fused_recurrent.BLOCK_V, fused_recurrent.NUM_WARPS = default_geometry
        state_bytes = 2 * state.numel() * 4
        rows.append({"case": f"decode B{B} HV32 K=V=128", "ms": ms, "geometry_sweep_ms_per_call": sweep,
                     "state_tbps": {n: state_bytes / t / 1e9 for n, t in ms.items() if "graph" in n}})
        print(rows[-1], flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_tbps": copy, "command": "python " + " ".join(sys.argv)}
    (out / "gdn.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Gated DeltaNet vs fla-core, bf16: {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}; copy {copy:.2f} TB/s. "
             f"Command: `{meta['command']}`. do_bench medians in ms (chunk: as called, "
             "host time hidden at these sizes; decode: as called and CUDA-graph replay).", "", "| case | times (ms) |", "|---|---|"]
    lines += [f"| {r['case']} | " + ", ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
                                            for k, v in r["ms"].items()) + " |" for r in rows]
    (out / "gdn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
