"""SM clock, power and the clock event reasons while the 35B-A3B MoE block replays back to back from
a CUDA graph (4 s per token count, nvidia-smi sampled every 100 ms past the first 0.5 s), GPU only:
whether a token count runs power-capped (event reason 0x4, SW power cap), so that time saved in
low-power kernels (routing, sort) returns partly as lower clocks for the GEMMs (NOTES.md 105).

    python benchmarks/moe_clocks.py
"""
import subprocess
import time

import torch

from moe import H, random_block
from timing import capture


def main():
    moe = random_block(0)
    for tokens in (64, 4096, 16384):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        graph = capture(lambda: moe(x))
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                                "clocks_event_reasons.active", "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=subprocess.PIPE, text=True)
        start, calls = time.time(), 0
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
        while time.time() - start < 4.0:
            for _ in range(50):
                graph.replay()
            calls += 50
            torch.cuda.synchronize()
        events[1].record()
        torch.cuda.synchronize()
        smi.terminate()
        out = smi.communicate()[0].strip().splitlines()
        rows = [[v.strip() for v in line.split(",")] for line in out[5:]]  # past the first 0.5 s
        sm = sorted(int(r[0]) for r in rows)
        pw = sorted(float(r[2]) for r in rows)
        reasons = {}
        for r in rows:
            reasons[r[4]] = reasons.get(r[4], 0) + 1
        print(f"{tokens} tokens: {events[0].elapsed_time(events[1]) / calls:.4f} ms a call over {calls} calls; "
              f"SM clock MHz min/median/max {sm[0]}/{sm[len(sm)//2]}/{sm[-1]}; power W median/max "
              f"{pw[len(pw)//2]:.0f}/{pw[-1]:.0f}; temp {rows[-1][3]} C; clock event reasons {reasons}", flush=True)


if __name__ == "__main__":
    main()
