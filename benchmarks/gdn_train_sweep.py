"""Geometry sweep of the Gated DeltaNet chunk kernels at the training shape (issue 20), bf16:
q/k [1, T, 16, 128], v [1, T, 32, 128] (HV 32 value heads sharing 16 key heads), T 16384.

    python benchmarks/gdn_train_sweep.py --out DIR     -> gdn_train_sweep.md / .json

Times (do_bench medians, ms) of each kernel launch alone, on inputs the previous kernels wrote:
the forward recurrence at each BV / warps / stages beside flash-linear-attention's
``chunk_gated_delta_rule_fwd_h`` (autotuned) on the same inputs (session 21's variants of the
recurrence, NOTES.md 53, are in git history as benchmarks/gdn_recurrence_variants.py), the backward
recurrence, the prepare kernel (and the inversion of I + A alone: forward substitution, session
16's, against products of powers, the library's).
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


def inverse_rows(q, k, g, beta, T, H, HV, K, BT, slots, rows):
    """The two inversions alone: times, and each one's distance from a float64 inverse of the
    same A (first 64 chunks of head 0)."""
    outs = []
    for method in (0, 1):
        t = torch.empty(T, HV, BT, dtype=torch.float32, device="cuda")

        def run():
            _inverse_kernel[(slots, HV)](k, g, beta, t, T, H=H, HV=HV, K=K, BT=BT, SUB=chunk.SUB, METHOD=method,
                                        P="tf32", num_warps=4)
        try:
            run()
            rows[f"inverse only, {('substitution', 'products')[method]}"] = bench(run)
            outs.append(t)
        except Exception as exc:
            rows[f"inverse only, {('substitution', 'products')[method]}"] = type(exc).__name__
            outs.append(None)
    # float64 reference inverse of the same A for a few chunks (l2-normalised keys, as the kernel)
    kn = torch.nn.functional.normalize(k[0, : 64 * BT, 0].double(), dim=-1).view(64, BT, K)
    G = g[0, : 64 * BT, 0].double().view(64, BT).cumsum(-1)
    b = beta[0, : 64 * BT, 0].double().view(64, BT)
    A = torch.tril(b[:, :, None] * (kn @ kn.transpose(1, 2)) * torch.exp(G[:, :, None] - G[:, None, :]), -1)
    ref = torch.linalg.inv(torch.eye(BT, dtype=torch.float64, device="cuda") + A)
    for method, t in enumerate(outs):
        if t is not None:
            got = t[: 64 * BT, 0].double().view(64, BT, BT)
            rows[f"inverse only, {('substitution', 'products')[method]} max abs err"] = (got - ref).abs().max().item()


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

    inverse = torch.empty(T, HV, BT, dtype=torch.float32, device="cuda")

    def prepare(warps, store=False, load=False):
        chunk._chunk_prepare_kernel[(slots, HV)](
            q, k, v, g, beta, G, u, w, keys, kd, aqk, inverse, q, q, T, scale, q.stride(1), k.stride(1), v.stride(1),
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
