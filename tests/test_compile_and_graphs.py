"""Every op is a torch.library custom op: fake-tensor traceable, torch.compile(fullgraph=True)
safe, and capturable in a CUDA graph."""

import pytest
import torch

from conftest import DEVICE
from helpers import randn
from fuselm import Activation, add_rms_norm, rms_norm, silu_mul

OPS = {
    "silu_mul": lambda: (torch.ops.fuselm.silu_mul, (randn(3, 40), randn(3, 40), "swiglu_oai", 7.0, 1.702)),
    "silu_mul_backward": lambda: (torch.ops.fuselm.silu_mul_backward, (randn(3, 40), randn(3, 40), randn(3, 40), "silu", float("inf"), 1.0)),
    "rms_norm": lambda: (torch.ops.fuselm.rms_norm, (randn(3, 40), randn(40), 1e-6, 0.0)),
    "add_rms_norm": lambda: (torch.ops.fuselm.add_rms_norm, (randn(3, 40), randn(3, 40), randn(40), 1e-6, 1.0)),
    "rms_norm_backward": lambda: (torch.ops.fuselm.rms_norm_backward, (randn(3, 40), randn(3, 40), randn(40), randn(3, 40), 1e-6, 0.0)),
}


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch."""
    op, args = OPS[name]()
    differentiable = name in ("silu_mul", "rms_norm", "add_rms_norm")
    if differentiable:
        args = tuple(a.requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(op, args)


def block(x, residual, weight, gate_up):
    """A decoder-layer fragment: fused add + norm, then SwiGLU on the halves of a projection."""
    normed, residual = add_rms_norm(x, residual, weight, 1e-6, 1.0)
    f = gate_up.shape[-1] // 2
    h = silu_mul(gate_up[:, :f] + normed[:, :f], gate_up[:, f:], Activation.swiglu_limit(4.0))
    return rms_norm(h, weight[:f]), residual


def _inputs(requires_grad=False):
    x, residual, gate_up = randn(5, 64), randn(5, 64), randn(5, 128)
    weight = randn(64) * 0.1
    return [t.requires_grad_(requires_grad) for t in (x, residual, weight, gate_up)]


def test_compile_fullgraph_forward_and_backward():
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    eager_in = _inputs(True)
    compiled_in = [t.detach().clone().requires_grad_(True) for t in eager_in]
    out_eager = block(*eager_in)
    out_compiled = compiled(*compiled_in)
    for a, b in zip(out_compiled, out_eager):
        torch.testing.assert_close(a, b)
    sum(o.sum() for o in out_eager).backward()
    sum(o.sum() for o in out_compiled).backward()
    for a, b in zip(compiled_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    static = _inputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(*static)  # warm up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(*static)
    for _ in range(2):
        fresh = _inputs()
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        for got, want in zip(static_out, block(*fresh)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_decode_shape_is_one_kernel_launch():
    x, residual, weight = randn(1, 4096, dtype=torch.bfloat16), randn(1, 4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16)
    gate, up = randn(1, 14336, dtype=torch.bfloat16), randn(1, 14336, dtype=torch.bfloat16)
    calls = [lambda: rms_norm(x, weight), lambda: add_rms_norm(x, residual, weight), lambda: silu_mul(gate, up)]
    for call in calls:
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, [e.name for e in kernels]
