"""Programmatic dependent launch (PDL, Hopper and later) inside a kernel.

A kernel launched with ``launch_pdl=True`` (``fuselm.runtime.use_pdl``) may begin while the kernel
ahead of it in the stream still runs: once every program of that kernel has called
``allow_next_kernel`` (or exited). Until it calls ``wait_for_previous_kernel`` it writes nothing and
reads only what was complete when it could begin: what was written before the kernel ahead began,
or by a kernel that every program of the kernel ahead waited for before allowing it (the MoE decode
path's down kernel reads the router's logits so). After the wait the kernel ahead has finished and
its writes are visible. A kernel whose programs do not all wait still ends after the kernel ahead
as long as one of them waits, so a plain launch after it follows both. Both calls are nothing
without USE_PDL (off CUDA the interpreter never traces them).

Where a kernel allows: a programmatic dependent allows after its own wait, so that the kernel it
lets begin finds everything before it complete (weights and state written by kernels further back
included); only a kernel launched plainly may allow at its start. What a dependent may read before
its wait is then what was written before the kernel right ahead of it: weights, and state (the
Gated DeltaNet decode step's recurrent and conv state) that kernel does not write.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def allow_next_kernel(USE_PDL: tl.constexpr):
    """Let the next kernel (if launched with PDL) be scheduled once every program got here."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
