"""Geometry sweep of the Gated DeltaNet chunk kernels at the training shape (issue 20), bf16:
q/k [1, T, 16, 128], v [1, T, 32, 128] (HV 32 value heads sharing 16 key heads), T 16384.

    python benchmarks/gdn_train_sweep.py --out DIR     -> gdn_train_sweep.md / .json

Times (do_bench medians, ms) of each kernel launch alone, on inputs the previous kernels wrote:
the forward recurrence at each BV / warps / stages beside flash-linear-attention's
``chunk_gated_delta_rule_fwd_h`` (autotuned) on the same inputs (session 21's variants of the
recurrence, NOTES.md 53, are in git history as benchmarks/gdn_recurrence_variants.py), the backward
recurrence, the prepare kernel (and the inversion of I + A alone: forward substitution, session
16's, against products of powers, the library's, and session 21's in 16-row blocks, NOTES.md 54).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule import chunk, chunk_backward
from fuselm.ops.gated_delta_rule.chunk import (
    _chunk_span, _diagonal_blocks, _inverse_from_diagonal, _invert_unit_lower, _load_keys, _load_vec, _mm,
)
from fuselm.runtime import max_shared_memory
from timing import bench

DT = torch.bfloat16


@triton.jit
def _invert_substitution(A, BT: tl.constexpr, SUB: tl.constexpr, P: tl.constexpr):
    """chunk._invert_unit_lower with the SUB x SUB diagonal blocks inverted by forward
    substitution (session 16's kernel: SUB - 1 dependent steps on [NB, SUB, SUB], row i of every
    block from its finished rows j < i, T_i = e_i - sum_j A_ij T_j); then the same block Neumann step."""
    NB: tl.constexpr = BT // SUB
    A3 = _diagonal_blocks(A, BT, SUB)
    r = tl.arange(0, SUB)
    is_row = r[None, :, None]
    T3 = tl.zeros([NB, SUB, SUB], dtype=tl.float32) + tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]
    for i in range(1, SUB):
        a_i = tl.sum(tl.where(is_row == i, A3, 0.0), axis=1)  # [NB, SUB]
        T3 = tl.where(is_row == i, T3 - tl.sum(a_i[:, :, None] * T3, axis=1)[:, None, :], T3)
    return _inverse_from_diagonal(T3, A, BT, SUB, P)


@triton.jit
def _inverse_kernel(k_ptr, g_ptr, beta_ptr, t_ptr, seq_len, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    BT: tl.constexpr, SUB: tl.constexpr, METHOD: tl.constexpr, P: tl.constexpr):
    """Only the prepare kernel's T = (I + A)^-1 of one chunk and value head (l2-normalised keys), by
    forward substitution (METHOD 0) or products (METHOD 1, the library's), stored fp32 [T, HV, BT]."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, k_ptr, k_ptr, seq_len, BT, True)
    dt = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    row_ok = rows < n
    G = tl.cumsum(_load_vec(g_ptr, t0, n, HV, i_hv, BT), axis=0)
    k = _load_keys(k_ptr, t0, n, H * K, i_h * K, K, BT, K, True)
    keep = (rows[:, None] >= rows[None, :]) & row_ok[:, None]
    gamma = tl.exp(tl.where(keep, G[:, None] - G[None, :], float("-inf")))
    beta = _load_vec(beta_ptr, t0, n, HV, i_hv, BT)
    A = tl.where(rows[:, None] > rows[None, :], beta[:, None] * _mm(k.to(dt), tl.trans(k.to(dt)), P) * gamma, 0.0)
    if METHOD == 0:
        T = _invert_substitution(A, BT, SUB, P)
    else:
        T = _invert_unit_lower(A, BT, SUB, P)
    tl.store(t_ptr + ((t0 + rows) * HV + i_hv).to(tl.int64)[:, None] * BT + rows[None, :], T, mask=row_ok[:, None])


@triton.jit
def _sub_block_rows(ptr, t0, s, n, stride_t, col0, n_cols, BC: tl.constexpr):
    """[16, BC] rows 16 s .. 16 s + 15 of a chunk (zeros past its n rows and n_cols columns)."""
    r = 16 * s + tl.arange(0, 16)
    c = tl.arange(0, BC)
    return tl.load(ptr + (t0 + r).to(tl.int64)[:, None] * stride_t + col0 + c[None, :],
                   mask=(r < n)[:, None] & (c < n_cols)[None, :], other=0.0)


@triton.jit
def _sub_block_vec(ptr, t0, s, n, HV, i_hv):
    r = 16 * s + tl.arange(0, 16)
    return tl.load(ptr + (t0 + r) * HV + i_hv, mask=r < n, other=0.0).to(tl.float32)


@triton.jit
def _unit_lower_inverse_16(L):
    """(I + L)^-1 for strictly lower [16, 16] L (L^16 = 0): (I - L)(I + L^2)(I + L^4)(I + L^8), ieee."""
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    L2 = tl.dot(L, L, input_precision="ieee")
    L4 = tl.dot(L2, L2, input_precision="ieee")
    L8 = tl.dot(L4, L4, input_precision="ieee")
    return tl.dot(tl.dot(eye - L, eye + L2, input_precision="ieee"),
                  tl.dot(eye + L4, eye + L8, input_precision="ieee"), input_precision="ieee")


@triton.jit
def _store_sub_block(t_ptr, X, t0, i, j, n, HV, i_hv, BT: tl.constexpr):
    """Block (i, j) of a chunk's [BT, BT] T (fp32 [T, HV, BT] rows), rows past n not written."""
    r = 16 * i + tl.arange(0, 16)
    c = 16 * j + tl.arange(0, 16)
    tl.store(t_ptr + ((t0 + r) * HV + i_hv).to(tl.int64)[:, None] * BT + c[None, :], X, mask=(r < n)[:, None])


@triton.jit
def _inverse_blocks_kernel(k_ptr, g_ptr, beta_ptr, t_ptr, seq_len, H: tl.constexpr, HV: tl.constexpr,
                           K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, P: tl.constexpr):
    """T = (I + A)^-1 of one chunk and value head in 16-row blocks (session 21's candidate for the
    prepare's inversion, NOTES.md 54): the ten lower blocks of K K^T from the raw keys (the l2 norm
    applied to the products, r_i r_j k_i.k_j), BK key columns a step; the diagonal blocks inverted
    by products of powers (ieee); the rest by block forward substitution, T_ij = -T_ii sum_{j<=m<i}
    A_im T_mj (P dots); stored fp32 in the library's [T, HV, BT] layout (upper blocks zero). G per
    16-row block: its cumsum plus the earlier blocks' sums."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, k_ptr, k_ptr, seq_len, BT, True)
    r = tl.arange(0, 16)
    g0 = _sub_block_vec(g_ptr, t0, 0, n, HV, i_hv)
    g1 = _sub_block_vec(g_ptr, t0, 1, n, HV, i_hv)
    g2 = _sub_block_vec(g_ptr, t0, 2, n, HV, i_hv)
    g3 = _sub_block_vec(g_ptr, t0, 3, n, HV, i_hv)
    G0 = tl.cumsum(g0, axis=0)
    G1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    G2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
    G3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
    A00 = tl.zeros([16, 16], dtype=tl.float32)
    A10, A11 = A00, A00
    A20, A21, A22 = A00, A00, A00
    A30, A31, A32, A33 = A00, A00, A00, A00
    s0 = tl.zeros([16], dtype=tl.float32)
    s1, s2, s3 = s0, s0, s0
    for k0 in range(0, K, BK):
        k_0 = _sub_block_rows(k_ptr, t0, 0, n, H * K, i_h * K + k0, K - k0, BK)
        k_1 = _sub_block_rows(k_ptr, t0, 1, n, H * K, i_h * K + k0, K - k0, BK)
        k_2 = _sub_block_rows(k_ptr, t0, 2, n, H * K, i_h * K + k0, K - k0, BK)
        k_3 = _sub_block_rows(k_ptr, t0, 3, n, H * K, i_h * K + k0, K - k0, BK)
        s0 += tl.sum(k_0.to(tl.float32) * k_0.to(tl.float32), axis=1)
        s1 += tl.sum(k_1.to(tl.float32) * k_1.to(tl.float32), axis=1)
        s2 += tl.sum(k_2.to(tl.float32) * k_2.to(tl.float32), axis=1)
        s3 += tl.sum(k_3.to(tl.float32) * k_3.to(tl.float32), axis=1)
        A00 = tl.dot(k_0, tl.trans(k_0), A00, input_precision=P)
        A10 = tl.dot(k_1, tl.trans(k_0), A10, input_precision=P)
        A11 = tl.dot(k_1, tl.trans(k_1), A11, input_precision=P)
        A20 = tl.dot(k_2, tl.trans(k_0), A20, input_precision=P)
        A21 = tl.dot(k_2, tl.trans(k_1), A21, input_precision=P)
        A22 = tl.dot(k_2, tl.trans(k_2), A22, input_precision=P)
        A30 = tl.dot(k_3, tl.trans(k_0), A30, input_precision=P)
        A31 = tl.dot(k_3, tl.trans(k_1), A31, input_precision=P)
        A32 = tl.dot(k_3, tl.trans(k_2), A32, input_precision=P)
        A33 = tl.dot(k_3, tl.trans(k_3), A33, input_precision=P)
    # A_ij = beta_i r_i r_j (k_i . k_j) e^{G_i - G_j}: strictly lower inside the diagonal blocks
    b0, b1, b2, b3 = tl.rsqrt(s0 + 1e-6), tl.rsqrt(s1 + 1e-6), tl.rsqrt(s2 + 1e-6), tl.rsqrt(s3 + 1e-6)
    a0 = _sub_block_vec(beta_ptr, t0, 0, n, HV, i_hv) * b0
    a1 = _sub_block_vec(beta_ptr, t0, 1, n, HV, i_hv) * b1
    a2 = _sub_block_vec(beta_ptr, t0, 2, n, HV, i_hv) * b2
    a3 = _sub_block_vec(beta_ptr, t0, 3, n, HV, i_hv) * b3
    low = r[:, None] > r[None, :]
    A00 = tl.where(low, A00 * a0[:, None] * b0[None, :] * tl.exp(G0[:, None] - G0[None, :]), 0.0)
    A11 = tl.where(low, A11 * a1[:, None] * b1[None, :] * tl.exp(G1[:, None] - G1[None, :]), 0.0)
    A22 = tl.where(low, A22 * a2[:, None] * b2[None, :] * tl.exp(G2[:, None] - G2[None, :]), 0.0)
    A33 = tl.where(low, A33 * a3[:, None] * b3[None, :] * tl.exp(G3[:, None] - G3[None, :]), 0.0)
    A10 = A10 * a1[:, None] * b0[None, :] * tl.exp(G1[:, None] - G0[None, :])
    A20 = A20 * a2[:, None] * b0[None, :] * tl.exp(G2[:, None] - G0[None, :])
    A21 = A21 * a2[:, None] * b1[None, :] * tl.exp(G2[:, None] - G1[None, :])
    A30 = A30 * a3[:, None] * b0[None, :] * tl.exp(G3[:, None] - G0[None, :])
    A31 = A31 * a3[:, None] * b1[None, :] * tl.exp(G3[:, None] - G1[None, :])
    A32 = A32 * a3[:, None] * b2[None, :] * tl.exp(G3[:, None] - G2[None, :])
    T00 = _unit_lower_inverse_16(A00)
    T11 = _unit_lower_inverse_16(A11)
    T22 = _unit_lower_inverse_16(A22)
    T33 = _unit_lower_inverse_16(A33)
    T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=P), input_precision=P)
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=P), input_precision=P)
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=P), input_precision=P)
    T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=P) + tl.dot(A21, T10, input_precision=P), input_precision=P)
    T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=P) + tl.dot(A32, T21, input_precision=P), input_precision=P)
    T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=P) + tl.dot(A31, T10, input_precision=P)
                  + tl.dot(A32, T20, input_precision=P), input_precision=P)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_sub_block(t_ptr, T00, t0, 0, 0, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, zero, t0, 0, 1, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, zero, t0, 0, 2, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, zero, t0, 0, 3, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T10, t0, 1, 0, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T11, t0, 1, 1, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, zero, t0, 1, 2, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, zero, t0, 1, 3, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T20, t0, 2, 0, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T21, t0, 2, 1, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T22, t0, 2, 2, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, zero, t0, 2, 3, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T30, t0, 3, 0, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T31, t0, 3, 1, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T32, t0, 3, 2, n, HV, i_hv, BT)
    _store_sub_block(t_ptr, T33, t0, 3, 3, n, HV, i_hv, BT)


def inverse_rows(q, k, g, beta, T, H, HV, K, BT, slots, rows):
    """The two inversions alone: times, and each one's distance from a float64 inverse of the
    same A (first 64 chunks of head 0)."""
    outs, names = [], []
    for method, block_k, warps in ((0, 0, 4), (1, 0, 4), *itertools.product((2,), (32, 64), (1, 2, 4))):
        t = torch.empty(T, HV, BT, dtype=torch.float32, device="cuda")

        def run():
            if method == 2:
                _inverse_blocks_kernel[(slots, HV)](k, g, beta, t, T, H=H, HV=HV, K=K, BT=BT, BK=block_k, P="tf32",
                                                    num_warps=warps)
            else:
                _inverse_kernel[(slots, HV)](k, g, beta, t, T, H=H, HV=HV, K=K, BT=BT, SUB=chunk.SUB, METHOD=method,
                                            P="tf32", num_warps=warps)
        names.append(("substitution", "products", f"16-row blocks BK{block_k} w{warps}")[method])
        try:
            run()
            rows[f"inverse only, {names[-1]}"] = bench(run)
            outs.append(t)
        except Exception as exc:
            rows[f"inverse only, {names[-1]}"] = type(exc).__name__
            outs.append(None)
    # float64 reference inverse of the same A for a few chunks (l2-normalised keys, as the kernel)
    kn = torch.nn.functional.normalize(k[0, : 64 * BT, 0].double(), dim=-1).view(64, BT, K)
    G = g[0, : 64 * BT, 0].double().view(64, BT).cumsum(-1)
    b = beta[0, : 64 * BT, 0].double().view(64, BT)
    A = torch.tril(b[:, :, None] * (kn @ kn.transpose(1, 2)) * torch.exp(G[:, :, None] - G[:, None, :]), -1)
    ref = torch.linalg.inv(torch.eye(BT, dtype=torch.float64, device="cuda") + A)
    for name, t in zip(names, outs):
        if t is not None:
            got = t[: 64 * BT, 0].double().view(64, BT, BT)
            rows[f"inverse only, {name} max abs err"] = (got - ref).abs().max().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    T, H, HV, K, V, BT = args.T, 16, 32, 128, 128, chunk.CHUNK
    torch.manual_seed(0)
    q, k = (torch.randn(1, T, H, K, device="cuda", dtype=DT) for _ in range(2))
    v = torch.randn(1, T, HV, V, device="cuda", dtype=DT)
    g = -torch.rand(1, T, HV, device="cuda") * 0.5
    beta = torch.rand(1, T, HV, device="cuda")
    slots = T // BT
    G = torch.empty(T, HV, dtype=torch.float32, device="cuda")
    u, new_v = (torch.empty(T, HV, V, dtype=DT, device="cuda") for _ in range(2))
    w = torch.empty(T, HV, K, dtype=DT, device="cuda")
    keys = torch.empty(T, H, K, dtype=DT, device="cuda")  # the l2-normalised keys the prepare kernel writes
    kd = torch.empty(T, HV, K, dtype=DT, device="cuda")  # K e^{G_C - G}, for the backward recurrence
    aqk = torch.empty(T, HV, BT, dtype=DT, device="cuda")
    h = torch.empty(slots, HV, K, V, dtype=DT, device="cuda")
    scale = K ** -0.5
    rows = {}

    inverse = torch.empty(T, HV, BT, dtype=DT, device="cuda")  # T as the forward stores it: the input dtype

    def prepare(warps, store=False, load=False):
        chunk._chunk_prepare_kernel[(slots, HV)](
            q, k, v, g, beta, G, u, w, keys, kd, aqk, inverse, h, q, q, T, scale, q.stride(1), k.stride(1), v.stride(1),
            H=H, HV=HV, K=K, V=V, BT=BT, SUB=chunk.SUB,
            BK=128, BV=128, L2NORM=True, P="tf32", EQUAL=True, STORE_T=store, LOAD_T=load,
            num_warps=warps)

    for warps in (2, 4, 8):
        rows[f"prepare w{warps}"] = bench(lambda: prepare(warps))
        print(rows, flush=True)
    inverse_rows(q, k, g, beta, T, H, HV, K, BT, slots, rows)
    rows["prepare storing T w4"] = bench(lambda: prepare(4, store=True))
    rows["prepare from stored T (backward) w4"] = bench(lambda: prepare(4, load=True))
    prepare(chunk.PREPARE_WARPS)
    h_ref = None
    for block_v, warps, stages in itertools.product((16, 32, 64), (2, 4), (2, 3, 4)):
        def run():
            chunk._chunk_recurrence_kernel[(V // block_v, HV)](
                u, w, keys, G, h, new_v, G, G, q, q, T, G, G, H * K, H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=block_v,
                HAS_H0=False, STORE_HT=False, P="tf32", EQUAL=True, INDEXED=False, HAS_H0_FLAGS=False, num_warps=warps,
                num_stages=stages)
        try:
            run()
            torch.cuda.synchronize()
            if h_ref is None:
                h_ref = h.float().clone()
            rows[f"recurrence BV{block_v} w{warps} s{stages}"] = bench(run)
            rows[f"recurrence BV{block_v} w{warps} s{stages} err"] = ((h.float() - h_ref).norm() / h_ref.norm()).item()
        except Exception as exc:  # out of shared memory at some geometries
            rows[f"recurrence BV{block_v} w{warps} s{stages}"] = type(exc).__name__
        print(block_v, warps, stages, rows[f"recurrence BV{block_v} w{warps} s{stages}"], flush=True)
    try:  # flash-linear-attention's forward recurrence on the same inputs (its gate in log2 units)
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

        G_log2, w4, u4 = (G * 1.4426950408889634).view(1, T, HV), w.view(1, T, HV, K), u.view(1, T, HV, V)
        rows["fla-core fwd_h (autotuned)"] = bench(
            lambda: chunk_gated_delta_rule_fwd_h(k=keys.view(1, T, H, K), w=w4, u=u4, g=G_log2))
    except Exception as exc:  # noqa: BLE001 - fla-core absent or refusing
        rows["fla-core fwd_h (autotuned)"] = f"{type(exc).__name__}: {exc}"[:200]
    print(rows, flush=True)
    # backward recurrence (inputs: the forward's, a random dO)
    chunk._chunk_recurrence_kernel[(V // 32, HV)](
        u, w, keys, G, h, new_v, G, G, q, q, T, G, G, H * K, H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=32, HAS_H0=False,
        STORE_HT=False, P="tf32", EQUAL=True, INDEXED=False, HAS_H0_FLAGS=False, num_warps=4, num_stages=4)
    do = torch.randn(T, HV, V, device="cuda", dtype=DT)
    dh = torch.empty_like(h)
    dn = torch.empty_like(new_v)
    for block_v, warps, stages in itertools.product((16, 32, 64), (2, 4, 8), (2, 3, 4)):
        st = chunk_backward.bwd_recurrence_stages(stages, K, block_v, DT, max_shared_memory(q.device))

        def bwd():
            chunk_backward._chunk_bwd_recurrence_kernel[(V // block_v, HV)](
                q, do, G, aqk, kd, w, dh, dn, G, G, q, q, T, scale, H=H, HV=HV, K=K, V=V, BT=BT, BK=K,
                BV=block_v, L2NORM=True, HAS_DHT=False, STORE_DH0=False, P="tf32", EQUAL=True, num_warps=warps,
                num_stages=st)
        key = f"bwd recurrence BV{block_v} w{warps} s{st}"
        if key in rows:
            continue
        try:
            rows[key] = bench(bwd)
        except Exception as exc:
            rows[key] = type(exc).__name__
        print(key, rows[key], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gdn_train_sweep.json").write_text(json.dumps({"T": T, "device": torch.cuda.get_device_name(),
                                                               "ms": rows}, indent=1))
    lines = [f"## GDN chunk kernels at the training shape, T {T}, HV 32, K = V = 128, bf16, "
             f"{torch.cuda.get_device_name()} (ms per launch)", "", "| case | ms |", "|---|---|"]
    lines += [f"| {key} | {val:.4g} |" if isinstance(val, float) else f"| {key} | {val} |" for key, val in rows.items()]
    (args.out / "gdn_train_sweep.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
