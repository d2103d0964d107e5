"""The TMA gate/up GEMM + SwiGLU (``gemm_swiglu_tma_kernel``, the 16-bit Hopper forward from
``TMA_MIN_ROWS`` rows) at tile configs, against cuBLAS: the data behind
``swiglu_mlp.kernels.TMA_HOPPER`` and issue 18's MLP bar. GPU (sm_90) only.

    python benchmarks/gemm_swiglu_tma.py [--rows 512 1024 4096 8192] [--f 14336 12288] [--rounds 7]

bf16, D 4096 (Llama-8B: F 14336; Qwen3.5-9B: F 12288). Baselines: cuBLAS mm on [W_gate; W_up] then
fuselm's silu_mul on the two halves (the bar's unfused path, as benchmarks/mlp.py), cuBLAS mm on the
interleaved w13 then the SwiGLU-pairs kernel (the forward's path below TMA_MIN_ROWS), and cuBLAS mm
alone. Every path is one CUDA graph, timed in ``--rounds`` interleaved rounds (do_bench each;
clock drift hits all alike), median; x = (cuBLAS + silu_mul) / path.
"""

from __future__ import annotations

import argparse

import torch

from fuselm import interleave_gate_up, silu_mul
from fuselm.ops.common.activation import Activation
from fuselm.ops.silu_mul.kernels import swiglu_pairs_forward_kernel
from fuselm.ops.swiglu_mlp.kernels import TMA_HOPPER, TmaGemmConfig, gemm_swiglu_tma_kernel
from timing import interleaved_graph_bench

D = 4096
CONFIGS = [TMA_HOPPER, TmaGemmConfig(128, 128, 64, 16, 8, 4, True), TmaGemmConfig(128, 128, 64, 8, 8, 3, True),
           TmaGemmConfig(128, 128, 64, 32, 8, 4, True), TmaGemmConfig(64, 128, 64, 16, 4, 4, True)]


def name(cfg: TmaGemmConfig) -> str:
    return (f"TMA {cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
            f"{' sub' if cfg.subtile else ''}{' (default)' if cfg == TMA_HOPPER else ''}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 4096, 8192])
    parser.add_argument("--f", type=int, nargs="+", default=[14336, 12288])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    act = Activation()
    print(f"## gate/up GEMM + SwiGLU: TMA kernel vs cuBLAS, D {D}, bf16, {torch.cuda.get_device_name()}\n")
    print(f"CUDA-graph replay, median of {args.rounds} interleaved rounds, ms (x = cuBLAS + silu_mul / path)\n")
    paths = ["cuBLAS + silu_mul", "cuBLAS + pairs", "cuBLAS mm alone"] + [name(c) for c in CONFIGS]
    print("| F | M | " + " | ".join(paths) + " |")
    print("|---|---|" + "---|" * len(paths))
    for F in args.f:
        wg, wu = (torch.randn(F, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5 for _ in range(2))
        w13, w_cat = interleave_gate_up(wg, wu), torch.cat([wg, wu])
        for M in args.rows:
            x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, F, device="cuda", dtype=torch.bfloat16)
            providers = {
                "cuBLAS + silu_mul": lambda: (lambda gu: silu_mul(gu[:, :F], gu[:, F:]))(x @ w_cat.T),
                "cuBLAS + pairs": lambda: swiglu_pairs_forward_kernel(torch.mm(x, w13.T), out, act),
                "cuBLAS mm alone": lambda: x @ w_cat.T,
            }
            for cfg in CONFIGS:
                providers[name(cfg)] = lambda cfg=cfg: gemm_swiglu_tma_kernel(x, w13, act, out, cfg)
            ms = interleaved_graph_bench(providers, rounds=args.rounds)
            base = ms["cuBLAS + silu_mul"]
            cells = [f"{ms[path]:.4f} ({base / ms[path]:.3f}x)" for path in paths]
            print(f"| {F} | {M} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
