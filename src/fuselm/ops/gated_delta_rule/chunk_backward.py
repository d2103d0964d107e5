"""Backward of the chunked gated delta rule (``chunk.py``) in Triton, and the autograd Function
that ``chunk_gated_delta_rule`` uses when a gradient is needed.

The math (derived in ``chunk_backward_naive.py``, which computes the same thing in PyTorch), per
chunk of BT = 64 tokens and value head, with S0 = h[c] the state at the chunk start and dS1 the
gradient of the state at its end:
    dN  = Aqk^T dO + Kd dS1,        dS0 = e^{G_C} dS1 + Qg^T dO - W^T dN      (sequential over chunks)
    dQg = dO S0^T,  dAqk = lower(dO N^T),  dKd = N dS1^T,  dW = -dN S0^T       (parallel per chunk)
    dVb = T^T dN,   dKb = T^T dW,   dT = dN Vb^T + dW Kb^T,   dA = strictly_lower(-T^T dT T^T)
and from those the leaves dq, dk, dv, dg, dbeta. dg = reverse_cumsum(dG) (G = cumsum(g)) is summed
pair by pair, dg_t = sum_{i >= t} x_i + e^{G_C} <dS1, S0> + sum_{i < t} r_i + sum_{i >= t > j} M_ij
(``chunk_backward_naive.py``), so that no O(1) terms cancel into a tiny dg under strong decay.

Kernels, per backward call:
1. ``_chunk_prepare_kernel`` (the forward's, re-run): G, U, W, Kd = K e^{G_C - G}, Aqk.
2. ``_chunk_recurrence_kernel`` (the forward's, re-run): the chunk-start states h[c] and N.
3. ``_chunk_bwd_recurrence_kernel``, one program per (sequence, value head, BV value columns): the
   only sequential part, walking the chunks in reverse with dS [K, BV] (fp32) on chip. Per chunk
   two dependent dots (Kd dS, then W^T dN) and two that do not depend on dS (Aqk^T dO, Qg^T dO);
   writes dh[c] = dS1 (the gradient of chunk c's end state) and dN; and d(initial_state).
4. ``_chunk_bwd_grads_kernel``, one program per (chunk, value head), all chunks in parallel: loads
   q, k, v, g, beta, h[c], dh[c], N, dN, dO; recomputes G, Gamma, A, T (the forward's inverse),
   accumulates the products over the value dim in BV-column blocks, and writes dq, dk (per value
   head, fp32: summed over the value heads sharing a key head afterwards), dv, dg, dbeta.

Saved by the forward: only its inputs (q, k, v, g, beta, initial_state, cu_seqlens). Recomputed:
G, U, W, Kd, Aqk and the chunk-start states h[c] and new values N (kernels 1 and 2, the cost of
the forward minus its output kernel; storing h[c] would hold N_chunks x HV x K x V values from the
forward to the backward), and T = (I + A)^-1 inside kernel 4 (it is not stored by the forward).

Not yet run on a GPU. Kernel 4 builds for sm_90 (triton.compile for the target, here without a
GPU), but holds many [BT, K] and [BT, BT] fp32 tiles at once: at K = V = 128, bf16, 8 warps,
ptxas reports 255 registers and ~3 KB of spills per thread. If it is slow, split it as
flash-linear-attention does (a dq/dk/dW/dg kernel over the value blocks, then the WY part).

Numerics as the forward: products take operands in the input dtype (h, dh, N, dN and the
gradient matrices dP, dB rounded to it) with fp32 accumulation; dS, G, T, dA and all per-token
reductions stay fp32; fp32 inputs use ieee fp32 dots. The l2 norm of q and k
(``use_qk_l2norm_in_kernel``) is applied in the kernels (as in the forward) and differentiated
in kernel 4: for y = x rsqrt(|x|^2 + 1e-6), dx = rsqrt(|x|^2 + 1e-6) (dy - y <y, dy>), applied per
value head before the head sum (it is linear in dy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.chunk import (
    CHUNK, PREPARE_WARPS, RECURRENCE_BLOCK_V, RECURRENCE_STAGES, RECURRENCE_WARPS, SUB, _chunk_prepare_kernel,
    _chunk_recurrence_kernel, _chunk_span, _invert_unit_lower, _load_keys, _load_rows, _load_vec, _mm, _state_block,
    _store_block, chunk_gated_delta_rule_kernels, chunk_table,
)
from fuselm.runtime import cdiv, max_shared_memory, next_power_of_2, num_sms

# Value columns per step of the grads kernel's loop over V (it bounds the live tiles). Shared memory
# of its sm_90 build at K = V = 128 (triton.compile for the target, not run on a GPU): 16-bit
# inputs with 64 columns 120 KiB; fp32 with 64 columns 336 KiB (over the 227 KiB of an H100), 32
# columns 208 KiB, 16 columns 144 KiB (fits an A100's 164 KiB too).
GRADS_BLOCK_V = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 16}
GRADS_WARPS = 8
BWD_SCRATCH_BYTES = 36 * 1024  # shared memory kept out of the backward recurrence's pipeline stages


@triton.jit
def _chunk_bwd_recurrence_kernel(
    q_ptr, do_ptr, G_ptr, aqk_ptr, kd_ptr, w_ptr, dh_ptr, dn_ptr, dht_ptr, dh0_ptr, cu_seqlens_ptr, first_chunk_ptr,
    seq_len, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    P: tl.constexpr, EQUAL: tl.constexpr,
):
    """Chunks in reverse, dS = the gradient of the state at the current chunk's end:
    dh[c] = dS (input dtype), dN = Aqk^T dO + Kd dS (stored), dS = e^{G_C} dS + Qg^T dO - W^T dN."""
    i_n, i_hv, v0, bos, eos, first_chunk, cv, state_mask, state_offs, dS = _state_block(
        dht_ptr, cu_seqlens_ptr, first_chunk_ptr, seq_len, HAS_DHT, HV, K, V, BT, BK, BV, EQUAL)
    i_h = i_hv // (HV // H)
    dt = w_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    n_chunks = tl.cdiv(eos - bos, BT)
    for i in tl.range(0, n_chunks):
        i_c = n_chunks - 1 - i
        t0 = bos + i_c * BT
        n = tl.minimum(eos - t0, BT)
        row_ok = rows < n
        # loads independent of dS (pipelined ahead of the dependent dots)
        q = _load_keys(q_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        G = _load_vec(G_ptr, t0, n, HV, i_hv, BT)
        G_last = tl.load(G_ptr + (t0 + n - 1) * HV + i_hv)
        qg = (q * (tl.exp(G) * scale)[:, None]).to(dt)  # Qg = Q e^G scale
        aqk = _load_rows(aqk_ptr, t0, n, HV * BT, i_hv * BT, BT, BT, BT)
        do = _load_rows(do_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV)
        kd = _load_rows(kd_ptr, t0, n, HV * K, i_hv * K, K, BT, BK)
        w = _load_rows(w_ptr, t0, n, HV * K, i_hv * K, K, BT, BK)
        dS_in = dS.to(dt)
        tl.store(dh_ptr + (first_chunk + i_c) * HV * K * V + state_offs, dS_in, mask=state_mask)
        dn = (_mm(tl.trans(aqk), do, P) + _mm(kd, dS_in, P)).to(dt)
        tl.store(dn_ptr + ((t0 + rows) * HV + i_hv)[:, None] * V + cv[None, :], dn,
                 mask=row_ok[:, None] & (cv < V)[None, :])
        dS = tl.exp(G_last) * dS + _mm(tl.trans(qg), do, P) - _mm(tl.trans(w), dn, P)
    if STORE_DH0:
        tl.store(dh0_ptr + i_n.to(tl.int64) * HV * K * V + state_offs, dS, mask=state_mask)


@triton.jit
def _load_normalised(ptr, t0, n_rows, stride_t, col0, n_cols, BT: tl.constexpr, BC: tl.constexpr, L2NORM: tl.constexpr):
    """(y, r): q or k rows in fp32 and, when L2NORM, y = x r with r = rsqrt(sum x^2 + 1e-6)
    (as ``_load_keys``), r kept for the norm's backward."""
    x = _load_rows(ptr, t0, n_rows, stride_t, col0, n_cols, BT, BC).to(tl.float32)
    if L2NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)
    else:
        r = tl.full([BT], 1.0, tl.float32)
    return x * r[:, None], r


