"""``fuselm demo``: every op on fresh random inputs against its float64 reference, as a table
(op, shape, dtype, relative error, time per call). On a GPU: bf16 and fp16 at (4096, 4096,
14336); on the CPU: fp32, fp16 and bf16 at (37, 256, 688) in the Triton interpreter (or the
PyTorch reference without TRITON_INTERPRET=1)."""

from __future__ import annotations

import time

import torch

from fuselm import Activation, add_rms_norm, gemm_swiglu, interleave_gate_up, rms_norm, silu_mul, swiglu_mlp
from fuselm.ops.common.activation import gate_factor_ref, up_factor_ref
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


def run_ops_demo() -> int:
    """Print the table; 0 when the worst relative error is below 2e-2, else 1."""
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
