"""Shapes, dtypes and tolerances per machine, shared by the kernel tests."""

import torch

from conftest import DEVICE, ON_GPU

# Elementwise kernels also run bf16 in the interpreter (no tl.dot involved).
ELEMENTWISE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# The Triton interpreter converts fp32 to bf16 by truncation, not round-to-nearest-even (checked
# on triton 3.9), so bf16 results on the CPU carry up to one more ulp per rounding.
_BF16_ROOM = 1.0 if ON_GPU else 2.0
# ||out - ref|| / ||ref|| against a float64 reference of the exact function.
TOL_VS_EXACT = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2 * _BF16_ROOM}
# Against the reference that follows the same rounding contract in the same dtype: on the GPU
# only exp/rsqrt ulps differ.
TOL_VS_CONTRACT = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3 if ON_GPU else 2e-2}


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=DEVICE, dtype=dtype)
