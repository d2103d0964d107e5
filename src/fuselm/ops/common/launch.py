"""The start of a kernel that may be launched with programmatic dependent launch (PDL).

A kernel launched with ``launch_pdl=True`` (``fuselm.runtime.use_pdl``) can begin before the kernel
ahead of it in the stream has finished, so it must wait before it reads or writes anything: every
such kernel calls ``wait_previous_kernel(USE_PDL)`` first, in every program (also the ones that
then find no work: the kernel's end must still follow the previous kernel's end, for the kernels
after it that are launched plainly). It then lets the next kernel be scheduled (its programs wait
likewise), which hides the launch and scheduling latency between the decode step's ~300 kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_previous_kernel(USE_PDL: tl.constexpr):
    """With USE_PDL: wait until the previous kernel in the stream has completed and its writes are
    visible (griddepcontrol.wait), then allow the next kernel to be scheduled. Nothing without."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
