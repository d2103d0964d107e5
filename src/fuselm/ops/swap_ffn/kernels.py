"""Triton kernel for the Swap-FFN swap event: router, decisions, bank swap, lane update, in place.

Rows are (batch, core) pairs: x [M, D], ram [M, 4, D], stream_map [M] uint8, M = B * C. A program
owns BLOCK_M rows and, per event:
1. z = rms(x, router_norm) @ router_w.T, rounded as the reference rounds it (the normalised
   row to the model dtype, times the weight, rounded; z rounded), so the hard decisions match
   the reference's wherever the logits are not at a rounding boundary;
2. gate = round(sigmoid(round(z @ swap_w) + swap_b)) > 0.5 and
   s = argmax(round(z @ bank_w) + bank_b), the first maximum winning;
3. where gate: x <-> ram[p] with p = lane[s] (x replaced, the old x written to bank p) and the
   stream map's lanes moved to front (lane 0 = p, lanes 1..s shifted down).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselm.runtime import cdiv, next_power_of_2


@triton.jit
def _round(v, like_ptr):
    """v rounded to the dtype ``like_ptr`` points at, back in fp32."""
    return v.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _swap_router_kernel(
    x_ptr, ram_ptr, map_ptr, norm_w_ptr, router_w_ptr, swap_w_ptr, swap_b_ptr, bank_w_ptr, bank_b_ptr,
    M, D, R, eps,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R

    # 1. RMSNorm statistics, then z = round(round(x * rstd) * w) @ router_w.T.
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        m = row_ok[:, None] & (k0 + k < D)[None, :]
        xf = tl.load(x_ptr + rows64[:, None] * D + k0 + k[None, :], mask=m, other=0.0).to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=1)
    rstd = tl.rsqrt(sum_sq / D + eps)
    z = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = k0 + k < D
        m = row_ok[:, None] & k_ok[None, :]
        xf = tl.load(x_ptr + rows64[:, None] * D + k0 + k[None, :], mask=m, other=0.0).to(tl.float32)
        nw = tl.load(norm_w_ptr + k0 + k, mask=k_ok, other=0.0).to(tl.float32)
        xn = (_round(xf * rstd[:, None], x_ptr) * nw[None, :]).to(x_ptr.dtype.element_ty)
        rw = tl.load(router_w_ptr + r[None, :] * D + (k0 + k)[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            z = tl.dot(xn, rw, z, input_precision="ieee")
        else:
            z = tl.dot(xn, rw, z)
    z = _round(z, x_ptr)

    # 2. Decisions.
    swap_w = tl.load(swap_w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    logit = _round(_round(tl.sum(z * swap_w[None, :], axis=1), x_ptr) + tl.load(swap_b_ptr).to(tl.float32), x_ptr)
    gate = _round(1.0 / (1.0 + tl.exp(-logit)), x_ptr) > 0.5
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.int32)
    for j in tl.static_range(4):
        bw = tl.load(bank_w_ptr + r * 4 + j, mask=r_ok, other=0.0).to(tl.float32)
        bank_logit = _round(_round(tl.sum(z * bw[None, :], axis=1), x_ptr) + tl.load(bank_b_ptr + j).to(tl.float32), x_ptr)
        take = bank_logit > best  # strict: the first maximum wins
        s = tl.where(take, j, s)
        best = tl.where(take, bank_logit, best)

    # 3. Lanes, then the swap.
    packed = tl.load(map_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    l0 = packed & 3
    l1 = (packed >> 2) & 3
    l2 = (packed >> 4) & 3
    l3 = (packed >> 6) & 3
    p = tl.where(s == 0, l0, tl.where(s == 1, l1, tl.where(s == 2, l2, l3)))
    n1 = tl.where(s >= 1, l0, l1)
    n2 = tl.where(s >= 2, l1, l2)
    n3 = tl.where(s >= 3, l2, l3)
    swapped = row_ok & gate
    tl.store(map_ptr + rows, (p | (n1 << 2) | (n2 << 4) | (n3 << 6)).to(tl.uint8), mask=swapped)
    bank_rows = (rows64 * 4 + p.to(tl.int64))[:, None] * D
    for k0 in range(0, D, BLOCK_K):
        m = swapped[:, None] & (k0 + k < D)[None, :]
        x_ptrs = x_ptr + rows64[:, None] * D + k0 + k[None, :]
        bank_ptrs = ram_ptr + bank_rows + k0 + k[None, :]
        x_old = tl.load(x_ptrs, mask=m)
        bank = tl.load(bank_ptrs, mask=m)
        tl.store(x_ptrs, bank, mask=m)
        tl.store(bank_ptrs, x_old, mask=m)


# Rows per program and the D step. 16 rows is the smallest tl.dot tile; 512 cores make 32
# programs at batch 1. Not yet tuned on the GPU.
BLOCK_M = 16
BLOCK_K = 128


def swap_router(x, ram, stream_map, norm_w, router_w, swap_w, swap_b, bank_w, bank_b, eps: float) -> None:
    """One swap event, in place on x [M, D], ram [M, 4, D] and stream_map [M] (all contiguous)."""
    M, D = x.shape
    R = router_w.shape[0]
    _swap_router_kernel[(cdiv(M, BLOCK_M),)](
        x, ram, stream_map, norm_w, router_w, swap_w, swap_b, bank_w, bank_b, M, D, R, eps,
        IEEE=x.dtype.is_floating_point and x.element_size() == 4,
        BLOCK_M=BLOCK_M, BLOCK_K=min(BLOCK_K, next_power_of_2(D)),
        BLOCK_R=max(16, next_power_of_2(R)), num_warps=4,
    )
