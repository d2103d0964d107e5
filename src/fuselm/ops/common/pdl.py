"""Programmatic dependent launch (PDL, Hopper and later) inside a kernel.

A kernel launched with ``launch_pdl=True`` (``fuselm.runtime.use_pdl``) may begin while the kernel
ahead of it in the stream still runs, once every program of that kernel has called
``allow_next_kernel`` (or exited). Before ``wait_for_previous_kernel`` it may read only what was
in memory before that previous kernel began, and write nothing; after the wait, the previous
kernel has finished and its writes are visible. Every program that reads the previous kernel's
output waits (a program that waits on nothing still ends after the kernel before it, as long as one
program of its kernel waits, so the next plain launch still follows both). Both calls are nothing
without USE_PDL (and off CUDA: the interpreter never traces them).
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
