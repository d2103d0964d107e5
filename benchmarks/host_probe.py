"""Does this machine stall a host thread from outside the process? (GPU machine; issue 17's served runs.)

    python benchmarks/host_probe.py [--seconds 6]

Two loops, one after the other, each timing its iterations on the host clock: a pure-Python CPU
loop (~50 us of work an iteration: a slow or shared core shows as slow iterations), then a CUDA
loop (a one-element kernel and a stream synchronize an iteration: a driver call blocked by another
client of the GPU, such as a monitoring agent's NVML queries, shows as slow iterations while the
CPU loop stays fast). Prints, per loop, the iterations, their median and the ones over 5 ms: how
many, the longest, and the median interval between them (a periodic outside poller repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def probe(step, seconds: float) -> str:
    times, slow = [], []
    end = time.perf_counter() + seconds
    while (began := time.perf_counter()) < end:
        step()
        took = time.perf_counter() - began
        times.append(took)
        if took > 0.005:
            slow.append((began, took))
    gaps = [b[0] - a[0] for a, b in zip(slow, slow[1:])]
    text = f"{len(times)} iterations, median {1e6 * statistics.median(times):.0f} us; {len(slow)} over 5 ms"
    if slow:
        text += f", the longest {1e3 * max(t for _, t in slow):.1f} ms"
    if gaps:
        text += f", median {statistics.median(gaps):.2f} s apart"
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    print(f"cpu loop: {probe(lambda: sum(range(2000)), args.seconds)}")
    x = torch.zeros(1, device="cuda")

    def cuda_step():
        x.add_(1)
        torch.cuda.current_stream().synchronize()

    cuda_step()
    print(f"cuda loop: {probe(cuda_step, args.seconds)}")


if __name__ == "__main__":
    main()
