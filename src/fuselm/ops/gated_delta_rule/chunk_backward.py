"""Backward of the chunked gated delta rule (``chunk.py``) in Triton, and the autograd Function
that ``chunk_gated_delta_rule`` uses when a gradient is needed.

The math (derived in ``chunk_backward_naive.py``, which computes the same thing in PyTorch), per
chunk of BT = 64 tokens and value head, with S0 = h[c] the state at the chunk start and dS1 the
gradient of the state at its end:
    dN  = Aqk^T dO + Kd dS1,        dS0 = e^{G_C} dS1 + Qg^T dO - W^T dN      (sequential over chunks)
    (Kd = diag(e^{G_C - G}) K, written by the backward's prepare kernel)
    dQg = dO S0^T,  dAqk = lower(dO N^T),  dKd = N dS1^T,  dW = -dN S0^T       (parallel per chunk)
    dVb = T^T dN,   dKb = T^T dW,   dT = dN Vb^T + dW Kb^T,   dA = strictly_lower(-T^T dT T^T)
and from those the leaves dq, dk, dv, dg, dbeta. dg = reverse_cumsum(dG) (G = cumsum(g)) is summed
pair by pair, dg_t = sum_{i >= t} x_i + e^{G_C} <dS1, S0> + sum_{i < t} r_i + sum_{i >= t > j} M_ij
(``chunk_backward_naive.py``), so that no O(1) terms cancel into a tiny dg under strong decay.

Kernels, per backward call:
1. ``_chunk_prepare_kernel`` (the forward's, LOAD_T): G, W, Kd and the new values N = U - W h[c]
   from the forward's stored T and chunk-start states h (no K K^T, no inversion, no Aqk: the
   forward's is kept; no sequential pass: every chunk's N at once).
2. ``_chunk_bwd_recurrence_kernel``, one program per (sequence, value head, BV value columns): the
   only sequential part, walking the chunks in reverse with dS [K, BV] (fp32) on chip. Per chunk
   two dependent dots (Kd dS, then W^T dN) and two that do not depend on dS (Aqk^T dO, Qg^T dO);
   writes dh[c] = dS1 (the gradient of chunk c's end state) and dN; and d(initial_state).
3. Every chunk's gradients, all chunks in parallel, in three kernels (the split of
   flash-linear-attention's chunk_bwd_kernel_dqkwg and prepare_wy_repr_bwd), so that no kernel
   holds more than a few [BT, BK] and [BT, BT] fp32 tiles:
   a. ``_chunk_bwd_dqkw_kernel``, one program per (chunk, BK = 64 key columns, value head): loads
      h[c], dh[c], N, dN, dO BV value columns at a time and accumulates dQg, dKd, dW (-dN S0^T)
      and dAqk; with G, Gamma and its columns of q and k (l2-normalised over the whole rows) it
      writes dq (fp32, per value head, complete but for the l2 norm), dk's terms dP^T Q +
      diag(e^{G_C - G}) dKd (fp32), dW (input dtype: the products of 3b take it so) and its
      key columns' part of dg (fp32, [NK, T, HV]). dAqk (over all of V) is computed by each of
      the NK = K / 64 programs of a chunk.
   b. ``_chunk_bwd_wy_kernel``, one program per (chunk, value head): reads the forward's
      T = (I + A)^-1, then loops over V (dT = dN Vb^T, dv = diag(beta) T^T dN), over K (dT +=
      dW Kb^T, and K K^T), finishes what needs dA and K K^T (dbeta's and dg's terms through A),
      and loops over K again (dk += diag(beta e^G) T^T dW + (dB + dB^T) K, added in place to 3a's
      part); writes dv, dbeta, and dg = 3a's parts + the terms through Kb and A. Only [BT, BT]
      tiles live across its loops.
   c. ``_head_sum_l2_bwd_kernel``, one program per (32 tokens, key head): dq and dk summed over
      the value heads sharing the key head, the l2 norm's backward, cast to the input dtype.
   Global intermediates between them, per token and value head at K = V = 128 in bf16 (beyond
   what the single kernel this replaces wrote: dq and dk fp32 per value head, 512 B each): dW
   256 B written and read twice by 3b (the second read likely from L2), dk's part read and
   rewritten by 3b (+1,024 B), 2 x 4 B of dg parts written and read; 3b re-reads k and dN
   (+512 B) and 3a reads dO, N, dN once per key block (+768 B with NK = 2, the second read of
   adjacent programs likely from L2). About 2 KB a token-head of DRAM traffic beyond the single
   kernel (1.1 GB at T = 16384, HV = 32); 3c replaces the torch head sum and cast.

Saved by the forward: its inputs (q, k, v, g, beta, initial_state, cu_seqlens), Aqk ([T, HV, 64] in
the input dtype) and T = (I + A)^-1 ([T, HV, 64] in the input dtype, 128 B a token and value head in
16 bits: the forward's one inversion serves kernels 1 and 3b; fp32 until session 22, when 16 bits
took 37 us less of kernel time at T 16384 on the H100, NOTES.md 55) and the chunk-start states h
([chunks, HV, K, V] in the input dtype, 512 B a token and value head at K = V = 128: the buffer the
forward's output kernel reads, kept so that the backward needs no sequential pass to remake it,
NOTES.md 58). Recomputed (kernel 1): G, U, W, Kd and the new values N, all chunks at once.

Measured (H200, triton 3.6, bf16, q/k [1, 16384, 16, 128], v [1, 16384, 32, 128], l2 norm, initial
and final state): the single kernel this replaced took 9,807 us (8 warps: 255 registers, 772 B of
local memory a thread, 216 KiB of shared memory) plus 388 us of torch head sums and casts; 3a
984 us, 3b 1,195 us, 3c 200 us (two launches), the whole backward 12.49 -> 4.69 ms. At 4 warps
(the default: 8 warps measured 3a 1,476 us, 3b 2,359 us) 3a has 255 registers and 8 B of local
memory, 104 KiB shared; 3b 255 registers and 72 B, 72 KiB; 3c 72 registers. The products of
M = dAqk * Aqk and dA * A with the strictly upper ones (sum_{j < t} M_ij), fp32 FMA dots of about
100 registers a thread, are scans (``_pairs_across``). fp32 inputs (ieee dots, lowered to FMAs)
still spill: a test path. flash-linear-attention's kernels for the same work, as profiled at
this shape: chunk_bwd_kernel_dqkwg 982 us, prepare_wy_repr_bwd 519 us (it reads the forward's T
rather than inverting again, and its l2 norm backward is a separate kernel).

Numerics as the forward: products take operands in the input dtype (h, dh, N, dN and the gradient
matrices dP, dB rounded to it) with fp32 accumulation; dS, G, dA and all per-token reductions stay
fp32 (T is used in fp32 as stored, in the input dtype); fp32 inputs use ieee fp32 dots. The l2 norm
of q and k (``use_qk_l2norm_in_kernel``) is applied in the kernels (as in the forward) and
differentiated in kernel 3c: for y = x rsqrt(|x|^2 + 1e-6), dx = rsqrt(|x|^2 + 1e-6) (dy - y <y,
dy>), applied once to the sum over the value heads sharing a key head (it is linear in dy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.chunk import (
    CHUNK, PREPARE_WARPS, RECURRENCE_STAGES, RECURRENCE_WARPS, SUB, _chunk_prepare_kernel, _chunk_span,
    _load_inverse, _load_keys, _load_rows, _load_vec, _mm, _state_block, _store_block,
    chunk_gated_delta_rule_kernels, chunk_table, recurrence_geometry,
)
from fuselm.runtime import cdiv, max_shared_memory, next_power_of_2

# Kernel 3a/3b geometry: key columns per program (3a) or per step of the loops over K (3b), value
# columns per step of the loops over V; they bound the live tiles. Shared memory at K = V = 128,
# 3 stages: 16-bit inputs 3a 104 KiB, 3b 72 KiB (H200 launch); fp32 with 32 value columns 3a
# 80 KiB, 3b 112 KiB (sm_90 build by triton.compile without a GPU; under an A100's 164 KiB too).
# Warps: 4 for both (H200, bf16: 3a 984 us vs 1,476 at 8, 3b 1,195 vs 2,359; module docstring).
DQKW_BLOCK_K = 64
DQKW_BLOCK_V = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 32}
DQKW_WARPS = 4
# 3a's loop over V pipelined 3 deep (triton's default) wrote dW differently from run to run once it
# had two or more steps (V > 64; triton 3.6, H200: entries off by up to ~1 in bf16 and fp16 at
# K = V = 128, dq and dk unaffected; FLA's test_chunk_state_v_first caught it comparing two calls).
# 2 stages: identical runs, 924 us against 886 at T 16384, HV 32 (1 stage: 1,031).
DQKW_STAGES = 2
WY_BLOCK_K = 64
WY_BLOCK_V = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 32}
WY_WARPS = 4
HEAD_SUM_TOKENS = 32
BWD_SCRATCH_BYTES = 36 * 1024  # shared memory kept out of the backward recurrence's pipeline stages


@triton.jit
def _chunk_bwd_recurrence_kernel(
    q_ptr, do_ptr, G_ptr, aqk_ptr, kd_ptr, w_ptr, dh_ptr, dn_ptr, dht_ptr, dh0_ptr, cu_seqlens_ptr, first_chunk_ptr,
    seq_len, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    P: tl.constexpr, EQUAL: tl.constexpr,
):
    """Chunks in reverse, dS = the gradient of the state at the current chunk's end:
    dh[c] = dS (input dtype), dN = Aqk^T dO + Kd dS (stored), dS = e^{G_C} dS + Qg^T dO - W^T dN.
    Kd is read as the prepare kernel stored it: made here from the keys (the decay on the key tile,
    or on the rows of K dS) it took 0.63-0.75 ms at T 16384 against 0.48 (H100, NOTES.md 53)."""
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
def _row_rsqrt(ptr, t0, n_rows, stride_t, col0, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               L2NORM: tl.constexpr):
    """[BT] r = rsqrt(sum x^2 + 1e-6) of the q or k rows (K columns, read BC at a time): the l2
    norm's factor (``_load_keys``); ones without L2NORM."""
    if L2NORM:
        ss = tl.zeros([BT], dtype=tl.float32)
        for c0 in tl.static_range(0, K, BC):
            x = _load_rows(ptr, t0, n_rows, stride_t, col0 + c0, K - c0, BT, BC).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        return tl.rsqrt(ss + 1e-6)
    else:
        return tl.full([BT], 1.0, tl.float32)


