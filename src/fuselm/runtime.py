"""Where a kernel runs, what the device is, and the argument checks every op shares.

Dispatch rule for every fuselm op:
- CUDA tensors run the Triton kernel.
- CPU tensors run the same Triton kernel in the Triton interpreter when the environment
  variable ``TRITON_INTERPRET=1`` was set before triton was imported (the test suite does this
  on machines without a GPU); otherwise they run the plain-PyTorch reference in ``naive.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
from typing import Sequence

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype, argument: str = "dtype") -> torch.dtype:
    """A torch dtype, or its name ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32", also
    "torch.bfloat16"), as a torch dtype; ValueError naming ``argument`` otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype in KERNEL_DTYPES:
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"{argument}: expected float32, bfloat16 or float16 (a torch dtype or its name), got {dtype!r}")


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` is computed by the Triton kernel (GPU, or CPU under the interpreter)."""
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def capture_graph(fn):
    """(graph, out): ``fn()`` run once on a side stream (Triton JIT, cuBLAS workspaces), then
    captured in a CUDA graph; ``out`` is what the captured call returned (its static outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out = fn()
    return graph, out


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool=None):
    """``torch.cuda.graph(graph, pool=pool)`` with Python's garbage collector off inside (as it was
    before, after): a collection that runs inside a capture and frees objects holding CUDA
    resources (another engine's graphs, pinned buffers, events) makes calls a capture forbids, and
    the capture fails ("operation failed due to a previous error during capture"). torch.cuda.graph
    collects once before it begins."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for launch grids. (triton.cdiv and triton.next_power_of_2 are constexpr-function
    wrappers: a few µs each per host call, paid on every eager launch.)"""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def arch_major(device: torch.device) -> int:
    """Compute-capability major of ``device`` (9 = Hopper, 10 = Blackwell); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return _device_properties(device.index if device.index is not None else torch.cuda.current_device()).major


# Programmatic dependent launch (Hopper and later; ``fuselm.ops.common.pdl``): kernels launched with
# it may start while the kernel before them in the stream still runs, doing what needs none of its
# output (e.g. loading weights) before they wait for it. FUSELM_PDL=0 launches every kernel plainly
# (for A/B timing; the results are the same bits).
PDL = os.environ.get("FUSELM_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels that support it launch with programmatic dependent launch on ``device``:
    CUDA compute capability 9 or later, unless ``PDL`` (FUSELM_PDL) is off."""
    return PDL and arch_major(device) >= 9


# Side streams (``side_stream``): work that may run beside the current stream's, forked from it and
# joined back (branches of a captured CUDA graph). They have high priority: the work given them is a
# chain of short, latency-bound kernels (a mixed step's prompt chunk) beside bandwidth-bound work
# that fills the GPU (its decode rows), and their programs are scheduled first as SMs free up
# (H100, 9B, 31 decode rows + 289 prompt tokens: 12.14 ms one after the other, 12.15 on a side
# stream of default priority, 11.84 at high priority; NOTES 81). FUSELM_SIDE_STREAM=0 runs such work in
# order on the current stream (for A/B timing; the results are the same bits).
SIDE_STREAM = os.environ.get("FUSELM_SIDE_STREAM", "1") != "0"
SIDE_STREAM_PRIORITY = -1  # CUDA: lower is higher; 0 is the default


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index, priority=SIDE_STREAM_PRIORITY)


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A second, high-priority CUDA stream on ``device`` (one per device, kept), or None off CUDA or
    with FUSELM_SIDE_STREAM=0. The caller forks it from the current stream before use
    (``side.wait_stream(current)``) and joins it back (``current.wait_stream(side)``) before
    anything reads what it wrote."""
    if device.type != "cuda" or not SIDE_STREAM:
        return None
    return _side_stream(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def cublaslt_preferred(device: torch.device):
    """Within the block, PyTorch's matmuls on CUDA go through cuBLASLt instead of cuBLAS
    (``torch.backends.cuda.preferred_blas_library``, a process-wide setting: restored on exit);
    off CUDA nothing changes. Same fp32 accumulation and one rounding, another heuristic: a CUDA
    graph captured inside keeps the kernels it picked. Why (H100, 9B, a mixed step of 32 decode
    rows + 256 prompt tokens: cuBLAS's picks at 288 rows cost 3.14 ms over the decode step,
    cuBLASLt's 2.78; other row counts within 0.07 ms; benchmarks/NOTES.md 87)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; a small fixed number off CUDA (interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _max_shared_memory(index: int) -> int:
    import triton

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may take on ``device`` (opt-in maximum: 232,448 on an
    H100); off CUDA (the interpreter, which has no such limit) the H100's figure."""
    if device.type != "cuda":
        return 232_448
    return _max_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


class PinnedStaging:
    """Page-locked host memory for an engine's small copies between the host and ``device``,
    allocated once: ``depth`` buffers of ``nbytes``, one per step in turn (``next_step()``).

    A copy to CUDA from pageable memory first waits for all the work queued on the stream (as
    CUDA documents it; between an engine's graph replays that drains the pipeline), so the
    engine's inputs go through pinned memory, and allocated once rather than a step at a time
    (``pin_memory()``, ``torch.empty(pin_memory=True)``: ~10 calls a step into the caching host
    allocator, its lock and event queries, and ``cudaHostAlloc`` when no cached block fits;
    benchmarks/NOTES.md 91). A step's copies take consecutive slices of its buffer; a buffer is reused ``depth`` steps
    later, once an event recorded at the end of its step has completed (no wait when the device
    is fewer steps behind). A host tensor handed out by ``host()`` (the destination of a
    device-to-host copy) stays valid for ``depth - 1`` more steps. Off CUDA nothing is pinned:
    ``to_device`` is a plain copy, ``host`` a fresh tensor."""

    ALIGN = 64  # bytes: every slice starts on a cache line (any dtype's alignment)

    def __init__(self, device: torch.device | str, depth: int = 4, nbytes: int = 1 << 20):
        self.device = torch.device(device)
        self.depth = check_positive_int("depth", depth)
        self.nbytes = check_positive_int("nbytes", nbytes)
        self.steps = 0  # next_step() calls so far
        cuda = self.device.type == "cuda"
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)] if cuda else []
        self._done: list[torch.cuda.Event | None] = [None] * depth
        self._offset = 0

    def next_step(self) -> None:
        """End this step's use of its buffer (an event queued behind its copies) and take the
        next buffer, waiting for the event of the step that used it last."""
        if not self._buffers:
            self.steps += 1
            return
        index = self.steps % self.depth
        if self._done[index] is None:
            self._done[index] = torch.cuda.Event()
        self._done[index].record()
        self.steps += 1
        self._offset = 0
        following = self._done[self.steps % self.depth]
        if following is not None:
            following.synchronize()

    def host(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor from this step's buffer (a fresh pinned one when the buffer is
        full: a large eager prefill's inputs); off CUDA a fresh tensor."""
        if not self._buffers:
            return torch.empty(shape, dtype=dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if self._offset + nbytes > self.nbytes:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        buffer = self._buffers[self.steps % self.depth]
        view = buffer[self._offset:self._offset + nbytes].view(dtype).view(shape)
        self._offset += -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        return view

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host ``tensor`` on the device, copied without waiting for the queued work."""
        if not self._buffers:
            return tensor.to(self.device)
        return self._staged(tensor).to(self.device, non_blocking=True)

    def copy_(self, target: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy a host ``tensor`` into the device tensor ``target`` (a graph's static input) without
        waiting for the queued work."""
        target.copy_(self._staged(tensor) if self._buffers else tensor, non_blocking=True)

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        staged = self.host(tensor.shape, tensor.dtype)
        staged.copy_(tensor)
        return staged


def copy_bandwidth(device: torch.device | str = "cuda", dtype=torch.bfloat16) -> float:
    """Measured device-to-device copy of 512 MiB on a CUDA ``device``: bytes read + written per
    second, in TB/s (do_bench median after warm-up) - the ceiling bandwidth-bound kernels and
    the decode weight floors are quoted against."""
    import triton

    source = torch.randn(256 * 1024 * 1024, device=device, dtype=dtype)
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=100, return_mode="median")
    return 2 * source.numel() * source.element_size() / ms / 1e9


def matrix_rate(device: torch.device | str = "cuda", dtype=torch.bfloat16) -> float:
    """Measured 8192^3 ``torch.mm`` (cuBLAS) on random data on a CUDA ``device``, in TFLOP/s
    (do_bench median after warm-up): the ceiling compute-bound kernels are quoted against."""
    import triton

    a, b = (torch.randn(8192, 8192, device=device, dtype=dtype) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


# ----------------------------------------------------------------------------- argument checks
def check_tensor(name: str, t, dtypes=KERNEL_DTYPES) -> None:
    """TypeError unless ``t`` is a tensor of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not supported (use {allowed})")


def check_same_device(**tensors: torch.Tensor) -> None:
    """ValueError naming the arguments when the tensors are not all on one device."""
    present = [(name, t.device) for name, t in tensors.items() if t is not None]
    if any(device != present[0][1] for _, device in present):
        listed = ", ".join(f"{name} on {device}" for name, device in present)
        raise ValueError(f"tensors must be on one device: {listed}")


def check_match(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, *, dtype: bool = True) -> None:
    """ValueError/TypeError when ``t`` differs from ``ref`` in shape (or dtype)."""
    if t.shape != ref.shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {ref_name} {tuple(ref.shape)}")
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} does not match {ref_name} {ref.dtype}")


def check_positive_int(name: str, value) -> int:
    """The argument, if it is an int >= 1 (not a bool); else ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_finite_float(name: str, value, *, positive: bool = False, nonnegative: bool = False) -> float:
    """The argument as a float; ValueError if it is not a finite number (of the right sign)."""
    if type(value) is not float:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name}: must be > 0, got {value}")
    if nonnegative and not value >= 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    return value


def check_out(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A caller-provided output buffer, checked against the output it will hold; or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor(name, out)
    check_match(name, out, "the output", like)
    if out.device != like.device:
        raise ValueError(f"{name}: on {out.device}, the output is on {like.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return out


def needs_autograd(*tensors: torch.Tensor) -> bool:
    """True when autograd must record the op (grad mode on and an input requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D [rows, last dim] tensor with unit column stride (a view when possible).

    A 2-D input with a row stride (e.g. one half of a [M, 2F] projection) is kept as a view; other
    layouts are reshaped, copying only when the layout cannot be viewed that way.
    """
    if t.dim() == 0:
        raise ValueError(f"{name}: must have at least one dimension")
    t2 = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < t2.shape[1]):
        t2 = t2.contiguous()
    return t2
