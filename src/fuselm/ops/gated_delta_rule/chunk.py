"""Chunked gated delta rule (prefill): the algorithm of ``naive.chunk_gated_delta_rule_ref`` in
two Triton kernels, tensor-core dots throughout, fp32 accumulation.

Per chunk of BT = 64 tokens, with G = cumsum(g) from the chunk start, Gamma_ij = exp(G_i - G_j)
(j <= i; an exponent <= 0, never a division by a cumulative decay) and the state S0 at its start:
    A = strictly_lower(diag(beta) (K K^T * Gamma)),     T = (I + A)^-1
    U = T diag(beta) V,   W = T diag(beta e^G) K        (the WY form: new values N = U - W S0)
    O = (Q e^G scale) S0 + lower(Q K^T * Gamma scale) N,  S_end = e^{G_C} S0 + (K e^{G_C - G})^T N.

1. ``_chunk_prepare_kernel``: one program per (chunk, value head), all chunks in parallel. Writes
   G (fp32), U, W and Aqk = lower(Q K^T * Gamma) scale (in the input dtype). T is built from
   16 x 16 blocks: each diagonal block inverted by forward substitution (16 steps), the blocks
   below it by T_ab = -T_aa sum_{b <= c < a} A_ac T_cb (fp32; tf32 dots for half inputs).
2. ``_chunk_recurrence_kernel``: one program per (sequence, value head, BV value columns),
   walking its sequence's chunks with S [K, BV] (fp32) on chip; everything it loads is
   independent of S, so the loads of chunk c + 1 overlap the dots of chunk c.

Numerics (as flash-linear-attention's chunk kernel): the products with K, V, W, U, Q and S take
operands in the input dtype (S and N rounded to it) and accumulate in fp32; the state, G and the
block inverse stay in fp32. fp32 inputs use ieee fp32 dots throughout.
A batch of equal-length rows runs as one packed sequence of B rows (cu_seqlens = 0, T, 2T, ...);
the chunk table for packed sequences is built on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.fused_recurrent import _check, _NoBackward
from fuselm.ops.gated_delta_rule.naive import chunk_gated_delta_rule_ref
from fuselm.runtime import needs_autograd, num_sms, use_triton

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
def _a_block(k_a, k_b, G_a, G_b, beta_a, n_a, n_b, SUB: tl.constexpr, P: tl.constexpr, DIAGONAL: tl.constexpr):
    """Block (a, b) of A = strictly_lower(diag(beta) (K K^T * Gamma)): n_a / n_b valid rows (fp32)."""
    rows = tl.arange(0, SUB)
    keep = (rows < n_a)[:, None] & (rows < n_b)[None, :]
    if DIAGONAL:
        keep = keep & (rows[:, None] > rows[None, :])
    decay = tl.exp(tl.where(keep, G_a[:, None] - G_b[None, :], float("-inf")))
    return beta_a[:, None] * _mm(k_a, tl.trans(k_b), P) * decay


@triton.jit
def _invert_unit_lower(A, SUB: tl.constexpr):
    """(I + A)^-1 for a strictly lower [SUB, SUB] A, by forward substitution, fp32."""
    rows = tl.arange(0, SUB)
    T = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, SUB):  # row i of T from the finished rows j < i: T_i = e_i - sum_j A_ij T_j
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)
        T = tl.where(rows[:, None] == i, T - tl.sum(a_i[:, None] * T, axis=0)[None, :], T)
    return T


@triton.jit
def _store_block(ptr, x, t0, n_rows, stride, col0, n_cols, BC: tl.constexpr, SUB: tl.constexpr):
    r = tl.arange(0, SUB)
    c = tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    tl.store(ptr + (t0 + r).to(tl.int64)[:, None] * stride + col0 + c[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_inverse_times(y_ptr, X0, X1, X2, X3, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
                         t0, n, stride, col0, n_cols, BC: tl.constexpr, SUB: tl.constexpr, P: tl.constexpr):
    """Y = T X, block row by block row (X given as four SUB-row blocks in the dot dtype)."""
    dt = X0.dtype
    _store_block(y_ptr, _mm(T00.to(dt), X0, P), t0, n, stride, col0, n_cols, BC, SUB)
    _store_block(y_ptr, _mm(T10.to(dt), X0, P) + _mm(T11.to(dt), X1, P), t0 + SUB, n - SUB, stride, col0, n_cols, BC, SUB)
    _store_block(y_ptr, _mm(T20.to(dt), X0, P) + _mm(T21.to(dt), X1, P) + _mm(T22.to(dt), X2, P),
                 t0 + 2 * SUB, n - 2 * SUB, stride, col0, n_cols, BC, SUB)
    _store_block(y_ptr, _mm(T30.to(dt), X0, P) + _mm(T31.to(dt), X1, P) + _mm(T32.to(dt), X2, P)
                 + _mm(T33.to(dt), X3, P), t0 + 3 * SUB, n - 3 * SUB, stride, col0, n_cols, BC, SUB)


@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, G_ptr, u_ptr, w_ptr, aqk_ptr, chunk_start_ptr, chunk_len_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, P: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunk_start_ptr + i_c).to(tl.int64)
    n = tl.load(chunk_len_ptr + i_c)  # 0 for a padding slot: nothing to do
    if n > 0:
        dt = k_ptr.dtype.element_ty
        rows = tl.arange(0, BT)
        row_ok = rows < n
        G = tl.cumsum(_load_vec(g_ptr, t0, n, HV, i_hv, BT), axis=0)
        tl.store(G_ptr + (t0 + rows) * HV + i_hv, G, mask=row_ok)
        # Aqk = lower(Q K^T * Gamma) scale, diagonal included
        q = _load_keys(q_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        k = _load_keys(k_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        keep = (rows[:, None] >= rows[None, :]) & row_ok[:, None]
        gamma = tl.exp(tl.where(keep, G[:, None] - G[None, :], float("-inf")))
        aqk = _mm(q.to(dt), tl.trans(k.to(dt)), P) * gamma * scale
        tl.store(aqk_ptr + ((t0 + rows) * HV + i_hv).to(tl.int64)[:, None] * BT + rows[None, :],
                 aqk.to(aqk_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.debug_barrier()  # G is re-read below, in SUB-row blocks, by other threads of this program
        # the same rows in four SUB-row blocks (block a: rows a*SUB ..; n - a*SUB of them valid)
        n0, n1, n2, n3 = n, n - SUB, n - 2 * SUB, n - 3 * SUB
        k0 = _load_keys(k_ptr, t0, n0, H * K, i_h * K, K, SUB, BK, L2NORM)
        k1 = _load_keys(k_ptr, t0 + SUB, n1, H * K, i_h * K, K, SUB, BK, L2NORM)
        k2 = _load_keys(k_ptr, t0 + 2 * SUB, n2, H * K, i_h * K, K, SUB, BK, L2NORM)
        k3 = _load_keys(k_ptr, t0 + 3 * SUB, n3, H * K, i_h * K, K, SUB, BK, L2NORM)
        G0 = _load_vec(G_ptr, t0, n0, HV, i_hv, SUB)
        G1 = _load_vec(G_ptr, t0 + SUB, n1, HV, i_hv, SUB)
        G2 = _load_vec(G_ptr, t0 + 2 * SUB, n2, HV, i_hv, SUB)
        G3 = _load_vec(G_ptr, t0 + 3 * SUB, n3, HV, i_hv, SUB)
        b0 = _load_vec(beta_ptr, t0, n0, HV, i_hv, SUB)
        b1 = _load_vec(beta_ptr, t0 + SUB, n1, HV, i_hv, SUB)
        b2 = _load_vec(beta_ptr, t0 + 2 * SUB, n2, HV, i_hv, SUB)
        b3 = _load_vec(beta_ptr, t0 + 3 * SUB, n3, HV, i_hv, SUB)
        kd0, kd1, kd2, kd3 = k0.to(dt), k1.to(dt), k2.to(dt), k3.to(dt)
        # T = (I + A)^-1: diagonal blocks by substitution, then T_ab = -T_aa sum_{b <= c < a} A_ac T_cb
        T00 = _invert_unit_lower(_a_block(kd0, kd0, G0, G0, b0, n0, n0, SUB, P, True), SUB)
        T11 = _invert_unit_lower(_a_block(kd1, kd1, G1, G1, b1, n1, n1, SUB, P, True), SUB)
        T22 = _invert_unit_lower(_a_block(kd2, kd2, G2, G2, b2, n2, n2, SUB, P, True), SUB)
        T33 = _invert_unit_lower(_a_block(kd3, kd3, G3, G3, b3, n3, n3, SUB, P, True), SUB)
        A10 = _a_block(kd1, kd0, G1, G0, b1, n1, n0, SUB, P, False)
        A20 = _a_block(kd2, kd0, G2, G0, b2, n2, n0, SUB, P, False)
        A21 = _a_block(kd2, kd1, G2, G1, b2, n2, n1, SUB, P, False)
        A30 = _a_block(kd3, kd0, G3, G0, b3, n3, n0, SUB, P, False)
        A31 = _a_block(kd3, kd1, G3, G1, b3, n3, n1, SUB, P, False)
        A32 = _a_block(kd3, kd2, G3, G2, b3, n3, n2, SUB, P, False)
        T10 = -_mm(T11, _mm(A10, T00, P), P)
        T21 = -_mm(T22, _mm(A21, T11, P), P)
        T20 = -_mm(T22, _mm(A20, T00, P) + _mm(A21, T10, P), P)
        T32 = -_mm(T33, _mm(A32, T22, P), P)
        T31 = -_mm(T33, _mm(A31, T11, P) + _mm(A32, T21, P), P)
        T30 = -_mm(T33, _mm(A30, T00, P) + _mm(A31, T10, P) + _mm(A32, T20, P), P)
        # W = T diag(beta e^G) K
        _store_inverse_times(w_ptr, (k0 * (b0 * tl.exp(G0))[:, None]).to(dt), (k1 * (b1 * tl.exp(G1))[:, None]).to(dt),
                             (k2 * (b2 * tl.exp(G2))[:, None]).to(dt), (k3 * (b3 * tl.exp(G3))[:, None]).to(dt),
                             T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
                             t0, n, HV * K, i_hv * K, K, BK, SUB, P)
        # U = T diag(beta) V
        v0 = _load_rows(v_ptr, t0, n0, HV * V, i_hv * V, V, SUB, BV).to(tl.float32)
        v1 = _load_rows(v_ptr, t0 + SUB, n1, HV * V, i_hv * V, V, SUB, BV).to(tl.float32)
        v2 = _load_rows(v_ptr, t0 + 2 * SUB, n2, HV * V, i_hv * V, V, SUB, BV).to(tl.float32)
        v3 = _load_rows(v_ptr, t0 + 3 * SUB, n3, HV * V, i_hv * V, V, SUB, BV).to(tl.float32)
        _store_inverse_times(u_ptr, (v0 * b0[:, None]).to(dt), (v1 * b1[:, None]).to(dt), (v2 * b2[:, None]).to(dt),
                             (v3 * b3[:, None]).to(dt), T00, T10, T11, T20, T21, T22, T30, T31, T32, T33,
                             t0, n, HV * V, i_hv * V, V, BV, SUB, P)


@triton.jit
def _chunk_recurrence_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, aqk_ptr, G_ptr, o_ptr, h0_ptr, ht_ptr, cu_seqlens_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, P: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1) // HV
    i_hv = tl.program_id(1) % HV
    i_h = i_hv // (HV // H)
    v0 = i_v * BV
    dt = k_ptr.dtype.element_ty
    bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    state_mask = (ck < K)[:, None] & (cv < V)[None, :]
    state_offs = ((i_n * HV + i_hv) * K + ck)[:, None].to(tl.int64) * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S = tl.load(h0_ptr + state_offs, mask=state_mask, other=0.0)
    for i_c in tl.range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        n = tl.minimum(eos - t0, BT)
        row_ok = rows < n
        q = _load_keys(q_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        k = _load_keys(k_ptr, t0, n, H * K, i_h * K, K, BT, BK, L2NORM)
        w = _load_rows(w_ptr, t0, n, HV * K, i_hv * K, K, BT, BK)
        u = _load_rows(u_ptr, t0, n, HV * V, i_hv * V + v0, V - v0, BT, BV).to(tl.float32)
        aqk = _load_rows(aqk_ptr, t0, n, HV * BT, i_hv * BT, BT, BT, BT)
        G = tl.load(G_ptr + (t0 + rows) * HV + i_hv, mask=row_ok, other=0.0)
        G_last = tl.load(G_ptr + (t0 + n - 1) * HV + i_hv)
        q_decayed = (q * (tl.exp(G) * scale)[:, None]).to(dt)
        k_decayed = (k * tl.where(row_ok, tl.exp(G_last - G), 0.0)[:, None]).to(dt)
        S_in = S.to(dt)
        new_v = (u - _mm(w, S_in, P)).to(dt)  # N = U - W S0
        o = _mm(q_decayed, S_in, P) + _mm(aqk, new_v, P)
        tl.store(o_ptr + ((t0 + rows) * HV + i_hv).to(tl.int64)[:, None] * V + cv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (cv < V)[None, :])
        S = tl.exp(G_last) * S + _mm(tl.trans(k_decayed), new_v, P)
    if STORE_HT:
        tl.store(ht_ptr + state_offs, S, mask=state_mask)


def chunk_table(cu_seqlens: torch.Tensor, total_tokens: int, chunk: int = CHUNK):
    """Start token and length of every chunk of every packed sequence, on the device, padded to
    the host-known bound cdiv(T, chunk) + N slots (padding slots have length 0): no host sync."""
    n_seq = cu_seqlens.numel() - 1
    slots = triton.cdiv(total_tokens, chunk) + n_seq
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    chunks = (lengths + chunk - 1) // chunk
    first = torch.cumsum(chunks, 0) - chunks  # first slot of each sequence
    slot = torch.arange(slots, device=cu_seqlens.device)
    seq = (torch.searchsorted(first + chunks, slot, right=True)).clamp(max=n_seq - 1)
    index = slot - first[seq]
    valid = (slot < (first + chunks)[-1]) & (index < chunks[seq])
    start = cu_seqlens[seq].long() + index * chunk
    length = torch.where(valid, torch.clamp(cu_seqlens[seq + 1].long() - start, max=chunk), 0)
    return start.contiguous(), length.to(torch.int32).contiguous()


# Value columns per program of the recurrence: 32 by default, 16 when that leaves SMs idle (the
# recurrence is a chain of dependent dots: more, narrower programs hide more of its latency).
# Chosen on the H100 at B=1, H=16, K=V=128, T=8192 (benchmarks/NOTES.md).
RECURRENCE_BLOCK_V = 32


def chunk_gated_delta_rule_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens,
                                   block_v=None):
    """Launch both kernels on packed inputs (B = 1, cu_seqlens given). Returns (o, final or None)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1
    BK, BV_full = triton.next_power_of_2(K), triton.next_power_of_2(V)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    G = torch.empty(T, HV, dtype=torch.float32, device=q.device)
    u = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    w = torch.empty(T, HV, K, dtype=q.dtype, device=q.device)
    aqk = torch.empty(T, HV, CHUNK, dtype=q.dtype, device=q.device)
    start, length = chunk_table(cu_seqlens, T)
    _chunk_prepare_kernel[(start.numel(), HV)](
        q, k, v, g, beta, G, u, w, aqk, start, length, float(scale),
        H=H, HV=HV, K=K, V=V, BT=CHUNK, SUB=SUB, BK=BK, BV=BV_full, L2NORM=l2, P=precision, num_warps=4,
    )
    o = torch.empty_like(v)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    if block_v is None:
        block_v = min(RECURRENCE_BLOCK_V, BV_full)
        if q.is_cuda and N * HV * triton.cdiv(V, block_v) < num_sms(q.device):
            block_v = max(16, block_v // 2)
    _chunk_recurrence_kernel[(triton.cdiv(V, block_v), N * HV)](
        q, k, u, w, aqk, G, o, initial_state if initial_state is not None else G, final if final is not None else G,
        cu_seqlens, float(scale), H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=block_v,
        L2NORM=l2, HAS_H0=initial_state is not None, STORE_HT=final is not None, P=precision, num_warps=4,
    )
    return o, final


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
):
    """Gated delta rule over whole sequences, chunk by chunk (prefill); FLA's argument names.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H; g (<= 0), beta: [B, T, HV].
        scale: on q; default K ** -0.5.
        initial_state: fp32 [N, HV, K, V] (N = B, or the number of packed sequences).
        output_final_state: also return the final states [N, HV, K, V] (fp32).
        use_qk_l2norm_in_kernel: l2-normalise q and k per head first.
        cu_seqlens: [N + 1] offsets of N packed sequences (B = 1); no host sync while a CUDA
            graph is being captured.
    Returns:
        (o [B, T, HV, V] in v's dtype, final_state or None). No backward yet (a clear error).
    """
    N = _check(q, k, v, g, beta, None, initial_state, cu_seqlens, None)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, g, beta)
    if needs_autograd(*args):
        o, final = chunk_gated_delta_rule(*(t.detach() for t in args), scale, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel, cu_seqlens)
        return _NoBackward.apply(o, *args), final
    if not use_triton(q):
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel, cu_seqlens)
    B, T = q.shape[:2]
    if cu_seqlens is None:  # B rows of T tokens = one packed sequence of B sequences
        cu_seqlens = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int32)
    packed = [t.reshape(1, B * T, *t.shape[2:]).contiguous() for t in args]
    if N == 0 or B * T == 0:
        return torch.empty_like(v), (initial_state.clone() if output_final_state and initial_state is not None else None)
    o, final = chunk_gated_delta_rule_kernels(*packed, scale, initial_state, output_final_state,
                                              use_qk_l2norm_in_kernel, cu_seqlens)
    return o.view(v.shape), final
