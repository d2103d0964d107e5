"""The Gated DeltaNet forward recurrence at the training shape (issue 20), bf16, T 16384, q/k 16
heads, v 32 heads, K = V = 128: fuselm's kernel beside flash-linear-attention's
``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` (autotuned; its pick printed) on the same
inputs, and variants of fuselm's that read the keys (l2-normalised, decayed to the chunk end in
the kernel) instead of the prepare kernel's stored Kd, with the state update as an accumulating
dot.

    python benchmarks/gdn_recurrence_variants.py --out DIR   -> gdn_recurrence_variants.md
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule import chunk
from fuselm.ops.gated_delta_rule.chunk import _load_keys, _load_rows
from timing import bench

DT = torch.bfloat16


@triton.jit
def _recurrence_from_keys(u_ptr, w_ptr, k_ptr, G_ptr, h_ptr, new_v_ptr, seq_len, stride_k,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr):
    """fuselm's recurrence (one sequence) with Kd = K e^{G_C - G} made here from the keys."""
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    v0 = tl.program_id(0) * BV
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    state_offs = (i_hv * K + ck)[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    dt = w_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    for i_c in tl.range(0, tl.cdiv(seq_len, BT)):
        t0 = i_c * BT
        n = tl.minimum(seq_len - t0, BT)
        row_ok = rows < n
        w = _load_rows(w_ptr, t0, n, HV * K, i_hv * K, K, BT, BK)
        k = _load_keys(k_ptr, t0, n, stride_k, i_h * K, K, BT, BK, L2NORM)
        G = tl.load(G_ptr + (t0 + rows) * HV + i_hv, mask=row_ok, other=0.0)
        u = _load_rows(u_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV).to(tl.float32)
        G_last = tl.load(G_ptr + (t0 + n - 1) * HV + i_hv)
        kd = (k * tl.where(row_ok, tl.exp(G_last - G), 0.0)[:, None]).to(dt)
        S_in = S.to(dt)
        tl.store(h_ptr + i_c * HV * K * V + state_offs, S_in)
        new_v = (u - tl.dot(w, S_in)).to(dt)
        tl.store(new_v_ptr + ((t0 + rows) * HV + i_hv)[:, None] * V + cv[None, :], new_v, mask=row_ok[:, None])
        if ACC:
            S = tl.dot(tl.trans(kd), new_v, S * tl.exp(G_last))
        else:
            S = tl.exp(G_last) * S + tl.dot(tl.trans(kd), new_v)


@triton.jit
def _recurrence_halves(u_ptr, w_ptr, k_ptr, G_ptr, h_ptr, new_v_ptr, T, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, FROM_KEYS: tl.constexpr):
    """flash-linear-attention's blockdim64 structure (K = 128 as two 64-row halves of the state, a
    1-D grid, keys loaded transposed, accumulating dots) on fuselm's tensors: Kd (FROM_KEYS False)
    or l2-normalised keys with the decay on N (FROM_KEYS, FLA's own way)."""
    pid = tl.program_id(0).to(tl.int64)
    NV: tl.constexpr = V // BV
    i_v, i_hv = pid % NV, pid // NV
    dt = w_ptr.dtype.element_ty
    h_ptr += i_hv * K * V
    u_ptr += i_hv * V
    new_v_ptr += i_hv * V
    w_ptr += i_hv * K
    if FROM_KEYS:
        k_ptr += (i_hv // (HV // H)) * K
        stride_k: tl.constexpr = H * K
    else:
        k_ptr += i_hv * K
        stride_k: tl.constexpr = HV * K
    o_v = i_v * BV + tl.arange(0, BV)
    o_k1 = tl.arange(0, 64)
    o_k2 = 64 + o_k1
    b_h1 = tl.zeros([64, BV], dtype=tl.float32)
    b_h2 = tl.zeros([64, BV], dtype=tl.float32)
    for i_t in range(tl.cdiv(T, BT)):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        tl.store(h_ptr + i_t * HV * K * V + o_k1[:, None] * V + o_v[None, :], b_h1.to(dt))
        tl.store(h_ptr + i_t * HV * K * V + o_k2[:, None] * V + o_v[None, :], b_h2.to(dt))
        b_w = tl.load(w_ptr + o_t[:, None] * (HV * K) + o_k1[None, :], mask=m_t[:, None], other=0.0)
        b_v = tl.dot(b_w, b_h1.to(dt))
        b_w = tl.load(w_ptr + o_t[:, None] * (HV * K) + o_k2[None, :], mask=m_t[:, None], other=0.0)
        b_v = tl.dot(b_w, b_h2.to(dt), b_v)
        b_v = tl.load(u_ptr + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None], other=0.0) - b_v
        tl.store(new_v_ptr + o_t[:, None] * (HV * V) + o_v[None, :], b_v.to(dt), mask=m_t[:, None])
        last = tl.minimum((i_t + 1) * BT, T) - 1
        g_last = tl.load(G_ptr + last * HV + i_hv)
        if FROM_KEYS:
            b_g = tl.load(G_ptr + o_t * HV + i_hv, mask=m_t, other=0.0)
            b_v = b_v * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]
        decay = tl.exp(g_last)
        b_h1 *= decay
        b_h2 *= decay
        b_v = b_v.to(dt)
        b_k = tl.load(k_ptr + o_k1[:, None] + o_t[None, :] * stride_k, mask=m_t[None, :], other=0.0)
        b_h1 = tl.dot(b_k, b_v, b_h1)
        b_k = tl.load(k_ptr + o_k2[:, None] + o_t[None, :] * stride_k, mask=m_t[None, :], other=0.0)
        b_h2 = tl.dot(b_k, b_v, b_h2)


