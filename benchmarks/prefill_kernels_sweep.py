"""Tile sweeps of prefill kernels that ran far from the copy rate in the 9B mixed step (NOTES.md
50-52): the Gated DeltaNet causal conv (``causal_conv1d_silu``: 11 us a layer for 224 tokens x 8192
channels), the MLP's SwiGLU over the cuBLAS gate/up product's column pairs
(``swiglu_pairs_forward_kernel``: 10.6 us for 255 x 12288), and the chunk kernels' warps at short
prompts (the prepare: 13 us a layer at 33 tokens as at 224). Each case: 20 calls in one CUDA graph,
do_bench median per call; % = bytes moved / time / the copy rate measured in the same run.

    python benchmarks/prefill_kernels_sweep.py [--only conv|swiglu|chunk] [--out DIR]
    (writes prefill_kernels_sweep.md/.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import fuselm.ops.causal_conv1d.kernels as conv_kernels
import fuselm.ops.gated_delta_rule.chunk as chunk
from fuselm.ops.causal_conv1d import causal_conv1d_silu
from fuselm.ops.common.activation import Activation
from fuselm.ops.silu_mul import kernels as silu_kernels
from timing import bench, graph_per_call_ms, results_dir


def copy_rate() -> float:
    """Bytes per ms of a 1 GB device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / bench(lambda: dst.copy_(src))


def conv_rows(rate: float) -> list[dict]:
    rows = []
    C, K = 8192, 4  # Qwen3.5-9B: conv_dim 8192, kernel 4, read from the in_proj output's slice
    for T in (224, 8192):
        proj = torch.randn(1, T, C + 4160, device="cuda", dtype=torch.bfloat16)
        x = proj[..., :C]
        weight = torch.randn(C, 1, K, device="cuda", dtype=torch.bfloat16)
        state = torch.randn(4, C, K, device="cuda", dtype=torch.bfloat16)
        slots, starts, lengths = (torch.tensor([v], device="cuda") for v in (1, 0, T))
        ref = causal_conv1d_silu(x, weight, state.clone(), slots, starts, lengths)
        moved = 2 * T * C * 2
        # (128-token and 256-channel tiles spilled in the first sweep: 0.2-6.5 ms; not swept again)
        for block_t, block_c, warps in itertools.product((16, 32, 64), (64, 128), (2, 4, 8)):
            conv_kernels.CONV_BLOCK_T, conv_kernels.CONV_BLOCK_C, conv_kernels.CONV_WARPS = block_t, block_c, warps
            try:
                out = causal_conv1d_silu(x, weight, state.clone(), slots, starts, lengths)
                ms = graph_per_call_ms(lambda: causal_conv1d_silu(x, weight, state, slots, starts, lengths))
            except Exception as exc:  # noqa: BLE001 (out of resources at some tiles)
                rows.append(dict(kernel="conv", T=T, tile=f"{block_t}x{block_c} w{warps}", error=type(exc).__name__))
                continue
            rows.append(dict(kernel="conv", T=T, tile=f"{block_t}x{block_c} w{warps}", ms=ms,
                             pct=100 * moved / ms / rate, exact=bool(torch.equal(out, ref))))
    conv_kernels.CONV_BLOCK_T, conv_kernels.CONV_BLOCK_C, conv_kernels.CONV_WARPS = 32, 128, 4
    return rows


