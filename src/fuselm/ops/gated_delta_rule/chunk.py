"""Chunked gated delta rule (prefill): the algorithm of ``naive.chunk_gated_delta_rule_ref`` in
three Triton kernels, tensor-core dots throughout, fp32 accumulation.

Per chunk of BT = 64 tokens, with G = cumsum(g) from the chunk start, Gamma_ij = exp(G_i - G_j)
(j <= i; an exponent <= 0, never a division by a cumulative decay) and the state S0 at its start:
    A = strictly_lower(diag(beta) (K K^T * Gamma)),     T = (I + A)^-1
    U = T diag(beta) V,   W = T diag(beta e^G) K        (the WY form: new values N = U - W S0)
    O = (Q e^G scale) S0 + lower(Q K^T * Gamma scale) N,  S_end = e^{G_C} S0 + (K e^{G_C - G})^T N.

1. ``_chunk_prepare_kernel``, one program per (chunk, value head), all chunks in parallel: writes
   G (fp32), U, W, Aqk = lower(Q K^T * Gamma) scale and, with the l2 norm, the normalised keys Kn
   [T, H, K] (the recurrence reads them, or the raw keys without it). T is inverted in
   fp32 (tf32 dots for half inputs): the four 16 x 16 diagonal blocks by products of powers
   (``_invert_unit_lower``), the rest by a block Neumann product (``_inverse_from_diagonal``).
2. ``_chunk_recurrence_kernel``, one program per (sequence, value head, BV value columns): the
   only sequential part, two dependent dots per chunk with S [K, BV] (fp32) on chip; it writes
   each chunk's starting state h[c] and N. Its loads do not depend on S, so they are pipelined.
   The decay to the chunk end goes on N's rows, S_end = e^{G_C} S0 + K^T (N e^{G_C - G}), so that
   it reads the keys of the key head (shared by its value heads, as flash-linear-attention's
   kernel) and not a decayed copy per value head.
3. ``_chunk_output_kernel``, one program per (chunk, value head, value block), in parallel:
   O = (Q e^G scale) h[c] + Aqk N; optionally (a whole head a program) Qwen3.5's gated RMSNorm of
   each token's head as it stores (``prologue_tile``, the roundings of ``decode_linear``'s prologue).

Numerics (as flash-linear-attention's chunk kernels): products with K, V, W, U, Q, h and N take
operands in the input dtype (h, N, N e^{G_C - G} and the normalised keys rounded to it) and
accumulate in fp32; the carried state and G stay fp32; the block inverse is computed in fp32 and
rounded to the input dtype once (as U and W take it, and as the backward reads it: stored so, as
flash-linear-attention's). fp32 inputs use ieee fp32 dots throughout.
A batch of B equal-length rows runs as B packed sequences whose chunk spans the kernels compute;
for variable lengths the chunk table is built on the device from cu_seqlens (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.common.prologue import PROLOGUE_GATED_RMS_NORM, PROLOGUE_NONE, prologue_tile
from fuselm.ops.decode_linear import linear_prologue
from fuselm.ops.gated_delta_rule.fused_recurrent import (_check, check_state_pool_layout, fla_input_options,
                                                        fla_state_layout)
from fuselm.ops.gated_delta_rule.naive import chunk_gated_delta_rule_ref, run_on_state_pool
from fuselm.runtime import (as_rows, cdiv, check_finite_float, check_same_device, check_tensor, needs_autograd,
                             next_power_of_2, num_sms, use_triton)

CHUNK = 64  # tokens per chunk (BT): four 16-row blocks of the inverse, one wgmma-sized M
SUB = 16  # rows per diagonal block of the inverse (the smallest tensor-core tile)


@triton.jit
def _load_rows(ptr, t0, n_rows, stride_t, col0, n_cols, BT: tl.constexpr, BC: tl.constexpr):
    """[BT, BC] tile of rows t0 .. t0 + n_rows (zeros past them and past n_cols), as stored."""
    r = tl.arange(0, BT)
    c = tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return tl.load(ptr + (t0 + r).to(tl.int64)[:, None] * stride_t + col0 + c[None, :], mask=mask, other=0.0)


@triton.jit
def _load_keys(ptr, t0, n_rows, stride_t, col0, n_cols, BT: tl.constexpr, BC: tl.constexpr, L2NORM: tl.constexpr):
    """q or k rows in fp32, l2-normalised (x * rsqrt(sum x^2 + 1e-6)) when L2NORM."""
    x = _load_rows(ptr, t0, n_rows, stride_t, col0, n_cols, BT, BC).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _mm(a, b, P: tl.constexpr):
    """a @ b with operands in the input dtype (fp32 stays fp32), fp32 accumulation."""
    return tl.dot(a, b, input_precision=P)


@triton.jit
def _load_vec(ptr, t0, n_rows, HV, i_hv, BT: tl.constexpr):
    """[BT] fp32 per-token values (g, beta or G) of one value head; zeros past n_rows."""
    r = tl.arange(0, BT)
    return tl.load(ptr + (t0 + r) * HV + i_hv, mask=r < n_rows, other=0.0).to(tl.float32)


@triton.jit
def _store_block(ptr, x, t0, n_rows, stride, col0, n_cols, BC: tl.constexpr, BR: tl.constexpr):
    r = tl.arange(0, BR)
    c = tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    tl.store(ptr + (t0 + r).to(tl.int64)[:, None] * stride + col0 + c[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _diagonal_blocks(A, BT: tl.constexpr, SUB: tl.constexpr):
    """The SUB x SUB diagonal blocks of [BT, BT] A, as [BT / SUB, SUB, SUB]."""
    NB: tl.constexpr = BT // SUB
    rows = tl.arange(0, BT)
    same_block = (rows // SUB)[:, None] == (rows // SUB)[None, :]
    return tl.sum(tl.reshape(tl.where(same_block, A, 0.0), [NB, SUB, NB, SUB]), axis=2)


@triton.jit
def _inverse_from_diagonal(T3, A, BT: tl.constexpr, SUB: tl.constexpr, P: tl.constexpr):
    """(I + A)^-1 from T3 [NB, SUB, SUB], the inverses of I + A's diagonal blocks: with D their
    block-diagonal matrix and M = D A_L (A_L: A off its diagonal blocks, strictly block lower,
    M^NB = 0 for NB = BT / SUB = 4), (I + A)^-1 = (I + M)^-1 D = (I - M)(I + M^2) D, the same sum of
    products as block forward substitution, in four BT x BT dots."""
    NB: tl.constexpr = BT // SUB
    rows = tl.arange(0, BT)
    same_block = (rows // SUB)[:, None] == (rows // SUB)[None, :]
    b = tl.arange(0, NB)
    D = tl.reshape(tl.where((b[:, None] == b[None, :])[:, None, :, None], T3[:, :, None, :], 0.0), [BT, BT])
    M = _mm(D, tl.where(same_block, 0.0, A), P)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    return _mm(_mm(eye - M, eye + _mm(M, M, P), P), D, P)


@triton.jit
def _invert_unit_lower(A, BT: tl.constexpr, SUB: tl.constexpr, P: tl.constexpr):
    """(I + A)^-1 for a strictly lower [BT, BT] A, in fp32: each SUB x SUB diagonal block L
    (L^16 = 0) by products, (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8), six batched fp32
    (ieee) dots on [NB, SUB, SUB]; then ``_inverse_from_diagonal``. On the H200 at T 16384, HV 32
    this took 0.29 ms against 0.39 for forward substitution (16 dependent row steps of reductions;
    benchmarks/gdn_train_sweep.py, same float64 distance 5.4e-4, the tf32 block step's)."""
    NB: tl.constexpr = BT // SUB
    L = _diagonal_blocks(A, BT, SUB)
    r = tl.arange(0, SUB)
    eye3 = tl.zeros([NB, SUB, SUB], dtype=tl.float32) + tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]
    L2 = tl.dot(L, L, input_precision="ieee")
    L4 = tl.dot(L2, L2, input_precision="ieee")
    L8 = tl.dot(L4, L4, input_precision="ieee")
    T3 = tl.dot(tl.dot(eye3 - L, eye3 + L2, input_precision="ieee"),
                tl.dot(eye3 + L4, eye3 + L8, input_precision="ieee"), input_precision="ieee")
    return _inverse_from_diagonal(T3, A, BT, SUB, P)