@triton.jit
def _recurrence_keys_decay_on_n(u_ptr, w_ptr, k_ptr, G_ptr, h_ptr, new_v_ptr, T, H: tl.constexpr, HV: tl.constexpr,
                                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                                BV: tl.constexpr, GRID_1D: tl.constexpr):
    """fuselm's recurrence (one [BK, BV] state tile, _load_rows) reading l2-normalised keys [T, H, K]
    with the decay on N: S = e^{G_C} S + K^T (N e^{G_C - G}), an accumulating dot."""
    if GRID_1D:
        pid = tl.program_id(0)
        i_v, i_hv = pid % (V // BV), pid // (V // BV)
    else:
        i_v, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    v0 = i_v * BV
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    state_offs = (i_hv * K + ck)[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    dt = w_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    for i_c in tl.range(0, tl.cdiv(T, BT)):
        t0 = i_c * BT
        n = tl.minimum(T - t0, BT)
        row_ok = rows < n
        w = _load_rows(w_ptr, t0, n, HV * K, i_hv * K, K, BT, BK)
        k = _load_rows(k_ptr, t0, n, H * K, i_h * K, K, BT, BK)
        G = tl.load(G_ptr + (t0 + rows) * HV + i_hv, mask=row_ok, other=0.0)
        u = _load_rows(u_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV).to(tl.float32)
        G_last = tl.load(G_ptr + (t0 + n - 1) * HV + i_hv)
        S_in = S.to(dt)
        tl.store(h_ptr + i_c * HV * K * V + state_offs, S_in)
        new_v = u - tl.dot(w, S_in)
        tl.store(new_v_ptr + ((t0 + rows) * HV + i_hv)[:, None] * V + cv[None, :], new_v.to(dt), mask=row_ok[:, None])
        nd = (new_v * tl.where(row_ok, tl.exp(G_last - G), 0.0)[:, None]).to(dt)
        S = tl.dot(tl.trans(k), nd, S * tl.exp(G_last))


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
    w, kd = (torch.empty(T, HV, K, dtype=DT, device="cuda") for _ in range(2))
    aqk = torch.empty(T, HV, BT, dtype=DT, device="cuda")
    inverse = torch.empty(T, HV, BT, dtype=torch.float32, device="cuda")
    h = torch.empty(slots, HV, K, V, dtype=DT, device="cuda")
    chunk._chunk_prepare_kernel[(slots, HV)](
        q, k, v, g, beta, G, u, w, kd, aqk, inverse, q, q, T, K ** -0.5, q.stride(1), k.stride(1), v.stride(1),
        H=H, HV=HV, K=K, V=V, BT=BT, SUB=chunk.SUB, BK=128, BV=128, L2NORM=True, P="tf32", EQUAL=True,
        STORE_T=False, LOAD_T=False, num_warps=chunk.PREPARE_WARPS)
    rows = {}

    def ours(block_v, warps, stages):
        chunk._chunk_recurrence_kernel[(V // block_v, HV)](
            u, w, kd, G, h, new_v, G, G, q, q, T, G, G, HV=HV, K=K, V=V, BT=BT, BK=K, BV=block_v, HAS_H0=False,
            STORE_HT=False, P="tf32", EQUAL=True, INDEXED=False, HAS_H0_FLAGS=False, num_warps=warps,
            num_stages=stages)

    block_v, stages = chunk.recurrence_geometry(HV, V, q.device)
    ours(block_v, chunk.RECURRENCE_WARPS, stages)
    torch.cuda.synchronize()
    h_ref, nv_ref = h.float().clone(), new_v.float().clone()
    rows[f"fuselm today (BV{block_v} w{chunk.RECURRENCE_WARPS} s{stages})"] = bench(
        lambda: ours(block_v, chunk.RECURRENCE_WARPS, stages))
    print(rows, flush=True)

    def err():
        return max(((h.float() - h_ref).norm() / h_ref.norm()).item(),
                   ((new_v.float() - nv_ref).norm() / nv_ref.norm()).item())

    for acc, block_v, warps, stages in itertools.product((True,), (32,), (4,), (4,)):
        def run():
            _recurrence_from_keys[(V // block_v, HV)](u, w, k, G, h, new_v, T, k.stride(1), H=H, HV=HV, K=K, V=V,
                                                      BT=BT, BK=K, BV=block_v, L2NORM=True, ACC=acc,
                                                      num_warps=warps, num_stages=stages)
        key = f"from keys{' acc' if acc else ''} BV{block_v} w{warps} s{stages}"
        try:
            h.zero_()
            run()
            torch.cuda.synchronize()
            rows[key + " err"] = err()
            rows[key] = bench(run)
        except Exception as exc:  # noqa: BLE001 - shared memory at some geometries
            rows[key] = type(exc).__name__
        print(key, rows[key], rows.get(key + " err"), flush=True)
    kf = k.float()
    k_l2 = (kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(DT)
    for grid_1d, block_v, stages in itertools.product((False, True), (16, 32, 64), (3, 4)):
        def run_single():
            grid = (V // block_v * HV,) if grid_1d else (V // block_v, HV)
            _recurrence_keys_decay_on_n[grid](u, w, k_l2, G, h, new_v, T, H=H, HV=HV, K=K, V=V, BT=BT, BK=K,
                                              BV=block_v, GRID_1D=grid_1d, num_warps=4, num_stages=stages)
        key = f"one tile, keys, decay on N{' 1-D grid' if grid_1d else ''} BV{block_v} w4 s{stages}"
        try:
            h.zero_()
            run_single()
            torch.cuda.synchronize()
            rows[key + " err"] = err()
            rows[key] = bench(run_single)
        except Exception as exc:  # noqa: BLE001
            rows[key] = type(exc).__name__
        print(key, rows[key], rows.get(key + " err"), flush=True)
    for from_keys, block_v, warps, stages in itertools.product((False, True), (16, 32, 64), (4,), (3, 4)):
        def run_halves():
            _recurrence_halves[(V // block_v * HV,)](u, w, k_l2 if from_keys else kd, G, h, new_v, T, H=H, HV=HV, K=K,
                                                     V=V, BT=BT, BV=block_v, FROM_KEYS=from_keys, num_warps=warps,
                                                     num_stages=stages)
        key = f"halves{' from keys (decay on N)' if from_keys else ' Kd'} BV{block_v} w{warps} s{stages}"
        try:
            h.zero_()
            run_halves()
            torch.cuda.synchronize()
            rows[key + " err"] = err()
            rows[key] = bench(run_halves)
        except Exception as exc:  # noqa: BLE001
            rows[key] = type(exc).__name__
        print(key, rows[key], rows.get(key + " err"), flush=True)
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h, \
            chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as fla_kernel
        G_log2 = (G * 1.4426950408889634).view(1, T, HV)
        w4, u4 = w.view(1, T, HV, K), u.view(1, T, HV, V)

        def fla():
            return chunk_gated_delta_rule_fwd_h(k=k_l2, w=w4, u=u4, g=G_log2)
        fla()
        torch.cuda.synchronize()
        rows["fla-core fwd_h (autotuned)"] = bench(fla)
        rows["fla-core pick"] = str(getattr(fla_kernel, "best_config", "?"))
    except Exception as exc:  # noqa: BLE001
        rows["fla-core fwd_h (autotuned)"] = f"{type(exc).__name__}: {exc}"[:200]
    print(rows, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"## GDN forward recurrence, T {T}, HV 32 (16 key heads), K = V = 128, bf16, "
             f"{torch.cuda.get_device_name()} (ms per launch; err: max relative distance of h and N from today's)",
             "", "| case | ms |", "|---|---|"]
    lines += [f"| {key} | {val:.4g} |" if isinstance(val, float) else f"| {key} | {val} |" for key, val in rows.items()]
    (args.out / "gdn_recurrence_variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
