"""``fuselm swapffn``: the Swap-FFN seed config on a GPU. Tokens/s of the reference (eager and
torch.compile), the fused path (eager launches and one CUDA graph per token) and the token's FFN
matrix products alone in cuBLAS; kernels per token; fused-vs-reference parity over a few tokens
(router decisions, free-running stream-map agreement, output relative error)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fuselm.runtime import capture_graph, matrix_rate
from fuselm.testing import rel_err


def _kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _cublas_ffn_products(cfg, batch: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the token step's FFN matrix products alone, by cuBLAS at the step's shapes
    (per FFN step [B*C, D] @ [D, 2F] and [B*C, F] @ [F, D]; no router, norm, SwiGLU or collapse):
    the time any path built on cuBLAS GEMMs, torch.compile's included, spends in them."""
    rows, D, F = batch * cfg.n_cores, cfg.d_model, cfg.d_ff
    x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.empty(rows, 2 * F, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, F, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(2 * F, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    w2 = torch.randn(D, F, device="cuda", dtype=torch.bfloat16) * F**-0.5

    def products():
        for _ in range(cfg.n_events * cfg.k_ffn):
            torch.mm(x, w13.T, out=gate_up)
            torch.mm(h, w2.T, out=x)

    return capture_graph(products)[0]


def run_swap_ffn(batches: list[int], time_compile: bool = True, parity_tokens: int = 4,
                 out: Path | None = None) -> int:
    """Time, count and check the Swap-FFN seed config at each batch size in ``batches`` (GPU;
    on the CPU it says so and returns 0); ``time_compile`` also times torch.compile of the reference;
    ``out``: write swap_ffn.json there."""
    import triton

    from fuselm.models.swap_ffn import FusedSwapFFN, SwapFFN, SwapFFNConfig, SwapFFNDecoder

    if not torch.cuda.is_available():
        print("fuselm swapffn times the GPU paths; no CUDA device here. The CPU tests cover parity.")
        return 0
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    matrix_tflops = matrix_rate()
    cfg = SwapFFNConfig()
    torch.manual_seed(0)
    module = SwapFFN(cfg, device="cuda", dtype=torch.bfloat16).eval()
    print(f"Swap-FFN seed config on {torch.cuda.get_device_name()}, bf16; {cfg.flops_per_token() / 1e9:.1f} GFLOP "
          f"per token; bf16 mm measured {matrix_tflops:.0f} TFLOP/s\n")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "matrix_tflops": matrix_tflops, "flops_per_token": cfg.flops_per_token(), "batches": {}}
    for batch in batches:
        floor_ms = batch * cfg.flops_per_token() / matrix_tflops / 1e9
        x = torch.randn(batch, cfg.d_model, device="cuda", dtype=torch.bfloat16)
        state = module.init_state(batch)
        rows = {}
        with torch.no_grad():
            rows["reference, eager"] = bench(lambda: module.reference_step(x, state.ram, state.stream_map))
            if time_compile:
                for mode in ("default", "reduce-overhead"):
                    step = torch.compile(module.reference_step, mode=mode)
                    start = time.perf_counter()
                    for _ in range(3):
                        step(x, state.ram, state.stream_map)
                    torch.cuda.synchronize()
                    print(f"  torch.compile mode={mode}: compiled and warmed in {time.perf_counter() - start:.0f} s")
                    rows[f"reference, torch.compile {mode}"] = bench(lambda: step(x, state.ram, state.stream_map))
            fused = FusedSwapFFN(module, batch)
            ram, stream_map = state.ram.clone(), state.stream_map.clone()
            rows["fused, eager launches"] = bench(lambda: fused.step(x, ram, stream_map))
            decoder = SwapFFNDecoder(module, batch)
            rows["fused, one CUDA graph"] = bench(lambda: decoder.step(x))
            rows["cuBLAS FFN products alone, one CUDA graph"] = bench(_cublas_ffn_products(cfg, batch).replay)
            kernels = _kernels_per_call(lambda: decoder.step(x))
            # parity over a few tokens, state carried
            ref_state, dec = module.init_state(batch), SwapFFNDecoder(module, batch)
            router, agree, errors = [], [], []
            for _ in range(parity_tokens):
                tok = torch.randn(batch, cfg.d_model, device="cuda", dtype=torch.bfloat16)
                router.append(module.router_agreement(tok, ref_state.ram, ref_state.stream_map))
                y_ref, ref_state = module(tok, ref_state, impl="reference")
                y_fused = dec.step(tok)
                agree.append((ref_state.stream_map == dec.state.stream_map).float().mean().item())
                errors.append(rel_err(y_fused, y_ref))
        best_compile = min((v for k, v in rows.items() if "compile" in k), default=None)
        graph_ms = rows["fused, one CUDA graph"]
        results["batches"][batch] = {"ms_per_step": rows, "floor_ms": floor_ms, "kernels_per_step": kernels,
                                     "graph_launches_per_step": 1, "router_decision_agreement": router,
                                     "free_running_stream_map_agreement": agree, "rel_err": errors}
        print(f"batch {batch}: compute floor {floor_ms:.3f} ms per step")
        print("| path | ms per step | tokens/s | vs eager reference |\n|---|---|---|---|")
        for name, ms in rows.items():
            print(f"| {name} | {ms:.3f} | {batch * 1e3 / ms:.0f} | {rows['reference, eager'] / ms:.1f}x |")
        print(f"fused graph: {100 * floor_ms / graph_ms:.0f}% of the compute floor"
              + (f", {best_compile / graph_ms:.2f}x the best torch.compile" if best_compile else "")
              + f"; {kernels} kernels in 1 graph launch per step")
        print(f"parity (bf16), per token: router decisions agreeing on the reference's state "
              f"{[f'{a:.4f}' for a in router]}; free-running stream-map agreement {[f'{a:.4f}' for a in agree]}; "
              f"y rel err {[f'{e:.2e}' for e in errors]}\n", flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "swap_ffn.json").write_text(json.dumps(results, indent=1))
    return 0
