"""Swap-FFN step pieces at the seed config's shapes (D 1024, F 4096; 512 core rows per batch row),
each timed per call inside a CUDA graph of 10 calls (do_bench median of the replay / 10): the
gate/up kernel per tile config (sums of squares given) beside cuBLAS on the same products; the
router per geometry, and with no row swapping (how much of it the
swap costs); core_x against torch.addcmul; the sums-of-squares pass per geometry; and the whole token step in a CUDA graph with
its kernels (torch.profiler over graph replays) per gate/up config.
Writes swap_ffn_sweep.json under --out."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import bench, capture, graph_per_call_ms, kernel_breakdown, results_dir  # noqa: E402

import fuselm.ops.swap_ffn.kernels as kernels  # noqa: E402
from fuselm.models.swap_ffn import FusedSwapFFN, SwapFFN, SwapFFNConfig  # noqa: E402
from fuselm.ops.swap_ffn.kernels import FFNStep, GateUpConfig  # noqa: E402

CALLS = 10
GATE_UP = [GateUpConfig(*c) for c in [  # the constants first; the step is timed with the first two
    (128, 128, 64, 8, 8, 4, True),
    (128, 128, 64, 8, 8, 3, True),
]]
ROUTER = [(16, 512, 4, 2), (16, 1024, 4, 2), (32, 512, 8, 2)]  # BLOCK_M, BLOCK_K, warps, stages
CORE_X = [(2, 1024), (4, 1024), (8, 1024), (16, 512)]  # rows, columns per program
SS_PASS = [2, 1, 4, 8]  # rows per program


def per_call_us(fn) -> float:
    return graph_per_call_ms(fn, CALLS) * 1e3


def ffn_operands(cfg: SwapFFNConfig, rows: int):
    """Random FFN-step operands at the config's sizes, bf16: x [rows, D], w13 [2F, D], w2 [D, F],
    h [rows, F] (empty) and x's row sums of squares (fp32)."""
    D, F = cfg.d_model, cfg.d_ff
    x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(2 * F, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    w2 = torch.randn(D, F, device="cuda", dtype=torch.bfloat16) * F**-0.5
    h = torch.empty(rows, F, device="cuda", dtype=torch.bfloat16)
    return x, w13, w2, h, x.float().pow(2).sum(1)


def pieces(module: SwapFFN, rows: int) -> dict:
    cfg, dt = module.config, torch.bfloat16
    D = cfg.d_model
    x, w13, w2, h, ss = ffn_operands(cfg, rows)
    out = {"rows": rows, "cublas_us": {}, "gate_up_us": {}, "router_us": {}, "ss_pass_us": {}}
    out["cublas_us"]["gate+up mm"] = per_call_us(lambda: torch.mm(x, w13.T))
    out["cublas_us"]["down mm"] = per_call_us(lambda: torch.mm(h, w2.T))
    flop = 2 * rows * D * 2 * cfg.d_ff
    for gu in GATE_UP:
        try:
            step = FFNStep(x, w13, h, w2, 1e-6, False, config=gu)
            us = per_call_us(lambda: step.gate_up(ss))
        except Exception as e:  # a config that does not compile or fit: recorded, not fatal
            out["gate_up_us"][str(gu)] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            print(f"rows {rows} gate_up {gu}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        out["gate_up_us"][str(gu)] = us
        print(f"rows {rows} gate_up {gu}: {us:.1f} us, {flop / us / 1e6:.0f} TFLOP/s", flush=True)

    ram = torch.randn(rows, 4, D, device="cuda", dtype=dt)
    smap = torch.full((rows,), 0xE4, device="cuda", dtype=torch.uint8)
    router = [t.detach() for t in (module.router_norm.weight, module.router_w, module.router_swap_w,
                                   module.router_swap_b, module.bank_w, module.bank_b)]
    core_scale, core_shift, _ = module.core_params()
    x_tok = torch.randn(rows // cfg.n_cores, D, device="cuda", dtype=dt)
    core_scale, core_shift = core_scale.detach().contiguous(), core_shift.detach().contiguous()
    out["core_x_us"] = {"addcmul": per_call_us(lambda: torch.addcmul(
        core_shift, x_tok[:, None, :], core_scale, out=x.view(-1, cfg.n_cores, D)))}
    saved = (kernels.CORE_X_BLOCK_M, kernels.CORE_X_BLOCK_D)
    for block in CORE_X:
        kernels.CORE_X_BLOCK_M, kernels.CORE_X_BLOCK_D = block
        out["core_x_us"]["{} x {}".format(*block)] = per_call_us(lambda: kernels.core_x(x, x_tok, core_scale, core_shift))
    kernels.CORE_X_BLOCK_M, kernels.CORE_X_BLOCK_D = saved
    print(f"rows {rows} core_x: {out['core_x_us']}", flush=True)
    no_swap = list(router)
    no_swap[3] = torch.full_like(router[3], -30.0)  # sigmoid(logit - 30) < 0.5: nothing swaps
    kernels.swap_router(x.clone(), ram.clone(), smap.clone(), ss, *router, cfg.eps)
    probe = smap.clone()
    kernels.swap_router(x.clone(), ram.clone(), probe, ss, *router, cfg.eps)
    out["router_rows_swapped"] = float((probe != 0xE4).float().mean())
    saved = (kernels.ROUTER_BLOCK_M, kernels.ROUTER_BLOCK_K, kernels.ROUTER_WARPS, kernels.ROUTER_STAGES)
    for geometry in ROUTER:
        kernels.ROUTER_BLOCK_M, kernels.ROUTER_BLOCK_K, kernels.ROUTER_WARPS, kernels.ROUTER_STAGES = geometry
        name = "BLOCK_M {}, BLOCK_K {}, {} warps, {} stages".format(*geometry)
        for tag, weights in {"": router, " no swap": no_swap}.items():
            if tag and geometry != saved:
                continue
            try:
                us = per_call_us(lambda: kernels.swap_router(x, ram, smap, ss, *weights, cfg.eps))
            except Exception as e:
                out["router_us"][name + tag] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                print(f"rows {rows} router {name}{tag}: failed {type(e).__name__}", flush=True)
                continue
            out["router_us"][name + tag] = us
            print(f"rows {rows} router {name}{tag}: {us:.1f} us", flush=True)
    kernels.ROUTER_BLOCK_M, kernels.ROUTER_BLOCK_K, kernels.ROUTER_WARPS, kernels.ROUTER_STAGES = saved
    saved_ss = kernels.SS_BLOCK_M
    for block_m in SS_PASS:
        kernels.SS_BLOCK_M = block_m
        out["ss_pass_us"][f"{block_m} rows per program"] = us = per_call_us(lambda: kernels.row_sum_squares(x, ss))
        print(f"rows {rows} ss pass {block_m} rows per program: {us:.1f} us", flush=True)
    kernels.SS_BLOCK_M = saved_ss
    print(f"rows {rows} cublas: {out['cublas_us']}", flush=True)
    return out


def in_context(module: SwapFFN, rows: int) -> dict:
    """The gate/up kernel per call as it runs inside the token step rather than back to back:
    CALLS x (gate/up, cuBLAS down) and CALLS x (gate/up, a 128 MB copy that flushes L2), per
    kernel from torch.profiler over replays of that graph."""
    cfg, dt = module.config, torch.bfloat16
    x, w13, w2, h, ss = ffn_operands(cfg, rows)
    x_next = torch.empty_like(x)  # the down product: x itself stays as made (fed back, it decays to zeros)
    flush_src, flush_dst = torch.empty(2, 64 << 20, device="cuda", dtype=dt)
    out = {}
    for gu in [GATE_UP[0]] + [replace(GATE_UP[0], group_m=g) for g in (1, 4, 16, 32)]:
        step = FFNStep(x, w13, h, w2, 1e-6, False, config=gu)
        for tag, after in {"down": lambda: torch.mm(h, w2.T, out=x_next), "flush": lambda: flush_dst.copy_(flush_src)}.items():
            def pattern():
                step.gate_up(ss)
                after()
            name = f"{gu} then {tag}"
            out[name] = kernel_breakdown(capture(pattern, CALLS).replay)
            us = out[name].get("_ffn_gate_up_kernel", float("nan")) / CALLS
            print(f"rows {rows} gate_up per call, each followed by {tag}: {us:.1f} us  {gu}", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    module = SwapFFN(SwapFFNConfig(), device="cuda", dtype=torch.bfloat16).eval()
    results = {"gpu": torch.cuda.get_device_name(), "calls_per_graph": CALLS, "in_context": {}, "pieces": [], "step": {}}
    with torch.no_grad():
        for batch in args.batches:
            results["in_context"][512 * batch] = in_context(module, 512 * batch)
        for batch in args.batches:
            results["pieces"].append(pieces(module, 512 * batch))
        for batch in args.batches:
            x = torch.randn(batch, 1024, device="cuda", dtype=torch.bfloat16)
            state = module.init_state(batch)
            row = results["step"][batch] = {}
            for gu in GATE_UP[:2]:
                runner = FusedSwapFFN(module, batch)
                runner.ffn.config = gu  # same tile sizes as the descriptors
                graph = capture(lambda: runner.step(x, state.ram, state.stream_map))
                row[f"graph_ms {gu}"] = bench(graph.replay)
                row[f"kernels_us {gu}"] = kernel_breakdown(graph.replay)
            print(f"batch {batch}: {json.dumps(row, indent=0)}", flush=True)
    (results_dir(args.out) / "swap_ffn_sweep.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
