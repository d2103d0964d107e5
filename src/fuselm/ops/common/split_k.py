"""Split-K for the decode GEMVs (``swiglu_mlp``'s ``_decode_gemv_kernel``, ``decode_linear``):
several programs share one tile of output features, each streaming a slice of K, and the last
of them to finish adds the slices up, in one launch.

Why: at the Qwen3.5-9B decode shapes with N = 4096 outputs (MLP down, the output projections) a
GEMV has 128 programs of 32 features, one per multiprocessor (4 of the H100's 132 idle) and no
second program to cover a program's start and end: 73-82% of copy bandwidth, where the wide
gate/up GEMV with ~3 programs a multiprocessor reaches ~90% (decode_gemv_sweep.md).

How (deterministic, no float atomics): program (tile, s) writes its fp32 partial sums to
``partial[s]``, then increments the tile's counter (acq_rel, after a barrier, so the CTA's
stores are visible first); the program that sees ``SPLIT_K - 1`` arrivals reads the partials
in split order s = 0, 1, ... (bypassing L1: other multiprocessors wrote them), adds them in
fp32, runs the epilogue and stores; it then sets the counter back to 0 for the next launch.
The sum is the one-program sum reassociated over SPLIT_K blocks of K (fp32), the same bits at
every call for a given SPLIT_K.

The counters are one persistent int32 buffer per device (``split_k_counters``): launches that
use them must not overlap in time, which holds for launches on one stream; a launch is never
split during CUDA-graph capture unless the buffer already exists (made by an eager call, as
every graph's warm-up run is), since memory made during capture belongs to the graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fuselm.runtime import cdiv, num_sms

SPLIT_K_TILES = 4096  # counters per device: the most output tiles a split launch may have
# A GEMV is split while its output tiles fill fewer than this many programs a multiprocessor
# (H100 sweep, decode_gemv_split.md: N = 4096 at 128 tiles of 32 features).
SPLIT_K_PROGRAMS_PER_SM = 3
MAX_SPLIT_K = 8
# FUSELM_SPLIT_K=0: never split by default (an explicit ``split_k`` still does), for A/B timings.
DEFAULT_SPLIT = os.environ.get("FUSELM_SPLIT_K", "1") != "0"

_COUNTERS: dict[str, torch.Tensor] = {}  # device -> counters


def split_k_counters(device: torch.device) -> torch.Tensor | None:
    """The device's persistent zeroed counters [SPLIT_K_TILES] int32 (made on the first call
    outside graph capture; None while capturing before that)."""
    key = str(device) if device.type != "cuda" or device.index is not None else f"cuda:{torch.cuda.current_device()}"
    counters = _COUNTERS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[key] = torch.zeros(SPLIT_K_TILES, dtype=torch.int32, device=device)
    return counters


def split_k_for(tiles: int, k_steps: int, device: torch.device) -> int:
    """How many K slices a GEMV of ``tiles`` output tiles and ``k_steps`` BLOCK_K steps runs in:
    enough to give each multiprocessor ~SPLIT_K_PROGRAMS_PER_SM programs, at least two K steps a
    slice, at most MAX_SPLIT_K; 1 (no split) when the tiles already fill the GPU or off CUDA."""
    if not DEFAULT_SPLIT or device.type != "cuda" or tiles > SPLIT_K_TILES:
        return 1
    wanted = cdiv(SPLIT_K_PROGRAMS_PER_SM * num_sms(device), tiles)
    return max(1, min(wanted, MAX_SPLIT_K, k_steps // 2))


def split_k_launch(split_k: int, tiles: int, device: torch.device):
    """(split_k, counters) to launch with: (1, a dummy) when not splitting or when the counters
    cannot be made now (graph capture before any eager call)."""
    if split_k > 1 and tiles <= SPLIT_K_TILES:
        counters = split_k_counters(device)
        if counters is not None:
            return split_k, counters
    return 1, None


def k_slice(K: int, split_k: int, block_k: int) -> int:
    """K columns a slice takes (a whole number of BLOCK_K steps; the last slice may be shorter)."""
    return cdiv(cdiv(K, split_k), block_k) * block_k


@triton.jit
def split_k_sum(acc, partial_ptr, counter_ptr, tile, offsets, mask, split_stride, SPLIT_K: tl.constexpr):
    """This program's fp32 partial ``acc`` (slice ``tl.program_id(1)`` of output tile ``tile``)
    into ``partial_ptr + s * split_stride + offsets``; returns (the sum over all SPLIT_K slices in
    slice order, valid in the last program to arrive; whether this program is that one)."""
    tl.store(partial_ptr + tl.program_id(1) * split_stride + offsets, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the counter's release
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for s in tl.static_range(SPLIT_K):
            total += tl.load(partial_ptr + s * split_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch
    return total, last
