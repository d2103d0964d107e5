"""Swap-FFN step pieces at the seed config's shapes (D 1024, F 4096; 512 core rows per batch row),
each timed alone (do_bench median): the gate/up kernel per tile config, with the sums of squares
given or summed in its K loop, beside cuBLAS on the same products; the router per geometry; the
sums-of-squares pass; and the whole token step in a CUDA graph with its
kernels (torch.profiler over graph replays), the second FFN step's sums of squares summed in
the gate/up kernel's K loop or by a separate pass.
Writes swap_ffn_sweep.json under --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import bench, capture, kernel_breakdown, results_dir  # noqa: E402

import fuselm.ops.swap_ffn.kernels as kernels  # noqa: E402
from fuselm.models.swap_ffn import FusedSwapFFN, SwapFFN, SwapFFNConfig  # noqa: E402
from fuselm.ops.swap_ffn.kernels import FFNStep, GateUpConfig  # noqa: E402

GATE_UP = [GateUpConfig(*c) for c in [(128, 128, 64, 8, 8, 4, True), (128, 128, 64, 16, 8, 4, True)]]
ROUTER = [(k, w, s) for k in (128, 256, 512) for w in (4, 8) for s in (1, 2, 3)]  # BLOCK_K, warps, stages


def pieces(module: SwapFFN, rows: int) -> dict:
    cfg, dt = module.config, torch.bfloat16
    D, F = cfg.d_model, cfg.d_ff
    x = torch.randn(rows, D, device="cuda", dtype=dt)
    w13 = torch.randn(2 * F, D, device="cuda", dtype=dt) * D**-0.5
    w2 = torch.randn(D, F, device="cuda", dtype=dt) * F**-0.5
    h = torch.empty(rows, F, device="cuda", dtype=dt)
    ss = x.float().pow(2).sum(1)
    out = {"rows": rows, "cublas_us": {}, "gate_up_us": {}, "router_us": {}}
    out["cublas_us"]["gate+up mm"] = bench(lambda: torch.mm(x, w13.T)) * 1e3
    out["cublas_us"]["down mm"] = bench(lambda: torch.mm(h, w2.T)) * 1e3
    flop = 2 * rows * D * 2 * F
    for gu in GATE_UP:
        step = FFNStep(x, w13, h, w2, 1e-6, False, config=gu)
        for given in (True, False):
            us = bench(lambda: step.gate_up(ss if given else None)) * 1e3
            out["gate_up_us"][f"{gu} ss_given={given}"] = us
            print(f"rows {rows} gate_up {gu} ss_given={given}: {us:.1f} us, {flop / us / 1e6:.0f} TFLOP/s", flush=True)
    ram = torch.randn(rows, 4, D, device="cuda", dtype=dt)
    smap = torch.full((rows,), 0xE4, device="cuda", dtype=torch.uint8)
    router = [t.detach() for t in (module.router_norm.weight, module.router_w, module.router_swap_w,
                                   module.router_swap_b, module.bank_w, module.bank_b)]
    saved = (kernels.ROUTER_BLOCK_K, kernels.ROUTER_WARPS, kernels.ROUTER_STAGES)
    for geometry in ROUTER:
        kernels.ROUTER_BLOCK_K, kernels.ROUTER_WARPS, kernels.ROUTER_STAGES = geometry
        us = bench(lambda: kernels.swap_router(x, ram, smap, ss, *router, cfg.eps)) * 1e3
        out["router_us"][f"BLOCK_K {geometry[0]}, {geometry[1]} warps, {geometry[2]} stages"] = us
        print(f"rows {rows} router BLOCK_K {geometry[0]}, {geometry[1]} warps, {geometry[2]} stages: {us:.1f} us", flush=True)
    kernels.ROUTER_BLOCK_K, kernels.ROUTER_WARPS, kernels.ROUTER_STAGES = saved
    for block_m in (4, 8, 16):
        kernels.SS_BLOCK_M = block_m
        out[f"ss pass us, {block_m} rows per program"] = us = bench(lambda: kernels.row_sum_squares(x, ss)) * 1e3
        print(f"rows {rows} ss pass {block_m} rows per program: {us:.1f} us", flush=True)
    print(f"rows {rows} cublas: {out['cublas_us']}", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    module = SwapFFN(SwapFFNConfig(), device="cuda", dtype=torch.bfloat16).eval()
    results = {"gpu": torch.cuda.get_device_name(), "pieces": [], "step": {}}
    with torch.no_grad():
        for batch in args.batches:
            results["pieces"].append(pieces(module, 512 * batch))
        for batch in args.batches:
            x = torch.randn(batch, 1024, device="cuda", dtype=torch.bfloat16)
            state = module.init_state(batch)
            row = results["step"][batch] = {}
            for in_loop in (True, False):
                runner = FusedSwapFFN(module, batch)
                runner.ffn.ss_in_loop = in_loop
                graph = capture(lambda: runner.step(x, state.ram, state.stream_map))
                row[f"graph_ms ss_in_loop={in_loop}"] = bench(graph.replay)
                row[f"kernels_us ss_in_loop={in_loop}"] = kernel_breakdown(graph.replay)
            print(f"batch {batch}: {json.dumps(row, indent=0)}", flush=True)
    (results_dir(args.out) / "swap_ffn_sweep.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