@triton.jit
def _pairs_across(M, BT: tl.constexpr):
    """[BT] s_t = sum_{i >= t > j} M_ij (fp32): column suffix sums C_tj = sum_{i >= t} M_ij by a
    reverse scan down the rows, then sum_{j < t} C_tj. Only the terms that cross t are added (no
    subtraction of an inclusive sum), in a scan rather than a product with the strictly upper
    ones (an fp32 FMA dot: about 100 registers a thread at BT = 64, which spilled)."""
    rows = tl.arange(0, BT)
    C = tl.cumsum(M, axis=0, reverse=True)
    return tl.sum(tl.where(rows[None, :] < rows[:, None], C, 0.0), axis=1)


@triton.jit
def _chunk_bwd_dqkw_kernel(
    q_ptr, k_ptr, g_ptr, h_ptr, dh_ptr, new_v_ptr, dn_ptr, do_ptr, dq_ptr, dk_ptr, dw_ptr, dgp_ptr,
    chunk_start_ptr, chunk_len_ptr, seq_len, scale, T_total, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, L2NORM: tl.constexpr,
    P: tl.constexpr, EQUAL: tl.constexpr,
):
    """Kernel 3a, one program per (chunk, key block of BK columns) and value head: the products
    with the states, summed over the value dim in BV-column blocks, and what follows from them
    without T. Writes for its key columns dW (input dtype), dq (fp32, per value head, before the
    l2 norm's backward), dk's part dP^T Q + diag(e^{G_C - G}) dKd (fp32), and its part of dg
    (fp32, [NK, T, HV]: the terms x (through Qg), r, M (through Aqk) and <dS1, S0> of its columns)."""
    i_ck = tl.program_id(0)
    i_c = i_ck // NK
    k0 = (i_ck % NK) * BK
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, chunk_start_ptr, chunk_len_ptr, seq_len, BT, EQUAL)
    if n > 0:
        dt = k_ptr.dtype.element_ty
        rows = tl.arange(0, BT)
        row_ok = rows < n
        ck = k0 + tl.arange(0, BK)
        dqg = tl.zeros([BT, BK], dtype=tl.float32)  # dO S0^T
        dkd = tl.zeros([BT, BK], dtype=tl.float32)  # N dS1^T
        dns = tl.zeros([BT, BK], dtype=tl.float32)  # dN S0^T = -dW
        daqk = tl.zeros([BT, BT], dtype=tl.float32)  # dO N^T
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
            dqg += _mm(do, tl.trans(h), P)
            dkd += _mm(nv, tl.trans(dh), P)
            dns += _mm(dn, tl.trans(h), P)
            daqk += _mm(do, tl.trans(nv), P)
            dS_S += tl.sum(dh.to(tl.float32) * h.to(tl.float32), axis=1)
        # dW = -dN S0^T, rounded to the input dtype as kernel 3b's products take it
        _store_block(dw_ptr, -dns, t0, n, HV * K, i_hv * K + k0, K - k0, BK, BT)
        # the chunk's forward terms (fp32): G, Gamma; through Aqk = lower(Q K^T * Gamma) scale
        G = tl.cumsum(_load_vec(g_ptr, t0, n, HV, i_hv, BT), axis=0)
        G_last = tl.sum(tl.where(rows == n - 1, G, 0.0), axis=0)
        eG = tl.exp(G)
        decay_to_end = tl.where(row_ok, tl.exp(G_last - G), 0.0)  # e^{G_C - G}
        lower = (rows[:, None] >= rows[None, :]) & row_ok[:, None]
        gamma = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
        dPf = tl.where(lower, daqk, 0.0) * gamma * scale  # d(Q K^T) = lower(dAqk) * Gamma scale
        dP = dPf.to(dt)
        # this program's key columns of Q and K (l2-normalised over the whole rows)
        rq = _row_rsqrt(q_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        rk = _row_rsqrt(k_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        q = _load_rows(q_ptr, t0, n, H * K, i_h * K + k0, K - k0, BT, BK).to(tl.float32) * rq[:, None]
        k = _load_rows(k_ptr, t0, n, H * K, i_h * K + k0, K - k0, BT, BK).to(tl.float32) * rk[:, None]
        q_dt, k_dt = q.to(dt), k.to(dt)
        # dg's terms of these columns (the rest in kernel 3b; the form of the module docstring):
        #   sum_{i >= t} x_i + e^{G_C} <dS1, S0> + sum_{i < t} r_i + sum_{i >= t > j} M_ij
        x = tl.sum(dqg * q, axis=1) * eG * scale  # Qg carries e^{G_i}
        dq = dqg * (eG * scale)[:, None] + _mm(dP, k_dt, P)
        _store_block(dq_ptr, dq, t0, n, HV * K, i_hv * K + k0, K - k0, BK, BT)
        r = tl.sum(dkd * k * decay_to_end[:, None], axis=1)  # Kd = K e^{G_C - G}
        dk = _mm(tl.trans(dP), q_dt, P) + dkd * decay_to_end[:, None]
        _store_block(dk_ptr, dk, t0, n, HV * K, i_hv * K + k0, K - k0, BK, BT)
        M = dPf * _mm(q_dt, tl.trans(k_dt), P)  # dAqk * Aqk: Gamma_ij = e^{G_i - G_j}
        at_or_after = rows[:, None] >= rows[None, :]  # [i, t]: i >= t
        dg = (tl.sum(tl.where(at_or_after, x[:, None], 0.0), axis=0)
              + tl.sum(tl.where(at_or_after, 0.0, r[:, None]), axis=0)
              + _pairs_across(M, BT)
              + tl.exp(G_last) * tl.sum(dS_S, axis=0))
        tl.store(dgp_ptr + ((i_ck % NK) * T_total + t0 + rows) * HV + i_hv, dg, mask=row_ok)


@triton.jit
def _chunk_bwd_wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, t_ptr, dn_ptr, dw_ptr, dk_ptr, dv_ptr, dgp_ptr, dg_ptr, dbeta_ptr,
    chunk_start_ptr, chunk_len_ptr, seq_len, T_total, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKP: tl.constexpr,
    L2NORM: tl.constexpr, P: tl.constexpr, EQUAL: tl.constexpr,
):
    """Kernel 3b, one program per (chunk, value head): through U = T Vb, W = T Kb and
    T = (I + A)^-1 (the WY part), from dN and kernel 3a's dW. Only [BT, BT] tiles live across
    its loops (over V, then twice over K, BK columns at a time). Writes dv and dbeta, adds its
    part of dk (fp32, per value head) to kernel 3a's, and sums dg (3a's NKP parts and its own)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, chunk_start_ptr, chunk_len_ptr, seq_len, BT, EQUAL)
    if n > 0:
        dt = k_ptr.dtype.element_ty
        rows = tl.arange(0, BT)
        row_ok = rows < n
        # the chunk's forward terms (fp32): G, and the forward's T = (I + A)^-1
        G = tl.cumsum(_load_vec(g_ptr, t0, n, HV, i_hv, BT), axis=0)
        eG = tl.exp(G)
        beta = _load_vec(beta_ptr, t0, n, HV, i_hv, BT)
        bg = beta * eG
        rk = _row_rsqrt(k_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        strict = rows[:, None] > rows[None, :]
        T = _load_inverse(t_ptr, t0, n, HV, i_hv, BT)
        T_dt = T.to(dt)
        # through U = T Vb, Vb = diag(beta) V, BV value columns at a time
        dT = tl.zeros([BT, BT], dtype=tl.float32)  # dN Vb^T (+ dW Kb^T below)
        dbeta = tl.zeros([BT], dtype=tl.float32)
        for i_v in tl.range(0, tl.cdiv(V, BV)):
            v0 = i_v * BV
            dn = _load_rows(dn_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV)
            v = _load_rows(v_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV).to(tl.float32)
            dT += _mm(dn, tl.trans((v * beta[:, None]).to(dt)), P)
            dvb = _mm(tl.trans(T_dt), dn, P)  # dVb = T^T dU, dU = dN
            _store_block(dv_ptr, dvb * beta[:, None], t0, n, HV * V, i_hv * V + v0, V - v0, BV, BT)
            dbeta += tl.sum(dvb * v, axis=1)
        # through W = T Kb, Kb = diag(beta e^G) K: dT += dW Kb^T; and K K^T (for dbeta and M)
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        for c0 in tl.range(0, K, BK):
            dw = _load_rows(dw_ptr, t0, n, HV * K, i_hv * K + c0, K - c0, BT, BK)
            k = _load_rows(k_ptr, t0, n, H * K, i_h * K + c0, K - c0, BT, BK).to(tl.float32) * rk[:, None]
            dT += _mm(dw, tl.trans((k * bg[:, None]).to(dt)), P)  # Kb
            kk += _mm(k.to(dt), tl.trans(k.to(dt)), P)
        # through T = (I + A)^-1 and A = strictly_lower(diag(beta) (K K^T * Gamma)); what needs
        # dA, K K^T and Gamma is finished here, so that none of them lives through the last loop
        # (they did: 256 B of spill a thread, sm_90 build of triton 3.6; now 8)
        dA = tl.where(strict, -_mm(_mm(tl.trans(T), dT, P), tl.trans(T), P), 0.0)
        gamma_s = tl.exp(tl.where(strict, G[:, None] + (-G)[None, :], float("-inf")))  # Gamma, strictly lower
        dbeta += tl.sum(dA * kk * gamma_s, axis=1)
        # dg's terms through A (M = dA * A: Gamma_ij, every i >= t > j)
        dg = _pairs_across(dA * (beta[:, None] * kk * gamma_s), BT)
        dB = dA * beta[:, None] * gamma_s  # d(K K^T), strictly lower
        dBB = (dB + tl.trans(dB)).to(dt)
        x = tl.zeros([BT], dtype=tl.float32)  # rows of dKb * Kb
        for c0 in tl.range(0, K, BK):
            dw = _load_rows(dw_ptr, t0, n, HV * K, i_hv * K + c0, K - c0, BT, BK)
            k = _load_rows(k_ptr, t0, n, H * K, i_h * K + c0, K - c0, BT, BK).to(tl.float32) * rk[:, None]
            dkb = _mm(tl.trans(T_dt), dw, P)  # dKb = T^T dW
            dk = (_load_rows(dk_ptr, t0, n, HV * K, i_hv * K + c0, K - c0, BT, BK) + dkb * bg[:, None]
                  + _mm(dBB, k.to(dt), P))
            _store_block(dk_ptr, dk, t0, n, HV * K, i_hv * K + c0, K - c0, BK, BT)
            dbeta += eG * tl.sum(dkb * k, axis=1)
            x += tl.sum(dkb * (k * bg[:, None]), axis=1)
        # dg: the terms through Kb (x: e^{G_i}, every i >= t), then kernel 3a's parts
        at_or_after = rows[:, None] >= rows[None, :]  # [i, t]: i >= t
        dg += tl.sum(tl.where(at_or_after, x[:, None], 0.0), axis=0)
        for i_k in tl.static_range(0, NKP):
            dg += tl.load(dgp_ptr + (i_k * T_total + t0 + rows) * HV + i_hv, mask=row_ok, other=0.0)
        tl.store(dg_ptr + (t0 + rows) * HV + i_hv, dg, mask=row_ok)  # (rows >= n are not stored)
        tl.store(dbeta_ptr + (t0 + rows) * HV + i_hv, dbeta, mask=row_ok)


@triton.jit
def _head_sum_l2_bwd_kernel(
    x_ptr, dy_ptr, dx_ptr, T_total, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, L2NORM: tl.constexpr,
):
    """Kernel 3c, one program per (BT tokens, key head): dy summed over the value heads that read
    the key head (fp32), then, when L2NORM, the norm's backward dx = r (dy - y <y, dy>) for
    y = x r, r = rsqrt(|x|^2 + 1e-6) (it is linear in dy, so once after the sum); stored in dx's
    dtype. x: q or k [T, H, K]; dy [T, HV, K] fp32."""
    t0 = tl.program_id(0) * BT
    i_h = tl.program_id(1)
    n = tl.minimum(T_total - t0, BT)
    dy = tl.zeros([BT, BK], dtype=tl.float32)
    for j in tl.static_range(0, HV // H):
        dy += _load_rows(dy_ptr, t0, n, HV * K, (i_h * (HV // H) + j) * K, K, BT, BK)
    if L2NORM:
        y, r = _load_normalised(x_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        dy = r[:, None] * (dy - y * tl.sum(y * dy, axis=1)[:, None])
    _store_block(dx_ptr, dy, t0, n, H * K, i_h * K, K, BK, BT)


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


def chunk_gated_delta_rule_backward_kernels(q, k, v, g, beta, saved, scale, initial_state, do, dht, l2,
                                            cu_seqlens=None, seq_len=None):
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
    # 1: G, W, Kd and the new values N = U - W h[c] from the forward's T and h (its Aqk kept)
    aqk, inverse, h = saved
    G = torch.empty(T, HV, dtype=torch.float32, device=device)
    new_v = torch.empty(T, HV, V, dtype=dt, device=device)
    w, kd = (torch.empty(T, HV, K, dtype=dt, device=device) for _ in range(2))
    _chunk_prepare_kernel[(slots, HV)](
        q, k, v, g, beta, G, new_v, w, G, kd, aqk, inverse, h, start, length, seq_len, float(scale),
        q.stride(1), k.stride(1), v.stride(1), H=H, HV=HV, K=K, V=V, BT=CHUNK, SUB=SUB, BK=BK, BV=BV_full, L2NORM=l2,
        P=precision, EQUAL=equal, STORE_T=False, LOAD_T=True, num_warps=PREPARE_WARPS,
    )
    block_v, bwd_stages = recurrence_geometry(N * HV, V, device, backward=True)
    # 2: dS backwards over the chunks
    dh = torch.empty(slots, HV, K, V, dtype=dt, device=device)  # gradient of each chunk's end state
    dn = torch.empty(T, HV, V, dtype=dt, device=device)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if initial_state is not None else None
    _chunk_bwd_recurrence_kernel[(cdiv(V, block_v), N * HV)](
        q, do, G, aqk, kd, w, dh, dn, dht if dht is not None else G, dh0 if dh0 is not None else G,
        cu_seqlens, first, seq_len, float(scale), H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=block_v,
        L2NORM=l2, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, P=precision, EQUAL=equal,
        num_warps=RECURRENCE_WARPS,
        num_stages=bwd_recurrence_stages(min(stages, bwd_stages), BK, block_v, dt, max_shared_memory(device)),
    )
    # 3: every chunk's gradients in parallel, (a) the products with the states and what needs no
    # T, (b) the WY part; (c) dq, dk summed over the value heads sharing a key head (and the l2
    # norm's backward)
    BKA = min(DQKW_BLOCK_K, BK)
    NK = cdiv(K, BKA)
    dq, dk = (torch.empty(T, HV, K, dtype=torch.float32, device=device) for _ in range(2))
    dw = torch.empty(T, HV, K, dtype=dt, device=device)
    dgp = torch.empty(NK, T, HV, dtype=torch.float32, device=device)
    _chunk_bwd_dqkw_kernel[(slots * NK, HV)](
        q, k, g, h, dh, new_v, dn, do, dq, dk, dw, dgp, start, length, seq_len, float(scale), T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BKA, BV=min(DQKW_BLOCK_V[dt], BV_full), NK=NK, L2NORM=l2, P=precision,
        EQUAL=equal, num_warps=DQKW_WARPS, num_stages=DQKW_STAGES,
    )
    dv = torch.empty(T, HV, V, dtype=v.dtype, device=device)
    # summed in fp32 in the kernel, stored in the leaves' dtypes (the one rounding)
    dg, dbeta = torch.empty(T, HV, dtype=g.dtype, device=device), torch.empty(T, HV, dtype=beta.dtype, device=device)
    _chunk_bwd_wy_kernel[(slots, HV)](
        k, v, g, beta, inverse, dn, dw, dk, dv, dgp, dg, dbeta, start, length, seq_len, T,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=min(WY_BLOCK_K, BK), BV=min(WY_BLOCK_V[dt], BV_full), NKP=NK,
        L2NORM=l2, P=precision, EQUAL=equal, num_warps=WY_WARPS,
    )
    dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)
    for x, dx_h, dx in ((q, dq, dq_out), (k, dk, dk_out)):
        _head_sum_l2_bwd_kernel[(cdiv(T, HEAD_SUM_TOKENS), H)](
            x, dx_h, dx, T, H=H, HV=HV, K=K, BT=HEAD_SUM_TOKENS, BK=BK, L2NORM=l2, num_warps=4)
    dq, dk = dq_out, dk_out
    return dq, dk, dv.view(v.shape), dg.view(g.shape), dbeta.view(beta.shape), dh0


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """(o, final_state) = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, ...) with
    gradients for q, k, v, g, beta and initial_state; the forward is ``chunk_gated_delta_rule_kernels``
    (the no-grad path's), the backward ``chunk_gated_delta_rule_backward_kernels``. Saves the inputs,
    Aqk, T = (I + A)^-1 and the chunk-start states h (see the module docstring)."""

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
        o, final, saved = chunk_gated_delta_rule_kernels(*packed, scale, initial_state, output_final_state, l2,
                                                         cu_seqlens, seq_len=T, for_backward=True)
        ctx.save_for_backward(*packed, initial_state, cu_seqlens, *saved)
        return o.view(v.shape), final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, *saved = ctx.saved_tensors
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
            q, k, v, g, beta, saved, ctx.scale, initial_state, do, dht, ctx.l2, cu_seqlens, seq_len=T)
        shape = lambda x: x.view(B, T, *x.shape[2:])  # noqa: E731
        return (shape(dq), shape(dk), shape(dv), shape(dg), shape(dbeta), dh0 if need_h0 else None,
                None, None, None, None)
