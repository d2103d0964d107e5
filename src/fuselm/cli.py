"""The ``fuselm`` command.

    fuselm demo      run every op on fresh random inputs against its float64 reference and print
                     a table: op, shape, dtype, backend, relative error, time per call.
    fuselm swapffn   Swap-FFN at the seed config: tokens/s of the reference (eager and
                     torch.compile) and the fused path (eager and one CUDA graph per token),
                     kernels per token, and fused-vs-reference parity (GPU).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fuselm import Activation, add_rms_norm, gemm_swiglu, interleave_gate_up, rms_norm, silu_mul, swiglu_mlp
from fuselm.ops.activation import gate_factor_ref, up_factor_ref
from fuselm.runtime import INTERPRET
from fuselm.testing import rel_err


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _demo_cases(device: str, dtype: torch.dtype, rows: int, hidden: int, inter: int):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    gate, up = randn(rows, inter, scale=3), randn(rows, inter, scale=3)
    for act in (Activation(), Activation.swiglu_limit(7.0), Activation.swiglu_oai()):
        exact = gate_factor_ref(gate.double(), act) * up_factor_ref(up.double(), act)
        yield f"silu_mul[{act.kind}]", gate.shape, (lambda act=act: silu_mul(gate, up, act)), exact

    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    out, grad = silu_mul(g, u), randn(rows, inter)
    g64, u64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    d_gate_exact = torch.autograd.grad(gate_factor_ref(g64, Activation()) * u64, g64, grad.double())[0]
    yield "silu_mul backward (d_gate)", gate.shape, (
        lambda: torch.autograd.grad(out, (g, u), grad, retain_graph=True)[0]), d_gate_exact

    x, residual = randn(rows, hidden), randn(rows, hidden)
    weight = randn(hidden, scale=0.1)
    for offset, label in ((0.0, "llama"), (1.0, "zero-centered")):
        x64 = x.double()
        exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + weight.double())
        yield f"rms_norm[{label}]", x.shape, (lambda offset=offset: rms_norm(x, weight, 1e-6, offset)), exact
    s64 = x.double() + residual.double()
    exact = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.double())
    yield "add_rms_norm[zero-centered]", x.shape, (lambda: add_rms_norm(x, residual, weight, 1e-6, 1.0)[0]), exact

    if dtype == torch.bfloat16 and device == "cpu":
        return  # the interpreter's bf16 tl.dot is wrong (triton issue 11584): matrix ops on the GPU only
    w_gate, w_up = randn(inter, hidden, scale=hidden**-0.5), randn(inter, hidden, scale=hidden**-0.5)
    w13, w2 = interleave_gate_up(w_gate, w_up), randn(hidden, inter, scale=inter**-0.5)
    h64 = gate_factor_ref(x.double() @ w_gate.double().T, Activation()) * (x.double() @ w_up.double().T)
    yield "gemm_swiglu", (rows, inter), (lambda: gemm_swiglu(x, w13)), h64
    yield "swiglu_mlp", x.shape, (lambda: swiglu_mlp(x, w13, w2)), h64 @ w2.double().T
    x1 = x[:1]
    yield "swiglu_mlp (decode, 1 row)", x1.shape, (lambda: swiglu_mlp(x1, w13, w2)), h64[:1] @ w2.double().T


def demo(args) -> int:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    backend = "triton" if on_gpu else ("triton interpreter" if INTERPRET else "reference (set TRITON_INTERPRET=1)")
    dtypes = [torch.bfloat16, torch.float16] if on_gpu else [torch.float32, torch.float16, torch.bfloat16]
    shape = (4096, 4096, 14336) if on_gpu else (37, 256, 688)
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"fuselm demo on {name}: every op on random inputs vs its float64 reference ({backend})\n")
    print(f"| {'op':30s} | {'shape':13s} | {'dtype':8s} | {'rel. error':>10s} | {'ms/call':>9s} |")
    print(f"|{'-' * 32}|{'-' * 15}|{'-' * 10}|{'-' * 12}|{'-' * 11}|")
    worst = 0.0
    for dtype in dtypes:
        for op, op_shape, fn, exact in _demo_cases(device, dtype, *shape):
            err = rel_err(fn(), exact)
            worst = max(worst, err)
            dims = "x".join(map(str, op_shape))
            print(f"| {op:30s} | {dims:13s} | {str(dtype)[6:]:8s} | {err:10.2e} | {_time_ms(fn):9.4f} |", flush=True)
    print(f"\nworst relative error {worst:.2e} (bf16 rounding is ~4e-3 per element)")
    return 0 if worst < 2e-2 else 1


def _kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _matrix_tflops(bench) -> float:
    """bf16 8192^3 torch.mm rate on random data, TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ a) / 1e9


def swapffn(args) -> int:
    import json

    import triton

    from fuselm.models.swap_ffn import FusedSwapFFN, SwapFFN, SwapFFNConfig, SwapFFNDecoder

    if not torch.cuda.is_available():
        print("fuselm swapffn times the GPU paths; no CUDA device here. The CPU tests cover parity.")
        return 0
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    matrix_tflops = _matrix_tflops(bench)
    cfg = SwapFFNConfig()
    torch.manual_seed(0)
    module = SwapFFN(cfg, device="cuda", dtype=torch.bfloat16).eval()
    print(f"Swap-FFN seed config on {torch.cuda.get_device_name()}, bf16; {cfg.flops_per_token() / 1e9:.1f} GFLOP "
          f"per token; bf16 mm measured {matrix_tflops:.0f} TFLOP/s\n")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "matrix_tflops": matrix_tflops, "flops_per_token": cfg.flops_per_token(), "batches": {}}
    for batch in args.batch:
        floor_ms = batch * cfg.flops_per_token() / matrix_tflops / 1e9
        x = torch.randn(batch, cfg.d_model, device="cuda", dtype=torch.bfloat16)
        state = module.init_state(batch)
        rows = {}
        with torch.no_grad():
            rows["reference, eager"] = bench(lambda: module.reference_step(x, state.ram, state.stream_map))
            if args.compile:
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
            kernels = _kernels_per_call(lambda: decoder.step(x))
            # parity over a few tokens, state carried
            ref_state, dec = module.init_state(batch), SwapFFNDecoder(module, batch)
            router, agree, errors = [], [], []
            for _ in range(args.parity_tokens):
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
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "swap_ffn.json").write_text(json.dumps(results, indent=1))
    return 0


def main(argv=None) -> int:
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="fuselm", description="fused Triton kernels for gated-MLP LMs")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="every op vs its reference: error and time table").set_defaults(run=demo)
    swap = commands.add_parser("swapffn", help="Swap-FFN seed config: tokens/s, kernels per token, parity")
    swap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    swap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                      help="also time torch.compile of the reference (slow to compile)")
    swap.add_argument("--parity-tokens", type=int, default=4)
    swap.add_argument("--out", type=Path, default=None, help="write swap_ffn.json here")
    swap.set_defaults(run=swapffn)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