@triton.jit
def _chunk_span(i_c, chunk_start_ptr, chunk_len_ptr, seq_len, BT: tl.constexpr, EQUAL: tl.constexpr):
    """(first token, length) of chunk slot i_c: from the device chunk table, or, for sequences of
    equal length seq_len (EQUAL), computed here."""
    if EQUAL:
        per_seq = tl.cdiv(seq_len, BT)
        start = (i_c // per_seq) * seq_len + (i_c % per_seq) * BT
        return start.to(tl.int64), tl.minimum(seq_len - (i_c % per_seq) * BT, BT)
    else:
        return tl.load(chunk_start_ptr + i_c).to(tl.int64), tl.load(chunk_len_ptr + i_c)


@triton.jit
def _sequence_span(i_n, cu_seqlens_ptr, first_chunk_ptr, seq_len, BT: tl.constexpr, EQUAL: tl.constexpr):
    """(first token, end token, first chunk slot) of sequence i_n."""
    if EQUAL:
        bos = i_n.to(tl.int64) * seq_len
        return bos, bos + seq_len, i_n.to(tl.int64) * tl.cdiv(seq_len, BT)
    else:
        bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
        return bos, tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64), tl.load(first_chunk_ptr + i_n).to(tl.int64)


@triton.jit
def _state_block(state0_ptr, cu_seqlens_ptr, first_chunk_ptr, seq_len, HAS_STATE0: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 EQUAL: tl.constexpr):
    """What a recurrence program (grid: value blocks x sequences * HV) carries: its sequence i_n,
    value head i_hv, first value column v0, the span (bos, eos, first chunk slot), the value
    columns cv, the [BK, BV] block's mask and offsets in an [N, HV, K, V] state, and the carried
    block in fp32 at the start (state0 of sequence i_n, or zeros)."""
    i_n = tl.program_id(1) // HV
    i_hv = tl.program_id(1) % HV
    v0 = tl.program_id(0) * BV
    bos, eos, first_chunk = _sequence_span(i_n, cu_seqlens_ptr, first_chunk_ptr, seq_len, BT, EQUAL)
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    state_mask = (ck < K)[:, None] & (cv < V)[None, :]
    state_offs = (i_hv * K + ck)[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_STATE0:
        S = tl.load(state0_ptr + i_n.to(tl.int64) * HV * K * V + state_offs, mask=state_mask, other=0.0)
    return i_n, i_hv, v0, bos, eos, first_chunk, cv, state_mask, state_offs, S


@triton.jit
def _load_inverse(t_ptr, t0, n, HV, i_hv, BT: tl.constexpr):
    """A chunk's stored T = (I + A)^-1 ([BT, BT], in the input dtype), in fp32; rows past n are
    identity rows, as inverted."""
    rows = tl.arange(0, BT)
    row_ok = rows < n
    T = tl.load(t_ptr + ((t0 + rows) * HV + i_hv).to(tl.int64)[:, None] * BT + rows[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    return tl.where(row_ok[:, None], T, tl.where(rows[:, None] == rows[None, :], 1.0, 0.0))


@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, G_ptr, u_ptr, w_ptr, kn_ptr, kd_ptr, aqk_ptr, t_ptr, h_ptr,
    chunk_start_ptr, chunk_len_ptr,
    seq_len, scale, stride_q, stride_k, stride_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, P: tl.constexpr,
    EQUAL: tl.constexpr, STORE_T: tl.constexpr, LOAD_T: tl.constexpr,
):
    """G, U, W and Aqk of one chunk and value head, and with L2NORM the chunk's normalised keys
    Kn [T, H, K] (by the first value head of each key head). T = (I + A)^-1 is inverted here and
    also stored (in the input dtype) when STORE_T (a forward that autograd will take back).
    LOAD_T (the backward's recompute) reads that T and the forward's chunk-start states h[c]
    instead, and writes G, W, Kd = K e^{G_C - G} [T, HV, K] for the backward recurrence and, in
    U's place, the new values N = U - W h[c] (as the forward recurrence computes them: U and W
    rounded to the input dtype first); no Aqk (the forward's is kept) and no Kn. q, k and v rows
    are ``stride_*`` elements apart (heads dense within a row)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, chunk_start_ptr, chunk_len_ptr, seq_len, BT, EQUAL)  # n = 0: a padding slot
    if n > 0:
        dt = k_ptr.dtype.element_ty
        rows = tl.arange(0, BT)
        row_ok = rows < n
        G = tl.cumsum(_load_vec(g_ptr, t0, n, HV, i_hv, BT), axis=0)
        tl.store(G_ptr + (t0 + rows) * HV + i_hv, G, mask=row_ok)
        k = _load_keys(k_ptr, t0, n, stride_k, i_h * K, K, BT, BK, L2NORM)
        if L2NORM and not LOAD_T:
            if i_hv % (HV // H) == 0:  # the keys as the forward recurrence reads them
                _store_block(kn_ptr, k, t0, n, H * K, i_h * K, K, BK, BT)
        beta = _load_vec(beta_ptr, t0, n, HV, i_hv, BT)
        if LOAD_T:
            G_last = tl.sum(tl.where(rows == n - 1, G, 0.0), axis=0)
            _store_block(kd_ptr, k * tl.where(row_ok, tl.exp(G_last - G), 0.0)[:, None], t0, n, HV * K, i_hv * K, K,
                         BK, BT)
            T = _load_inverse(t_ptr, t0, n, HV, i_hv, BT).to(dt)
        else:
            # Aqk = lower(Q K^T * Gamma) scale, diagonal included
            q = _load_keys(q_ptr, t0, n, stride_q, i_h * K, K, BT, BK, L2NORM)
            keep = (rows[:, None] >= rows[None, :]) & row_ok[:, None]
            gamma = tl.exp(tl.where(keep, G[:, None] - G[None, :], float("-inf")))
            aqk = _mm(q.to(dt), tl.trans(k.to(dt)), P) * gamma * scale
            tl.store(aqk_ptr + ((t0 + rows) * HV + i_hv).to(tl.int64)[:, None] * BT + rows[None, :],
                     aqk.to(aqk_ptr.dtype.element_ty), mask=row_ok[:, None])
            # T = (I + A)^-1, A = strictly_lower(diag(beta) (K K^T * Gamma))
            A = tl.where(rows[:, None] > rows[None, :], beta[:, None] * _mm(k.to(dt), tl.trans(k.to(dt)), P) * gamma, 0.0)
            T = _invert_unit_lower(A, BT, SUB, P).to(dt)
            if STORE_T:  # as U and W take it: rounded to the input dtype
                tl.store(t_ptr + ((t0 + rows) * HV + i_hv).to(tl.int64)[:, None] * BT + rows[None, :], T,
                         mask=row_ok[:, None])
        # U = T diag(beta) V, W = T diag(beta e^G) K
        w = _mm(T, (k * (beta * tl.exp(G))[:, None]).to(dt), P).to(dt)
        _store_block(w_ptr, w, t0, n, HV * K, i_hv * K, K, BK, BT)
        v = _load_rows(v_ptr, t0, n, stride_v, i_hv * V, V, BT, BV).to(tl.float32)
        u = _mm(T, (v * beta[:, None]).to(dt), P)
        if LOAD_T:  # N = U - W h[c]
            ck = tl.arange(0, BK)
            cv = tl.arange(0, BV)
            h = tl.load(h_ptr + (i_c * HV + i_hv).to(tl.int64) * K * V + ck[:, None] * V + cv[None, :],
                        mask=(ck < K)[:, None] & (cv < V)[None, :], other=0.0)
            u = u.to(dt).to(tl.float32) - _mm(w, h, P)
        _store_block(u_ptr, u, t0, n, HV * V, i_hv * V, V, BV, BT)


@triton.jit
def _chunk_recurrence_kernel(
    u_ptr, w_ptr, k_ptr, G_ptr, h_ptr, new_v_ptr, h0_ptr, ht_ptr, cu_seqlens_ptr, first_chunk_ptr, seq_len,
    state_indices_ptr, has_h0_ptr, stride_k, H: tl.constexpr,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, P: tl.constexpr, EQUAL: tl.constexpr, INDEXED: tl.constexpr,
    HAS_H0_FLAGS: tl.constexpr,
):
    """Per chunk: h[c] = S (input dtype), N = U - W S (stored), S = e^{G_C} S + K^T (N e^{G_C - G})
    (K: the keys as the chunk kernels use them, rows ``stride_k`` apart).
    INDEXED (HAS_H0 then False): sequence n's state is read from pool row state_indices[n] of h0
    (only where has_h0[n] with HAS_H0_FLAGS) and its final state written back there (ht = h0); a
    negative index reads zeros and writes nothing. Each program reads and writes only its own
    [BK, BV] block of its row: no race between distinct rows."""
    i_n, i_hv, v0, bos, eos, first_chunk, cv, state_mask, state_offs, S = _state_block(
        h0_ptr, cu_seqlens_ptr, first_chunk_ptr, seq_len, HAS_H0, HV, K, V, BT, BK, BV, EQUAL)
    final_row = i_n.to(tl.int64)
    final_mask = state_mask
    if INDEXED:
        # (block mask & a scalar condition: as a bound on the row index, which the interpreter takes)
        final_row = tl.load(state_indices_ptr + i_n).to(tl.int64)
        final_mask = state_mask & (tl.arange(0, BK) < tl.where(final_row >= 0, BK, 0))[:, None]
        read_rows = BK
        if HAS_H0_FLAGS:
            read_rows = tl.where(tl.load(has_h0_ptr + i_n) != 0, BK, 0)
        S = tl.load(h0_ptr + final_row * HV * K * V + state_offs,
                    mask=final_mask & (tl.arange(0, BK) < read_rows)[:, None], other=0.0).to(tl.float32)
    dt = w_ptr.dtype.element_ty
    i_h = i_hv // (HV // H)
    rows = tl.arange(0, BT)
    for i_c in tl.range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        n = tl.minimum(eos - t0, BT)
        row_ok = rows < n
        w = _load_rows(w_ptr, t0, n, HV * K, i_hv * K, K, BT, BK)
        k = _load_rows(k_ptr, t0, n, stride_k, i_h * K, K, BT, BK)
        u = _load_rows(u_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV).to(tl.float32)
        G = _load_vec(G_ptr, t0, n, HV, i_hv, BT)
        G_last = tl.load(G_ptr + (t0 + n - 1) * HV + i_hv)
        S_in = S.to(dt)
        tl.store(h_ptr + (first_chunk + i_c) * HV * K * V + state_offs, S_in, mask=state_mask)
        new_v = u - _mm(w, S_in, P)
        tl.store(new_v_ptr + ((t0 + rows) * HV + i_hv)[:, None] * V + cv[None, :], new_v.to(dt),
                 mask=row_ok[:, None] & (cv < V)[None, :])
        decayed = (new_v * tl.where(row_ok, tl.exp(G_last - G), 0.0)[:, None]).to(dt)
        S = tl.dot(tl.trans(k), decayed, S * tl.exp(G_last), input_precision=P)
    if STORE_HT:
        tl.store(ht_ptr + final_row * HV * K * V + state_offs, S.to(ht_ptr.dtype.element_ty), mask=final_mask)


@triton.jit
def _chunk_output_kernel(
    q_ptr, G_ptr, aqk_ptr, h_ptr, new_v_ptr, o_ptr, z_ptr, norm_w_ptr, chunk_start_ptr, chunk_len_ptr, seq_len, scale,
    stride_q, stride_z, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, P: tl.constexpr, EQUAL: tl.constexpr,
    PROLOGUE: tl.constexpr,
):
    """O = (Q e^G scale) h[c] + Aqk N, every chunk in parallel; with PROLOGUE (a whole head a
    program, BV = V) HF's gated RMSNorm of each token's head with z (``prologue_tile``, the
    function ``decode_linear`` applies: the same roundings, o rounded to its dtype first)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    i_h = i_hv // (HV // H)
    t0, n = _chunk_span(i_c, chunk_start_ptr, chunk_len_ptr, seq_len, BT, EQUAL)
    if n > 0:
        dt = h_ptr.dtype.element_ty
        ck = tl.arange(0, BK)
        cv = v0 + tl.arange(0, BV)
        q = _load_keys(q_ptr, t0, n, stride_q, i_h * K, K, BT, BK, L2NORM)
        G = _load_vec(G_ptr, t0, n, HV, i_hv, BT)
        h = tl.load(h_ptr + (i_c * HV + i_hv) * K * V + ck[:, None] * V + cv[None, :],
                    mask=(ck < K)[:, None] & (cv < V)[None, :], other=0.0)
        aqk = _load_rows(aqk_ptr, t0, n, HV * BT, i_hv * BT, BT, BT, BT)
        new_v = _load_rows(new_v_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV)
        o = _mm((q * (tl.exp(G) * scale)[:, None]).to(dt), h, P) + _mm(aqk, new_v, P)
        if PROLOGUE:
            r = tl.arange(0, BT)
            ok = (r < n)[:, None] & (cv < V)[None, :]
            z_ptrs = z_ptr + (t0 + r).to(tl.int64)[:, None] * stride_z + i_hv * V + cv[None, :]
            norm_w = tl.load(norm_w_ptr + cv, mask=cv < V, other=0.0).to(tl.float32)[None, :]
            o = prologue_tile(o.to(o_ptr.dtype.element_ty), z_ptrs, ok, norm_w, eps, PROLOGUE, V, BT, BV)
        _store_block(o_ptr, o, t0, n, HV * V, i_hv * V + v0, V - v0, BV, BT)


def chunk_table(cu_seqlens: torch.Tensor, total_tokens: int, chunk: int = CHUNK):
    """Start token and length of every chunk slot, and each sequence's first slot, on the device:
    the slots of packed sequences are padded to the host-known bound cdiv(T, chunk) + N (padding
    slots have length 0), so nothing waits on the host."""
    n_seq = cu_seqlens.numel() - 1
    slots = cdiv(total_tokens, chunk) + n_seq
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    chunks = (lengths + chunk - 1) // chunk
    first = torch.cumsum(chunks, 0) - chunks  # first slot of each sequence
    slot = torch.arange(slots, device=cu_seqlens.device)
    seq = (torch.searchsorted(first + chunks, slot, right=True)).clamp(max=n_seq - 1)
    index = slot - first[seq]
    valid = (slot < (first + chunks)[-1]) & (index < chunks[seq])
    start = cu_seqlens[seq].long() + index * chunk
    length = torch.where(valid, torch.clamp(cu_seqlens[seq + 1].long() - start, max=chunk), 0)
    return start.contiguous(), length.to(torch.int32).contiguous(), first.contiguous()


# seq_len is never 1 in a launch: triton 3.6 specialises an int argument equal to 1 as a constant,
# and that build of the recurrence (trip count folded to 1, 4-stage pipeline) leaves its final state
# reading uninitialised memory (NaN, or an illegal address; compute-sanitizer initcheck, H100). So
# one-token rows go through the chunk-table path (seq_len 0). Not do_not_specialize: without the
# specialisation on seq_len the recurrence ran 12-13% slower (H100, T 8192 and 32768, NOTES.md 18).
# Recurrence geometry. The recurrence is a chain of dependent dots per chunk, so its time is the
# chunks' latency times the waves of programs: more programs per wave hide more of the latency and a
# second wave doubles the time. Forward, reading the keys with the decay on N (H100, T 16384, HV 32,
# benchmarks/gdn_train_sweep.py and NOTES.md 53): BV32 4 stages 0.306 ms (128 programs), 3 stages
# 0.323, BV16 3 stages 0.396 (256, two a multiprocessor), BV64 4 stages 0.426. Before that change
# (the stored Kd), H200 sweep (benchmarks/gdn_train_sweep.py, T 16384, HV 32, K = V =
# 128, 4 warps, ms per launch): forward BV16 3 stages 0.397 (256 programs, two a multiprocessor: 3
# stages of w, kd, u tiles fit twice in shared memory), BV16 4 stages 0.675 (one a multiprocessor:
# two waves), BV32 4 stages 0.414 (128 programs), BV64 0.425; 2 warps 5-40x slower at BV 32-64.
# Backward (~61 KB a stage at BV32: one program a multiprocessor): BV32 0.484 (128 programs), BV16
# 0.948 (256: two waves), BV64 0.855 (2 stages). Forward at BV32, 3 stages: one program a
# multiprocessor too (the training step's 4 x 16 heads ran 256 of them in two waves). H100, B1 H16
# (128 programs at BV16): 4 stages 5% faster than 3 (NOTES.md 18). Not do_not_specialize on
# seq_len (see above).
RECURRENCE_WARPS = 4
RECURRENCE_STAGES = 4  # when every program has a multiprocessor of its own; 3 when two share one


def recurrence_geometry(heads: int, V: int, device: torch.device, backward: bool = False) -> tuple[int, int]:
    """(value columns per program, pipeline stages) of the forward (or backward) recurrence over
    ``heads`` = sequences x value heads, for 16-bit inputs: the narrowest block of 32 or 64 columns
    (backward: 16, 32 or 64) whose programs fit one wave, else 64 (fewer waves)."""
    sms = num_sms(device)
    full = next_power_of_2(V)
    for block_v in ((16, 32, 64) if backward else (32, 64)):
        programs = heads * cdiv(V, min(block_v, full))
        if programs <= sms:
            break
    block_v = min(block_v, full)
    stages = RECURRENCE_STAGES if heads * cdiv(V, block_v) <= sms else RECURRENCE_STAGES - 1
    return block_v, stages


# The parallel kernels (H100 sweep, benchmarks/gdn.py, T 8192 and 32768): the output kernel with all
# 128 value columns per program is 4-5% faster in all than 64; 8 warps for prepare +40%, for output +-1%.
OUTPUT_BLOCK_V = 128  # value columns per program of the output kernel
PREPARE_WARPS = 4
MIN_16BIT_HEAD_DIM = 64  # 16-bit key / value heads narrower than this run in fp32 on a GPU (chunk_gated_delta_rule)
OUTPUT_WARPS = 4


def recurrence_keys(k: torch.Tensor, l2: bool) -> tuple[torch.Tensor, int]:
    """(keys, token stride) the forward recurrence reads for the packed keys k [1, T, H, K]: with the l2
    norm an empty [T, H, K] buffer that the prepare kernel fills with the normalised keys, else k."""
    if l2:
        _, T, H, K = k.shape
        return torch.empty(T, H, K, dtype=k.dtype, device=k.device), H * K
    return k, k.stride(1)


def chunk_gated_delta_rule_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, l2,
                                   cu_seqlens=None, seq_len=None, block_v=None, for_backward=False,
                                   state_indices=None, has_initial_state=None, out=None, norm=None):
    """The three kernels on packed inputs q [1, T, H, K] ...: N sequences given by ``cu_seqlens``,
    or T / seq_len sequences of ``seq_len`` tokens each. q, k, v may have any token stride (their
    heads dense: a wider projection's slices); g, beta contiguous. Returns (o, final or None,
    saved): with ``for_backward``, saved = (Aqk [T, HV, 64], T = (I + A)^-1 [T, HV, 64], the
    chunk-start states h [slots, HV, K, V], all in the input dtype) for
    ``chunk_gated_delta_rule_backward_kernels``, else None. With ``state_indices`` [N],
    ``initial_state`` is the pool (``chunk_gated_delta_rule``) and final is it; ``out``: a
    contiguous [1, T, HV, V] buffer for o; ``norm``: (norm_weight [V], z [T, HV V] with unit column
    stride, eps): o is then the gated RMSNorm of its heads (V a power of two)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None and seq_len == 1:  # never launch with seq_len == 1 (see above)
        cu_seqlens = torch.arange(T + 1, dtype=torch.int32, device=q.device)
    equal = cu_seqlens is None
    N = T // seq_len if equal else cu_seqlens.numel() - 1
    BK, BV_full = next_power_of_2(K), next_power_of_2(V)
    dt, device = q.dtype, q.device
    # fp32 inputs: ieee dots, and no multi-stage load pipeline (its fp32 buffers exceed shared memory).
    # 16-bit inputs keep >= 2 stages: with 1 stage triton 3.6 miscompiles the recurrence (an
    # out-of-bounds shared-memory read, compute-sanitizer, H100).
    precision, stages = ("ieee", 1) if dt == torch.float32 else ("tf32", RECURRENCE_STAGES)
    if equal:
        slots = N * cdiv(seq_len, CHUNK)
        start = length = first = cu_seqlens = q  # unused (EQUAL): spans computed in the kernels
    else:
        start, length, first = chunk_table(cu_seqlens, T)
        slots, seq_len = start.numel(), 0
    G = torch.empty(T, HV, dtype=torch.float32, device=device)
    u, new_v = (torch.empty(T, HV, V, dtype=dt, device=device) for _ in range(2))
    w = torch.empty(T, HV, K, dtype=dt, device=device)
    keys, stride_keys = recurrence_keys(k, l2)
    aqk = torch.empty(T, HV, CHUNK, dtype=dt, device=device)
    inverse = torch.empty(T, HV, CHUNK, dtype=dt, device=device) if for_backward else G
    h = torch.empty(slots, HV, K, V, dtype=dt, device=device)  # the state at each chunk's start
    _chunk_prepare_kernel[(slots, HV)](
        q, k, v, g, beta, G, u, w, keys, G, aqk, inverse, G, start, length, seq_len, float(scale),
        q.stride(1), k.stride(1), v.stride(1), H=H, HV=HV, K=K, V=V, BT=CHUNK, SUB=SUB, BK=BK, BV=BV_full,
        L2NORM=l2, P=precision, EQUAL=equal,
        STORE_T=for_backward, LOAD_T=False, num_warps=PREPARE_WARPS,
    )
    indexed = state_indices is not None
    if indexed:
        final = initial_state
    else:
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if output_final_state else None
    geometry_v, geometry_stages = recurrence_geometry(N * HV, V, device)
    block_v = block_v or geometry_v
    stages = min(stages, geometry_stages)
    _chunk_recurrence_kernel[(cdiv(V, block_v), N * HV)](
        u, w, keys, G, h, new_v, initial_state if initial_state is not None else G, final if final is not None else G,
        cu_seqlens, first, seq_len, state_indices if indexed else G,
        has_initial_state if has_initial_state is not None else G, stride_keys,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=block_v,
        HAS_H0=initial_state is not None and not indexed, STORE_HT=final is not None, P=precision, EQUAL=equal,
        INDEXED=indexed, HAS_H0_FLAGS=has_initial_state is not None, num_warps=RECURRENCE_WARPS, num_stages=stages,
    )
    o = torch.empty(v.shape, dtype=v.dtype, device=device) if out is None else out
    out_v = min(OUTPUT_BLOCK_V, BV_full)
    norm_weight, z, eps = norm if norm is not None else (G, G, 0.0)
    if norm is not None and out_v != V:
        raise ValueError(f"norm_weight: the fused norm needs a power-of-two head_v_dim <= {OUTPUT_BLOCK_V}, got {V}")
    _chunk_output_kernel[(slots, HV, cdiv(V, out_v))](
        q, G, aqk, h, new_v, o, z, norm_weight, start, length, seq_len, float(scale), q.stride(1),
        z.stride(0) if norm is not None else 0, float(eps),
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=out_v, L2NORM=l2, P=precision, EQUAL=equal,
        PROLOGUE=PROLOGUE_GATED_RMS_NORM if norm is not None else PROLOGUE_NONE, num_warps=OUTPUT_WARPS,
    )
    return o, final, ((aqk, inverse, h) if for_backward else None)


FLA_CHUNK_SIZES = (16, 32, 64)  # flash-linear-attention's chunk_size choices (fuselm computes in 64-token chunks)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None, cp_context=None, *, use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, chunk_size: int = 64,
    transpose_state_layout: bool | None = None, state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None, out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, norm_gate: torch.Tensor | None = None, norm_eps: float = 1e-6,
):
    """Gated delta rule over whole sequences, chunk by chunk (prefill): flash-linear-attention's
    ``chunk_gated_delta_rule`` signature (fla-core 0.6), a drop-in replacement.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H; g (<= 0), beta: [B, T, HV]. Each
            token's heads dense; any token stride (slices of a wider projection are read in place).
        scale: on q; default K ** -0.5.
        initial_state: [N, HV, K, V] (N = B, or the number of packed sequences); fp32, or 16-bit
            (taken to fp32, as FLA does).
        output_final_state: also return the final states [N, HV, K, V] (fp32).
        use_qk_l2norm_in_kernel: l2-normalise q and k per head first.
        use_beta_sigmoid_in_kernel: ``beta`` holds logits: beta = sigmoid(beta) in fp32 first
            (``allow_neg_eigval``: 2 sigmoid(beta), in [0, 2); needs use_beta_sigmoid_in_kernel).
        state_v_first: initial and final states in the [N, HV, V, K] layout
            (``transpose_state_layout``: its deprecated name, with a warning).
        cu_seqlens: [N + 1] offsets of N packed sequences (B = 1); no host sync while a CUDA
            graph is being captured. ``cu_seqlens_cpu`` and ``chunk_indices`` (FLA's host-side
            hints) are accepted and not needed: the chunk table is built on the device.
        cp_context: context parallelism, not supported (NotImplementedError).
        use_gate_in_kernel: ``g`` holds the raw gate input: g = -exp(A_log) softplus(g + dt_bias)
            in fp32 first (``A_log`` [HV] required, ``dt_bias`` [HV] optional).
        chunk_size: FLA's 16, 32 or 64; fuselm's chunks are 64 tokens whatever is asked (the
            chunk length changes only the summation order).
        state_indices: int [N], a state pool (as ``fused_recurrent_gated_delta_rule``'s):
            ``initial_state`` is a pool [P, HV, K, V] (fp32, bf16 or fp16), sequence n starts from
            row ``state_indices[n]`` and its final state is written back there, rounded once into
            the pool's dtype (the pool is updated in place and returned as the final state); a
            negative index (a padded row) starts from zeros and writes nothing. Indices >= 0 must
            be distinct (a row's read may follow another's write within the launch). Inference only.
        has_initial_state: bool [N], with ``state_indices``: sequence n reads its pool row only
            where True (False: starts from zeros, e.g. a fresh request in a reused slot).
        out: a contiguous [B, T, HV, V] buffer in v's dtype for o (inference only).
        norm_weight, norm_gate, norm_eps: o through HF's ``Qwen3_5RMSNormGated`` per head (the
            Gated DeltaNet's output norm, gated by SiLU of z = ``norm_gate`` [B, T, HV V] or [B, T,
            HV, V] in v's dtype, unit last stride; ``norm_weight`` [V] in v's dtype or fp32), applied
            by the output kernel before it stores (one program a whole head: a power-of-two V <= 128;
            other V: ``linear_prologue`` after the kernels), with the roundings of
            ``fuselm.ops.decode_linear.naive.gated_rms_norm_ref``, so the out projection after it
            runs plain. Inference only.
    The FLA options are computed with PyTorch ops before the kernels (differentiable: gradients
    reach the raw g, A_log, dt_bias and beta logits). Returns:
        (o [B, T, HV, V] in v's dtype, final_state or None). Differentiable in q, k, v, g, beta and
        initial_state (also through final_state): ``chunk_backward.ChunkGatedDeltaRuleFunction``.
    """
    state_v_first = fla_state_layout(state_v_first, transpose_state_layout)
    if cp_context is not None:
        raise NotImplementedError("cp_context: context parallelism is not supported by fuselm's chunk_gated_delta_rule")
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {FLA_CHUNK_SIZES}, got {chunk_size!r}")
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log, dt_bias: only used with use_gate_in_kernel=True (g is then the raw gate input)")
    check_state_pool_layout(state_indices, initial_state, state_v_first)
    norm = _check_norm(v, norm_weight, norm_gate, norm_eps)
    g, beta, initial_state = fla_input_options(v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias,
                                               use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                                               pool=state_indices is not None)
    o, final = _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                       use_qk_l2norm_in_kernel, cu_seqlens, state_indices, has_initial_state,
                                       out, norm)
    if final is not None and state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final


def _check_norm(v, norm_weight, norm_gate, eps):
    """``chunk_gated_delta_rule``'s output norm as (norm_weight, z [B, T, HV V], eps), or None."""
    if norm_weight is None and norm_gate is None:
        return None
    if norm_weight is None or norm_gate is None:
        raise ValueError("norm_weight, norm_gate: the output norm needs both (or neither)")
    check_tensor("v", v)
    if v.dim() != 4:
        raise ValueError(f"v: expected [B, T, heads, dim], got shape {tuple(v.shape)}")
    B, T, HV, V = v.shape
    check_tensor("norm_weight", norm_weight)
    check_tensor("norm_gate", norm_gate)
    if norm_weight.shape != (V,) or norm_weight.dtype not in (v.dtype, torch.float32) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight: expected a contiguous [V] = ({V},) tensor in {v.dtype} or float32, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    if norm_gate.dim() == 4 and norm_gate.shape[-2:] == (HV, V):
        norm_gate = norm_gate.flatten(-2)
    if norm_gate.shape != (B, T, HV * V) or norm_gate.dtype != v.dtype or norm_gate.stride(-1) != 1:
        raise ValueError(f"norm_gate: expected [B, T, HV V] = ({B}, {T}, {HV * V}) in {v.dtype} with unit last "
                         f"stride, got {tuple(norm_gate.shape)} {norm_gate.dtype}")
    check_same_device(v=v, norm_weight=norm_weight, norm_gate=norm_gate)
    if needs_autograd(norm_weight, norm_gate):
        raise ValueError("norm_weight, norm_gate: the output norm is inference only (no autograd)")
    return norm_weight, norm_gate, check_finite_float("norm_eps", eps, nonnegative=True)


def _gated_norm_in_place(o: torch.Tensor, norm) -> torch.Tensor:
    """o [B, T, HV, V] (contiguous) through the output norm in place, where the output kernel does
    not apply it: ``linear_prologue``, the prologue ``decode_linear`` runs (its kernel on a Triton
    device, else PyTorch's reference)."""
    norm_weight, z, eps = norm
    linear_prologue(o.flatten(-2), "gated_rms_norm", z, norm_weight=norm_weight, eps=eps, head_dim=o.shape[-1],
                    out=o.flatten(-2))
    return o


def _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            cu_seqlens, state_indices=None, has_initial_state=None, out=None, norm=None):
    """``chunk_gated_delta_rule`` on fuselm's own arguments (fp32 [N, HV, K, V] states or pool, g
    and beta as the recurrence takes them; ``norm`` as ``_check_norm`` returns it)."""
    N = _check(q, k, v, g, beta, None, initial_state, cu_seqlens, state_indices)
    _check_pool_and_out(v, N, state_indices, has_initial_state, out)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.is_cuda and q.dtype != torch.float32 and min(q.shape[-1], v.shape[-1]) < MIN_16BIT_HEAD_DIM:
        # 16-bit heads under 64 wide: the 16-bit kernels give non-finite results on the H100
        # (triton 3.6; K or V of 16 or 32, forward and backward, NOTES.md 31); the fp32 kernels
        # (ieee dots) are right, so such heads run in fp32 and o comes back in v's dtype.
        o, final = _chunk_gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(), scale,
                                           initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                           state_indices, has_initial_state)
        o = o.to(v.dtype) if out is None else out.copy_(o)
        return (o if norm is None else _gated_norm_in_place(o, norm)), final
    args = (q, k, v, g, beta)
    if needs_autograd(*args, *(() if initial_state is None else (initial_state,))):
        if state_indices is not None or out is not None or norm is not None:
            raise ValueError("state_indices, out, norm_weight: inference only (no autograd through a state pool, an "
                             "out buffer or the output norm); call under torch.no_grad() or without them")
        if use_triton(q):
            from fuselm.ops.gated_delta_rule.chunk_backward import ChunkGatedDeltaRuleFunction  # imports this module

            return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_state, scale, output_final_state,
                                                     use_qk_l2norm_in_kernel, cu_seqlens)
    if not use_triton(q):  # plain PyTorch: autograd goes through the reference
        def reference(h0):
            return chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, h0,
                                              output_final_state or state_indices is not None,
                                              use_qk_l2norm_in_kernel, cu_seqlens)

        o, final = (reference(initial_state) if state_indices is None else
                    run_on_state_pool(reference, initial_state, state_indices, has_initial_state))
        o = o if out is None else out.copy_(o)
        return (o if norm is None else _gated_norm_in_place(o.contiguous(), norm)), final
    B, T = q.shape[:2]
    if N == 0 or B * T == 0:
        o = torch.empty_like(v) if out is None else out
        if state_indices is not None:
            return o, initial_state
        return o, (initial_state.clone() if output_final_state and initial_state is not None else None)
    # B rows of T tokens = B sequences; q, k, v read in place where their rows allow it
    packed = [_token_rows(t, B, T) for t in (q, k, v)] + [t.reshape(1, B * T, -1).contiguous() for t in (g, beta)]
    V = v.shape[-1]
    fused_norm = norm is not None and V & (V - 1) == 0 and V <= OUTPUT_BLOCK_V  # whole heads a program
    o, final, _ = chunk_gated_delta_rule_kernels(
        *packed, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, seq_len=T,
        state_indices=None if state_indices is None else state_indices.contiguous(),
        has_initial_state=None if has_initial_state is None else has_initial_state.contiguous(),
        out=None if out is None else out.view(1, B * T, *v.shape[2:]),
        norm=(norm[0], as_rows("norm_gate", norm[1]), norm[2]) if fused_norm else None)
    o = o.view(v.shape) if out is None else out
    if norm is not None and not fused_norm:
        _gated_norm_in_place(o, norm)
    return o, final


