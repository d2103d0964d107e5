"""DRAM bytes of one Swap-FFN token step (the fused path, one CUDA-graph replay), from the hardware
counters. Run under Nsight Compute, which profiles the replay as one workload:

    ncu --graph-profiling graph --profile-from-start off --clock-control none --cache-control none \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv python3 benchmarks/swap_ffn_dram.py --batch 1

``--cache-control none`` keeps L2 as the steps before left it (the steady state of decoding: the
24 MB of FFN weights stay in the 50 MB L2); ``all`` flushes it first (every weight byte from DRAM).
"""

from __future__ import annotations

import argparse

import torch

from fuselm.models.swap_ffn import SwapFFN, SwapFFNConfig, SwapFFNDecoder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = SwapFFN(SwapFFNConfig(), device="cuda", dtype=torch.bfloat16).eval()
    decoder = SwapFFNDecoder(module, args.batch)
    x = torch.randn(args.batch, module.config.d_model, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        decoder.step(x)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    decoder.step(x)  # the profiled token step: one graph launch
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