def swiglu_rows(rate: float) -> list[dict]:
    rows = []
    act = Activation.parse("silu")
    F = 12288
    for M in (255, 1024):
        gate_up = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, F, device="cuda", dtype=torch.bfloat16)
        ref = silu_kernels.swiglu_pairs_forward_kernel(gate_up, out.clone(), act)
        moved = 3 * M * F * 2
        geometries = [silu_kernels.row_geometry(F)] + [silu_kernels.Geometry(m, n, w) for m, n, w in (
            (1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (1, 2048, 4), (1, 2048, 8), (2, 2048, 8), (4, 512, 4),
            (1, 4096, 8), (8, 256, 4))]
        for geo in geometries:
            def run():
                silu_kernels._silu_mul_fwd_kernel[silu_kernels._grid(M, F, geo)](
                    gate_up, gate_up[:, 1:], out, M, F, gate_up.stride(0), gate_up.stride(0), out.stride(0),
                    act.kernel_limit, float(act.alpha), ACT=act.code, BLOCK_M=geo.block_m, BLOCK_N=geo.block_n,
                    COL_STRIDE=2, num_warps=geo.num_warps)
            run()
            ms = graph_per_call_ms(run)
            rows.append(dict(kernel="swiglu_pairs", M=M, tile=f"{geo.block_m}x{geo.block_n} w{geo.num_warps}", ms=ms,
                             pct=100 * moved / ms / rate, exact=bool(torch.equal(out, ref))))
    return rows


def chunk_rows() -> list[dict]:
    """The three chunk kernels as the 9B prefill calls them (H 16, HV 32, K = V = 128, bf16, q/k/v
    slices of the conv output, a fresh pool state), by the prepare and output kernels' warps: a
    short prompt runs one program a (chunk, head), so each program's latency is the step's."""
    rows = []
    H, HV, K, V = 16, 32, 128, 128
    for T in (33, 224, 8192):
        conv_out = torch.randn(1, T, 2 * H * K + HV * V, device="cuda", dtype=torch.bfloat16)
        q = conv_out[..., :H * K].unflatten(-1, (H, K))
        k = conv_out[..., H * K:2 * H * K].unflatten(-1, (H, K))
        v = conv_out[..., 2 * H * K:].unflatten(-1, (HV, V))
        g = -torch.rand(1, T, HV, device="cuda")
        beta = torch.rand(1, T, HV, device="cuda", dtype=torch.bfloat16)
        pool = torch.zeros(4, HV, K, V, device="cuda")
        slots, fresh = torch.tensor([1], device="cuda"), torch.tensor([False], device="cuda")
        out = torch.empty(1, T, HV, V, device="cuda", dtype=torch.bfloat16)

        def run():
            chunk.chunk_gated_delta_rule(q, k, v, g, beta, K ** -0.5, pool, True, True, state_indices=slots,
                                         has_initial_state=fresh, out=out)
        for prepare, output in itertools.product((2, 4, 8), (2, 4, 8)):
            chunk.PREPARE_WARPS, chunk.OUTPUT_WARPS = prepare, output
            run()
            rows.append(dict(kernel="gdn_chunk", T=T, tile=f"prepare w{prepare}, output w{output}",
                             ms=graph_per_call_ms(run), pct=None, exact=True))
    chunk.PREPARE_WARPS, chunk.OUTPUT_WARPS = 4, 4
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=("conv", "swiglu", "chunk"), default=None, help="sweep one kernel")
    args = parser.parse_args()
    rate = copy_rate()
    sweeps = {"conv": lambda: conv_rows(rate), "swiglu": lambda: swiglu_rows(rate), "chunk": chunk_rows}
    rows = [row for name, sweep in sweeps.items() if args.only in (None, name) for row in sweep()]
    lines = [f"## prefill kernels by tile, {torch.cuda.get_device_name()} (copy {rate / 1e9:.2f} TB/s)", "",
             "| kernel | size | tile (rows x cols, warps) | us | % of copy | exact |", "|---|---|---|---|---|---|"]
    for r in rows:
        size = f"T {r['T']}" if "T" in r else f"M {r['M']}"
        if "error" in r:
            lines.append(f"| {r['kernel']} | {size} | {r['tile']} | {r['error']} | | |")
        else:
            pct = "-" if r["pct"] is None else f"{r['pct']:.0f}%"
            lines.append(f"| {r['kernel']} | {size} | {r['tile']} | {1e3 * r['ms']:.2f} | {pct} | {r['exact']} |")
    out = results_dir(Path(args.out) if args.out else None)
    (out / "prefill_kernels_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "prefill_kernels_sweep.json").write_text(json.dumps(dict(copy_bytes_per_ms=rate, rows=rows), indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
