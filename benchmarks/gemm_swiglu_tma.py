"""The TMA gate/up GEMM + SwiGLU (``gemm_swiglu_tma_kernel``) against cuBLAS mm + the SwiGLU-pairs
kernel (the forward's other path), tile configs and row counts: the data behind
``swiglu_mlp.kernels.TMA_HOPPER`` and ``swiglu_mlp.op.TMA_MIN_ROWS``. GPU (sm_90) only.

    python benchmarks/gemm_swiglu_tma.py [--rows 256 512 1024 4096 8192] [--f 12288] [--rounds 3]

bf16, D 4096 (Qwen3.5-9B: F 12288; Llama-8B: F 14336). Each config is timed in ``--rounds`` rounds,
each round timing every path once (do_bench), so clock drift hits all paths alike; the median is
printed with the ratio to cuBLAS + pairs and the largest difference from it.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from fuselm.ops.common.activation import Activation
from fuselm.ops.silu_mul.kernels import swiglu_pairs_forward_kernel
from fuselm.ops.swiglu_mlp.kernels import TMA_HOPPER, TmaGemmConfig, gemm_swiglu_tma_kernel

CONFIGS = [TMA_HOPPER, TmaGemmConfig(128, 128, 64, 8, 8, 3, False), TmaGemmConfig(128, 128, 64, 8, 8, 4, True),
           TmaGemmConfig(128, 128, 128, 16, 8, 2, True), TmaGemmConfig(128, 128, 64, 32, 8, 4, True),
           TmaGemmConfig(128, 128, 64, 16, 8, 3, True), TmaGemmConfig(64, 128, 64, 16, 4, 4, True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--f", type=int, default=12288)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    act = Activation()
    D, F = args.d, args.f
    w13 = torch.randn(2 * F, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    print(f"## gate/up + SwiGLU: TMA kernel vs cuBLAS mm + pairs, D {D}, F {F}, bf16, {torch.cuda.get_device_name()}")
    print(f"median of {args.rounds} interleaved rounds (do_bench each); x = cuBLAS + pairs time / this time\n")
    print("| M | cuBLAS + pairs ms | " + " | ".join(f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} "
                                                  f"s{c.num_stages}{' sub' if c.subtile else ''}" for c in CONFIGS) + " |")
    print("|---|---|" + "---|" * len(CONFIGS))
    for M in args.rows:
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, F, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        swiglu_pairs_forward_kernel(torch.mm(x, w13.T), ref, act)
        paths = {"cublas": lambda: swiglu_pairs_forward_kernel(torch.mm(x, w13.T), out, act)}
        errors = {}
        for cfg in CONFIGS:
            out.fill_(float("nan"))
            gemm_swiglu_tma_kernel(x, w13, act, out, cfg)
            errors[cfg] = (out.float() - ref.float()).abs().max().item()
            paths[cfg] = lambda cfg=cfg: gemm_swiglu_tma_kernel(x, w13, act, out, cfg)
        times = {key: [] for key in paths}
        for _ in range(args.rounds):
            for key, fn in paths.items():
                times[key].append(triton.testing.do_bench(fn))
        base = statistics.median(times["cublas"])
        cells = [f"{statistics.median(times[c]):.3f} ({base / statistics.median(times[c]):.3f}x, err {errors[c]:.2g})"
                 for c in CONFIGS]
        print(f"| {M} | {base:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