def _token_rows(t: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B, T, heads, dim] as [1, B T, heads, dim]: a view when each token's heads are dense and the
    rows follow each other at one token stride (a wider projection's slice), else a copy."""
    heads, dim = t.shape[2:]
    step = t.stride(1)
    if t.stride(3) == 1 and t.stride(2) == dim and step >= heads * dim and (B == 1 or t.stride(0) == T * step):
        return t.as_strided((1, B * T, heads, dim), (B * T * step, step, dim, 1))
    return t.reshape(1, B * T, heads, dim).contiguous()


def _check_pool_and_out(v, N, state_indices, has_initial_state, out) -> None:
    """``has_initial_state`` (only with ``state_indices``) and ``out`` as ``chunk_gated_delta_rule``
    documents them; the pool itself is ``_check``'s."""
    if has_initial_state is not None:
        if state_indices is None:
            raise ValueError("has_initial_state: only used with state_indices (a state pool)")
        if (not isinstance(has_initial_state, torch.Tensor) or has_initial_state.dtype != torch.bool
                or has_initial_state.shape != (N,)):
            raise ValueError(f"has_initial_state: expected a bool tensor [N] = ({N},)")
        check_same_device(v=v, has_initial_state=has_initial_state)
    if out is not None:
        if (not isinstance(out, torch.Tensor) or out.shape != v.shape or out.dtype != v.dtype
                or not out.is_contiguous()):
            raise ValueError(f"out: expected a contiguous {v.dtype} tensor of v's shape {tuple(v.shape)}")
        check_same_device(v=v, out=out)
