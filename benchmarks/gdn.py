"""Gated DeltaNet kernels against flash-linear-attention (fla-core), bf16, in one run.

    python benchmarks/gdn.py --cases chunk --out DIR; python benchmarks/gdn.py --cases decode --out DIR

Chunked prefill over a T sweep at B=1 H=16 K=V=128 and at B=4 T=2048: as called and as GPU time
(CUDA-graph replay), agreement with fla (rel. RMSE of o and final state), fuselm's time per
kernel (torch.profiler) and, at T >= 8192, a sweep of the kernels' geometry. Decode (T=1,
HV=32, K=V=128, with and without programmatic dependent launch): as called (a Python loop of
calls), one call per graph replay, and per call of 20 in one graph (the providers alternating,
median of 5), with the state's read+write bandwidth, a one-store
kernel's time per call (the launch floor) and a sweep of the decode kernel's geometry. Writes
(merges into) ``gdn.md`` and ``gdn.json``.
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
import triton.language as tl

from fuselm.ops.gated_delta_rule import chunk, chunk_gated_delta_rule, fused_recurrent, fused_recurrent_gated_delta_rule
from fuselm.runtime import copy_bandwidth
from fuselm.testing import rel_err
from timing import bench, capture, graph_bench, graph_per_call_ms, kernel_breakdown, loop_us, results_dir

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
except ImportError:
    fla_chunk = fla_recurrent = None

DT = torch.bfloat16
GRAPH_CALLS = 20  # decode calls per captured graph for the per-call GPU time
ROUNDS = 5  # alternating measurements of each provider's per-call time (median kept)
default_geometry = (fused_recurrent.BLOCK_V, fused_recurrent.NUM_WARPS)
default_recurrence = (chunk.RECURRENCE_WARPS, chunk.RECURRENCE_STAGES)
default_parallel = (chunk.PREPARE_WARPS, chunk.OUTPUT_WARPS, chunk.OUTPUT_BLOCK_V)


@triton.jit
def _one_store(ptr):
    """The smallest kernel: its time per call in a graph is the launch floor any decode kernel pays."""
    tl.store(ptr, 0.0)


def make(B, T, H, HV, K=128, V=128):
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=DT) for _ in range(2))
    v = torch.randn(B, T, HV, V, device="cuda", dtype=DT)
    g = -torch.rand(B, T, HV, device="cuda") * 0.5
    beta = torch.rand(B, T, HV, device="cuda")
    return q, k, v, g, beta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", default="chunk,decode", help="comma-separated subset of chunk,decode")
    # fla-core 0.6.0's fused_recurrent faulted (illegal address) at B=32 whenever other fla calls
    # (its B=1 decode, or its chunk kernels) ran before it in the same process (four H100 runs;
    # fuselm's own B=32 timings completed each time). So: B=32 first, and decode in its own
    # process: `gdn.py --cases chunk; gdn.py --cases decode` (the second merges into gdn.json).
    parser.add_argument("--decode-batches", default="32,1")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gdn.py needs a CUDA device; nothing timed.")
        return 0
    out = results_dir(args.out)
    copy = copy_bandwidth()
    rows = []
    chunk_cases = [(1, 512, 16), (1, 2048, 16), (1, 8192, 16), (1, 32768, 16), (4, 2048, 16)]
    for B, T, H in chunk_cases if "chunk" in args.cases else []:
        q, k, v, g, beta = make(B, T, H, H)
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        fns = {"fuselm": lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw)}
        if fla_chunk is not None:
            fns["fla"] = lambda: fla_chunk(q, k, v, g, beta, **kw)
        ms, err, sweep = {}, {}, {}
        for name, fn in fns.items():
            try:
                ms[name] = bench(fn)
                ms[name + " graph"] = graph_bench(fn)  # GPU time without the host: replayed from a CUDA graph
            except Exception as error:  # recorded, not fatal
                ms[name + " error"] = str(error).splitlines()[0][:120]
        if fla_chunk is not None:  # agreement of the two implementations, o and final state
            (o, s), (o_fla, s_fla) = fns["fuselm"](), fns["fla"]()
            err = {"o": rel_err(o, o_fla), "final_state": rel_err(s, s_fla)}
        if T >= 8192:  # the recurrence's geometry, in GPU time
            packed = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            for block_v, warps, stages in itertools.product((16, 32, 64), (4, 8), (2, 3, 4)):
                chunk.RECURRENCE_WARPS, chunk.RECURRENCE_STAGES = warps, stages
                sweep[f"BV{block_v} w{warps} s{stages}"] = graph_bench(lambda: chunk.chunk_gated_delta_rule_kernels(
                    *packed, 128**-0.5, None, True, True, seq_len=T, block_v=block_v))
            chunk.RECURRENCE_WARPS, chunk.RECURRENCE_STAGES = default_recurrence
            # the parallel kernels' geometry: prepare warps, output warps and value columns
            for prepare_warps, output_warps, output_v in itertools.product((4, 8), (4, 8), (64, 128)):
                chunk.PREPARE_WARPS, chunk.OUTPUT_WARPS, chunk.OUTPUT_BLOCK_V = prepare_warps, output_warps, output_v
                sweep[f"prepare w{prepare_warps} output w{output_warps} BV{output_v}"] = graph_bench(
                    lambda: chunk.chunk_gated_delta_rule_kernels(*packed, 128**-0.5, None, True, True, seq_len=T))
            chunk.PREPARE_WARPS, chunk.OUTPUT_WARPS, chunk.OUTPUT_BLOCK_V = default_parallel
        rows.append({"case": f"chunk B{B} T{T} H{H}", "ms": ms, "rel_rmse_vs_fla": err,
                     "kernels_us": kernel_breakdown(fns["fuselm"]), "recurrence_sweep_ms": sweep})
        print(rows[-1], flush=True)
    for B in map(int, args.decode_batches.split(",")) if "decode" in args.cases else []:
        q, k, v, g, beta = make(B, 1, 16, 32)
        state = torch.randn(B, 32, 128, 128, device="cuda")
        fns = {"fuselm": lambda: fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)}

        def without_pdl():  # the same kernel launched plainly (programmatic dependent launch off)
            fused_recurrent.PDL = False
            try:
                return fns["fuselm"]()
            finally:
                fused_recurrent.PDL = True

        fns["fuselm no-PDL"] = without_pdl
        if fla_recurrent is not None:
            fns["fla"] = lambda: fla_recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        ms = {}
        for name, fn in fns.items():
            ms[name + " graph"] = graph_bench(fn)  # one call per replay (the anchors' measure)
            print(B, name, "graph", ms[name + " graph"], flush=True)
        # As called (a Python loop of calls, GPU included: do_bench's per-call timing of a host-bound
        # call swung 7-80 us between rounds), and per call of 20 in one graph: the providers
        # alternate, ROUNDS times each, medians kept (the GPU's clocks and the host drift over a
        # run: one measurement each, in a fixed order, favoured or penalised the first).
        graphs = {name: capture(fn, calls=GRAPH_CALLS) for name, fn in fns.items()}
        rounds = {name: [] for name in fns}
        called = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, graph in graphs.items():
                called[name].append(loop_us(fns[name]) / 1000)
                rounds[name].append(bench(graph.replay) / GRAPH_CALLS)
        for name in fns:
            ms[name + " as called"] = sorted(called[name])[len(called[name]) // 2]
            ms[name + " graph per call"] = sorted(rounds[name])[len(rounds[name]) // 2]
            print(B, name, "as called", called[name], "per call", rounds[name], flush=True)
        scratch = torch.empty(1, device="cuda")
        ms["one-store kernel graph per call"] = graph_per_call_ms(lambda: _one_store[(1,)](scratch), GRAPH_CALLS)
        ms["one-store kernel graph"] = graph_bench(lambda: _one_store[(1,)](scratch))  # a graph launch's floor
        sweep = {}
        for block_v, warps in itertools.product((8, 16, 32), (1, 2, 4)):
            fused_recurrent.BLOCK_V, fused_recurrent.NUM_WARPS = block_v, warps
            sweep[f"BV{block_v} w{warps}"] = graph_per_call_ms(fns["fuselm"], GRAPH_CALLS)
            torch.cuda.synchronize()
            print(B, block_v, warps, sweep[f"BV{block_v} w{warps}"], flush=True)
        fused_recurrent.BLOCK_V, fused_recurrent.NUM_WARPS = default_geometry
        state_bytes = 2 * state.numel() * 4
        rows.append({"case": f"decode B{B} HV32 K=V=128", "ms": ms, "graph_per_call_rounds_ms": rounds,
                     "as_called_rounds_ms": called,
                     "geometry_sweep_ms_per_call": sweep,
                     "state_tbps": {n: state_bytes / t / 1e9 for n, t in ms.items() if "graph" in n and "one-store" not in n}})
        print(rows[-1], flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_tbps": copy, "command": "python " + " ".join(sys.argv)}
    previous = json.loads((out / "gdn.json").read_text()) if (out / "gdn.json").exists() else {"rows": [], "runs": []}
    runs = [r for r in previous.get("runs", []) if r["cases"] != args.cases] + [dict(meta, cases=args.cases)]
    rows = [r for r in previous["rows"] if r["case"].split()[0] not in args.cases.split(",")] + rows
    (out / "gdn.json").write_text(json.dumps({"meta": meta, "runs": runs, "rows": rows}, indent=1))
    lines = [f"# Gated DeltaNet vs fla-core, bf16: {meta['gpu']}", ""]
    lines += [f"- {r['cases']}: {r['date']}; torch {r['torch']}, triton {r['triton']}; copy {r['copy_tbps']:.2f} TB/s; "
              f"`{r['command']}`" for r in runs]
    lines += ["", "do_bench medians in ms: as called, and GPU time replayed from a CUDA graph (decode: one call "
              f"per replay, and per call of {GRAPH_CALLS} captured in one graph; decode as called: a Python loop "
              "of 200 calls, GPU included, median of 5 alternating rounds).", "", "| case | times (ms) |", "|---|---|"]
    lines += [f"| {r['case']} | " + ", ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
                                            for k, v in r["ms"].items()) + " |" for r in rows]
    (out / "gdn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