@triton.jit
def _chunk_bwd_grads_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h_ptr, dh_ptr, new_v_ptr, dn_ptr, do_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, chunk_start_ptr, chunk_len_ptr, seq_len, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, P: tl.constexpr, EQUAL: tl.constexpr,
):
    """dq, dk (per value head, fp32), dv, dg, dbeta of one chunk and value head (module docstring)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, chunk_start_ptr, chunk_len_ptr, seq_len, BT, EQUAL)
    if n > 0:
        dt = k_ptr.dtype.element_ty
        rows = tl.arange(0, BT)
        row_ok = rows < n
        ck = tl.arange(0, BK)
        # recompute the chunk's forward terms (fp32): G, Gamma, Q K^T, A and T = (I + A)^-1
        G = tl.cumsum(_load_vec(g_ptr, t0, n, HV, i_hv, BT), axis=0)
        G_last = tl.sum(tl.where(rows == n - 1, G, 0.0), axis=0)
        eG = tl.exp(G)
        decay_to_end = tl.where(row_ok, tl.exp(G_last - G), 0.0)  # e^{G_C - G}
        beta = _load_vec(beta_ptr, t0, n, HV, i_hv, BT)
        q, rq = _load_normalised(q_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        k, rk = _load_normalised(k_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        q_dt, k_dt = q.to(dt), k.to(dt)
        lower = (rows[:, None] >= rows[None, :]) & row_ok[:, None]
        strict = rows[:, None] > rows[None, :]
        gamma = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
        qk = _mm(q_dt, tl.trans(k_dt), P)
        kk = _mm(k_dt, tl.trans(k_dt), P)
        A = tl.where(strict, beta[:, None] * kk * gamma, 0.0)
        T = _invert_unit_lower(A, BT, SUB, P)
        T_dt = T.to(dt)
        # products over the value dim, BV columns at a time
        dqg = tl.zeros([BT, BK], dtype=tl.float32)  # dO S0^T
        dkd = tl.zeros([BT, BK], dtype=tl.float32)  # N dS1^T
        dns = tl.zeros([BT, BK], dtype=tl.float32)  # dN S0^T = -dW
        daqk = tl.zeros([BT, BT], dtype=tl.float32)  # dO N^T
        dT = tl.zeros([BT, BT], dtype=tl.float32)  # dN Vb^T (+ dW Kb^T below)
        dbeta = tl.zeros([BT], dtype=tl.float32)
        dS_S = tl.zeros([BK], dtype=tl.float32)  # rows of <dS1, S0>
        state_base = (i_c * HV + i_hv).to(tl.int64) * K * V
        for i_v in tl.range(0, tl.cdiv(V, BV)):
            v0 = i_v * BV
            cv = v0 + tl.arange(0, BV)
            state_mask = (ck < K)[:, None] & (cv < V)[None, :]
            h = tl.load(h_ptr + state_base + ck[:, None] * V + cv[None, :], mask=state_mask, other=0.0)
            dh = tl.load(dh_ptr + state_base + ck[:, None] * V + cv[None, :], mask=state_mask, other=0.0)
            nv = _load_rows(new_v_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV)
            dn = _load_rows(dn_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV)
            do = _load_rows(do_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV)
            v = _load_rows(v_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV).to(tl.float32)
            dqg += _mm(do, tl.trans(h), P)
            dkd += _mm(nv, tl.trans(dh), P)
            dns += _mm(dn, tl.trans(h), P)
            daqk += _mm(do, tl.trans(nv), P)
            dS_S += tl.sum(dh.to(tl.float32) * h.to(tl.float32), axis=1)
            dT += _mm(dn, tl.trans((v * beta[:, None]).to(dt)), P)
            dvb = _mm(tl.trans(T_dt), dn, P)  # dVb = T^T dU, dU = dN
            _store_block(dv_ptr, dvb * beta[:, None], t0, n, HV * V, i_hv * V + v0, V - v0, BV, BT)
            dbeta += tl.sum(dvb * v, axis=1)
        # through W = T Kb, Kb = diag(beta e^G) K, and T = (I + A)^-1
        kb = k * (beta * eG)[:, None]
        dw = (-dns).to(dt)
        dT += _mm(dw, tl.trans(kb.to(dt)), P)
        dkb = _mm(tl.trans(T_dt), dw, P)
        dA = tl.where(strict, -_mm(_mm(tl.trans(T), dT, P), tl.trans(T), P), 0.0)
        # through Aqk = lower(Q K^T * Gamma) scale and A = strictly_lower(diag(beta) (K K^T * Gamma))
        daqk = tl.where(lower, daqk, 0.0)
        dP = (daqk * gamma * scale).to(dt)  # d(Q K^T)
        dB = dA * beta[:, None] * gamma  # d(K K^T), strictly lower
        dBB = (dB + tl.trans(dB)).to(dt)
        dq = dqg * (eG * scale)[:, None] + _mm(dP, k_dt, P)
        dk = (_mm(tl.trans(dP), q_dt, P) + dkd * decay_to_end[:, None] + dkb * (beta * eG)[:, None]
              + _mm(dBB, k_dt, P))
        dbeta += eG * tl.sum(dkb * k, axis=1) + tl.sum(dA * kk * gamma, axis=1)
        # dg_t = sum_{i >= t} dG_i (G = cumsum(g)), summed where each term's decay crosses t
        # (chunk_backward_naive.py: a plain reverse cumsum of dG cancels O(1) terms down to a
        # tiny dg under strong decay, 2.6e-3 relative in fp32 at g ~ -10):
        #   dg_t = sum_{i >= t} x_i + e^{G_C} <dS1, S0> + sum_{i < t} r_i + sum_{i >= t > j} M_ij
        x = tl.sum(dqg * q, axis=1) * eG * scale + tl.sum(dkb * kb, axis=1)  # Qg, Kb carry e^{G_i}
        r = tl.sum(dkd * k * decay_to_end[:, None], axis=1)  # Kd = K e^{G_C - G}
        M = daqk * (qk * gamma * scale) + dA * A  # Aqk and A carry Gamma_ij = e^{G_i - G_j}
        at_or_after = rows[:, None] >= rows[None, :]  # [i, t]: i >= t
        # sum_{j < t} M_ij for every (i, t) as one product with the strictly upper ones; ieee also
        # for 16-bit inputs (tf32 would round M's entries to 10 bits)
        m_before = tl.dot(M, tl.where(at_or_after, 0.0, 1.0), input_precision="ieee")
        dg = (tl.sum(tl.where(at_or_after, x[:, None], 0.0), axis=0)
              + tl.sum(tl.where(at_or_after, 0.0, r[:, None]), axis=0)
              + tl.sum(tl.where(at_or_after, m_before, 0.0), axis=0)
              + tl.exp(G_last) * tl.sum(dS_S, axis=0))
        if L2NORM:  # y = x r: dx = r (dy - y <y, dy>)
            dq = rq[:, None] * (dq - q * tl.sum(q * dq, axis=1)[:, None])
            dk = rk[:, None] * (dk - k * tl.sum(k * dk, axis=1)[:, None])
        _store_block(dq_ptr, dq, t0, n, HV * K, i_hv * K, K, BK, BT)
        _store_block(dk_ptr, dk, t0, n, HV * K, i_hv * K, K, BK, BT)
        tl.store(dg_ptr + (t0 + rows) * HV + i_hv, dg, mask=row_ok)  # (rows >= n are not stored)
        tl.store(dbeta_ptr + (t0 + rows) * HV + i_hv, dbeta, mask=row_ok)


def bwd_recurrence_stages(stages: int, BK: int, BV: int, dtype: torch.dtype, shared_memory: int) -> int:
    """Pipeline stages of ``_chunk_bwd_recurrence_kernel``: each stage buffers a chunk's q, kd, w
    [BT, BK], aqk [BT, BT] and do [BT, BV] in the input dtype. At BK = 128 (Qwen3.5's heads) in 16
    bits that is 61,440 bytes a stage, and 4 stages (245,760) pass the H100's 232,448 bytes of
    shared memory a block (triton OutOfResources: FLA's own tests at D = 100 / 128, the bf16 model-
    shape gradient test). The stages take what the block may use (``shared_memory``) less
    BWD_SCRATCH_BYTES for the dots' and layout conversions' scratch (a model, not a count: the
    next GPU run checks it); never under 2 for 16-bit inputs (chunk.py says why)."""
    if stages <= 1:
        return stages
    per_stage = (3 * CHUNK * BK + CHUNK * CHUNK + CHUNK * BV) * torch.finfo(dtype).bits // 8
    return max(2, min(stages, (shared_memory - BWD_SCRATCH_BYTES) // per_stage))


def chunk_gated_delta_rule_backward_kernels(q, k, v, g, beta, scale, initial_state, do, dht, l2, cu_seqlens=None,
                                            seq_len=None):
    """Gradients on packed inputs q, k [1, T, H, K], v, do [1, T, HV, V], g, beta [1, T, HV] (N
    sequences given by ``cu_seqlens``, or T / seq_len of ``seq_len`` tokens), dht [N, HV, K, V]
    fp32 or None. Returns (dq, dk, dv, dg, dbeta) shaped and typed as their inputs, and dh0
    [N, HV, K, V] fp32 (None without initial_state)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None and seq_len == 1:  # never launch with seq_len == 1 (chunk.py says why)
        cu_seqlens = torch.arange(T + 1, dtype=torch.int32, device=q.device)
    equal = cu_seqlens is None
    N = T // seq_len if equal else cu_seqlens.numel() - 1
    BK, BV_full = next_power_of_2(K), next_power_of_2(V)
    dt, device = q.dtype, q.device
    precision, stages = ("ieee", 1) if dt == torch.float32 else ("tf32", RECURRENCE_STAGES)
    if equal:
        slots = N * cdiv(seq_len, CHUNK)
        start = length = first = cu_seqlens = q  # unused (EQUAL)
    else:
        start, length, first = chunk_table(cu_seqlens, T)
        slots, seq_len = start.numel(), 0
    # 1-2: the forward's G, U, W, Kd, Aqk, then h[c] and N
    G = torch.empty(T, HV, dtype=torch.float32, device=device)
    u, new_v = (torch.empty(T, HV, V, dtype=dt, device=device) for _ in range(2))
    w, kd = (torch.empty(T, HV, K, dtype=dt, device=device) for _ in range(2))
    aqk = torch.empty(T, HV, CHUNK, dtype=dt, device=device)
    h = torch.empty(slots, HV, K, V, dtype=dt, device=device)
    _chunk_prepare_kernel[(slots, HV)](
        q, k, v, g, beta, G, u, w, kd, aqk, start, length, seq_len, float(scale),
        H=H, HV=HV, K=K, V=V, BT=CHUNK, SUB=SUB, BK=BK, BV=BV_full, L2NORM=l2, P=precision, EQUAL=equal,
        num_warps=PREPARE_WARPS,
    )
    block_v = min(RECURRENCE_BLOCK_V, BV_full)
    if q.is_cuda and N * HV * cdiv(V, block_v) < num_sms(device):
        block_v = max(16, block_v // 2)
    _chunk_recurrence_kernel[(cdiv(V, block_v), N * HV)](
        u, w, kd, G, h, new_v, initial_state if initial_state is not None else G, G, cu_seqlens, first, seq_len,
        HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=block_v, HAS_H0=initial_state is not None, STORE_HT=False,
        P=precision, EQUAL=equal, num_warps=RECURRENCE_WARPS, num_stages=stages,
    )
    # 3: dS backwards over the chunks
    dh = torch.empty(slots, HV, K, V, dtype=dt, device=device)  # gradient of each chunk's end state
    dn = torch.empty(T, HV, V, dtype=dt, device=device)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if initial_state is not None else None
    _chunk_bwd_recurrence_kernel[(cdiv(V, block_v), N * HV)](
        q, do, G, aqk, kd, w, dh, dn, dht if dht is not None else G, dh0 if dh0 is not None else G,
        cu_seqlens, first, seq_len, float(scale), H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=block_v, L2NORM=l2,
        HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, P=precision, EQUAL=equal,
        num_warps=RECURRENCE_WARPS, num_stages=bwd_recurrence_stages(stages, BK, block_v, dt, max_shared_memory(device)),
    )
    # 4: every chunk's gradients in parallel
    dq, dk = (torch.empty(T, HV, K, dtype=torch.float32, device=device) for _ in range(2))
    dv = torch.empty(T, HV, V, dtype=v.dtype, device=device)
    dg, dbeta = (torch.empty(T, HV, dtype=torch.float32, device=device) for _ in range(2))
    _chunk_bwd_grads_kernel[(slots, HV)](
        q, k, v, g, beta, h, dh, new_v, dn, do, dq, dk, dv, dg, dbeta, start, length, seq_len, float(scale),
        H=H, HV=HV, K=K, V=V, BT=CHUNK, SUB=SUB, BK=BK, BV=min(GRADS_BLOCK_V[dt], BV_full), L2NORM=l2, P=precision,
        EQUAL=equal, num_warps=GRADS_WARPS,
    )
    # value heads sharing a key head: their dq, dk add up
    dq = dq.view(1, T, H, HV // H, K).sum(3).to(q.dtype)
    dk = dk.view(1, T, H, HV // H, K).sum(3).to(k.dtype)
    return dq, dk, dv.view(v.shape), dg.view(g.shape).to(g.dtype), dbeta.view(beta.shape).to(beta.dtype), dh0


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """(o, final_state) = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, ...) with
    gradients for q, k, v, g, beta and initial_state; the forward is ``chunk_gated_delta_rule_kernels``
    (the no-grad path's), the backward ``chunk_gated_delta_rule_backward_kernels``. Saves the inputs
    only (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, l2, cu_seqlens):
        B, T = q.shape[:2]
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        ctx.shapes = (B, T, N)
        ctx.scale, ctx.l2 = scale, l2
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        if N == 0 or B * T == 0:
            final = initial_state.clone() if output_final_state and initial_state is not None else None
            ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
            return torch.empty_like(v), final
        packed = [t.reshape(1, B * T, *t.shape[2:]).contiguous() for t in (q, k, v, g, beta)]
        o, final = chunk_gated_delta_rule_kernels(*packed, scale, initial_state, output_final_state, l2, cu_seqlens,
                                                  seq_len=T)
        ctx.save_for_backward(*packed, initial_state, cu_seqlens)
        return o.view(v.shape), final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        B, T, N = ctx.shapes
        need_h0 = ctx.needs_input_grad[5]
        if N == 0 or B * T == 0:
            grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
            dh0 = (dht.clone() if dht is not None else torch.zeros_like(initial_state)) if need_h0 else None
            return (*grads, dh0, None, None, None, None)
        if do is None:  # only the final state was used
            do = torch.zeros(B, T, *v.shape[2:], dtype=q.dtype, device=q.device)
        do = do.reshape(1, B * T, *do.shape[2:]).to(q.dtype).contiguous()  # the kernels' operand dtype
        dht = dht.contiguous() if dht is not None else None
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_backward_kernels(
            q, k, v, g, beta, ctx.scale, initial_state, do, dht, ctx.l2, cu_seqlens, seq_len=T)
        shape = lambda x: x.view(B, T, *x.shape[2:])  # noqa: E731
        return (shape(dq), shape(dk), shape(dv), shape(dg), shape(dbeta), dh0 if need_h0 else None,
                None, None, None, None)
