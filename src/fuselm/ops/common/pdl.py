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
def prefetch_rows_l2(row_ptrs, row_len, LINES: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr):
    """With USE_PDL: ask L2 for the first LINES lines of LINE elements (128 bytes) of each row at
    ``row_ptrs`` ([ROWS] pointers, ``row_len`` elements a row: no line past it), without waiting
    for them (``prefetch.global.L2``). A weight-streaming kernel launched with PDL calls it before
    its wait: its first weight tiles are then in L2, and their pages in the TLB, when the kernel
    before it ends."""
    if USE_PDL:
        offsets = tl.minimum(tl.arange(0, LINES) * LINE, row_len - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [row_ptrs[:, None] + offsets[None, :]], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def allow_next_kernel(USE_PDL: tl.constexpr):
    """Let the next kernel (if launched with PDL) be scheduled once every program got here."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def prefetch_lines(block_k: int, element_size: int, tiles: int = 2) -> int:
    """128-byte lines of each weight row a decode GEMV asks L2 for before its wait: its first
    ``tiles`` K steps of ``block_k`` elements (a power of two, for tl.arange)."""
    return max(1, tiles * block_k * element_size // 128)
