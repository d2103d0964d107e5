"""The mixed step's GEMMs at 256-384 rows, in the layouts cuBLAS can be asked for (issue 17).

A mixed step (32 decode rows + one prompt chunk, 9B) runs its N 4096 products (MLP down, K 12288;
the token mixers' output projections, K 4096) at ~450-470 TFLOP/s against ~600-650 for the wide
ones (NOTES 65, mixed_step.md's profiles). For each shape this times, as CUDA-graph replays:
  linear   F.linear(x, W): y [M, N] = x W^T (what the model runs)
  swapped  torch.mm(W, x^T)^T: the same product asked as y^T = W x^T (cuBLAS tiles the weight's
           N side as its M), the result a transposed view (no copy)
  swapped+copy  the same, made contiguous (what a caller needing rows would pay)
  split    (attention qkv only) two products, q/gate rows and k/v rows of the weight (cuBLAS picks
           a kernel per shape: at 320 rows the whole product's pick is slow, NOTES.md 83)
  split into  the same two products written into their columns of one [M, N] output
           (torch.mm's out= a strided column slice: what the model would run, if cuBLAS takes the
           row stride as is; a copy would show as a slower time)
and reports TFLOP/s. Usage: python3 benchmarks/gemm_layouts.py [--rows 256 288 320 384]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from timing import interleaved_graph_bench

# (name, N, K) of the 9B's products
SHAPES = (("mlp down", 4096, 12288), ("out proj", 4096, 4096), ("gate/up", 24576, 4096),
          ("deltanet in proj", 12352, 4096), ("attention qkv", 10240, 4096))
SPLIT_ROWS = {"attention qkv": 8192}  # the weight rows of the first product of "split": q and gate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 288, 320, 384])
    args = parser.parse_args()
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"## cuBLAS layouts of the mixed step's GEMMs, bf16, {gpu}, torch {torch.__version__}\n")
    print("| product | M | linear us | swapped us | swapped+copy us | split us | split into us | linear TFLOP/s "
          "| swapped TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, N, K in SHAPES:
        weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            out_t = torch.empty(N, M, device="cuda", dtype=torch.bfloat16)
            providers = {
                "linear": lambda: F.linear(x, weight),
                "swapped": lambda: torch.mm(weight, x.t(), out=out_t),
                "swapped+copy": lambda: out.copy_(torch.mm(weight, x.t(), out=out_t).t()),
            }
            if name in SPLIT_ROWS:
                first, second = weight[:SPLIT_ROWS[name]], weight[SPLIT_ROWS[name]:]
                providers["split"] = lambda: (F.linear(x, first), F.linear(x, second))
                rows = SPLIT_ROWS[name]
                providers["split into"] = lambda: (torch.mm(x, first.t(), out=out[:, :rows]),
                                                   torch.mm(x, second.t(), out=out[:, rows:]))
            times = interleaved_graph_bench(providers)
            split, split_into = (f"{1e3 * times[k]:.1f}" if k in times else "-" for k in ("split", "split into"))
            if "split into" in times:
                providers["split into"]()
                torch.testing.assert_close(out.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(torch.mm(weight, x.t()).t().float(), F.linear(x, weight).float(),
                                       rtol=2e-2, atol=2e-2)
            flops = 2 * M * N * K
            print(f"| {name} | {M} | {1e3 * times['linear']:.1f} | {1e3 * times['swapped']:.1f} | "
                  f"{1e3 * times['swapped+copy']:.1f} | {split} | {split_into} | {flops / times['linear'] / 1e9:.0f} | "
                  f"{flops / times['swapped'] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
