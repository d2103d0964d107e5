"""Host time per call, layer by layer, for one decode-shape op (1 x 4096 rms_norm, bf16).

    python benchmarks/host_overhead.py

Each layer adds one step of the public call path; the differences show where host time goes.
Times are medians of 5 loops of 200 calls that never wait on the GPU (the kernels take ~1.5 µs,
so the host is the bottleneck).
"""

import torch
import triton

from fuselm import rms_norm
from fuselm.ops.rms_norm import op as rms_op
from fuselm.ops.rms_norm.kernels import _rms_norm_fwd_kernel, rms_norm_forward_kernel
from timing import host_us


def main():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    xg = x.clone().requires_grad_(True)
    layers = {
        "torch.empty_like (one allocation)": lambda: torch.empty_like(x),
        "x + x (one eager torch op)": lambda: x + x,
        "triton JIT launch, preset args": lambda: _rms_norm_fwd_kernel[(1,)](
            x, x, w, y, y, 1, 4096, 4096, 4096, 4096, 4096, 1e-6, 0.0,
            HAS_RESIDUAL=False, ZERO_CENTERED=False, BLOCK_M=1, BLOCK_N=4096, num_warps=4),
        "fuselm launcher (geometry + launch)": lambda: rms_norm_forward_kernel(x, None, w, y, None, 1e-6, 0.0),
        "fuselm _forward (+ dispatch, allocation)": lambda: rms_op._forward(x, None, w, 1e-6, 0.0, torch.empty_like(x), None),
        "fuselm rms_norm (+ checks, autograd.Function)": lambda: rms_norm(x, w, 1e-6),
        "fuselm rms_norm, input requires grad": lambda: rms_norm(xg, w, 1e-6),
        "torch.ops.fuselm.rms_norm (custom op)": lambda: torch.ops.fuselm.rms_norm(x, w, 1e-6, 0.0),
    }
    print(f"host time per call, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| layer | host µs |\n|---|---|")
    for name, fn in layers.items():
        print(f"| {name} | {host_us(fn):.1f} |")


if __name__ == "__main__":
    main()
