"""Chunked gated delta rule (prefill): the algorithm of ``naive.chunk_gated_delta_rule_ref`` in
two Triton kernels.

1. ``_chunk_wy_kernel``, one program per (chunk, value head), all chunks in parallel: with
   G = cumsum(g) inside the chunk and A = strictly_lower(beta_i (k_i . k_j) exp(G_i - G_j)),
   solves (I + A) U = diag(beta) V and (I + A) W = diag(beta e^G) K by forward substitution in
   fp32 (exact, as a triangular solve; no division by cumulative decay), and writes U, W and G.
2. ``_chunk_state_kernel``, one program per (sequence, value head, BLOCK_V columns), walking its
   sequence's chunks with the state S [K, BLOCK_V] on chip:
       N = U - W S;  O = scale ((Q e^G) S + lower(Q K^T * Gamma) N);  S = e^{G_C} S + (K e^{G_C - G})^T N.
A batch of equal-length rows runs as one packed sequence of B rows (cu_seqlens = 0, T, 2T, ...);
the chunk table for packed sequences is built on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.fused_recurrent import _check, _NoBackward
from fuselm.ops.gated_delta_rule.naive import chunk_gated_delta_rule_ref
from fuselm.runtime import needs_autograd, use_triton

CHUNK = 64  # tokens per chunk (BT)


@triton.jit
def _load_rows(ptr, t0, n_rows, stride_t, col0, n_cols, BT: tl.constexpr, BC: tl.constexpr):
    """[BT, BC] fp32 tile of rows t0 .. t0 + n_rows (zeros past them and past n_cols)."""
    r = tl.arange(0, BT)
    c = tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return tl.load(ptr + (t0 + r).to(tl.int64)[:, None] * stride_t + col0 + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _l2norm_rows(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _chunk_wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, gcum_ptr, chunk_start_ptr, chunk_len_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunk_start_ptr + i_c).to(tl.int64)
    n = tl.load(chunk_len_ptr + i_c)  # 0 for a padding slot: nothing to do
    if n > 0:
        rows = tl.arange(0, BT)
        row_ok = rows < n
        kc = _load_rows(k_ptr, t0, n, H * K, i_h * K, K, BT, BK)
        if L2NORM:
            kc = _l2norm_rows(kc)
        vc = _load_rows(v_ptr, t0, n, HV * V, i_hv * V, V, BT, BV)
        g = tl.load(g_ptr + (t0 + rows) * HV + i_hv, mask=row_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + (t0 + rows) * HV + i_hv, mask=row_ok, other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        strictly_lower = rows[:, None] > rows[None, :]
        decay = tl.exp(tl.where(strictly_lower, G[:, None] - G[None, :], float("-inf")))
        A = beta[:, None] * tl.dot(kc, tl.trans(kc), input_precision="ieee") * decay
        u = beta[:, None] * vc
        w = (beta * tl.exp(G))[:, None] * kc
        for i in range(1, BT):  # forward substitution: row i uses the finished rows j < i
            a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)  # A[i, :]
            u = tl.where(rows[:, None] == i, u - tl.sum(a_i[:, None] * u, axis=0)[None, :], u)
            w = tl.where(rows[:, None] == i, w - tl.sum(a_i[:, None] * w, axis=0)[None, :], w)
        cv = tl.arange(0, BV)
        ck = tl.arange(0, BK)
        t = (t0 + rows).to(tl.int64)
        tl.store(u_ptr + (t * HV + i_hv)[:, None] * V + cv[None, :], u, mask=row_ok[:, None] & (cv < V)[None, :])
        tl.store(w_ptr + (t * HV + i_hv)[:, None] * K + ck[None, :], w, mask=row_ok[:, None] & (ck < K)[None, :])
        tl.store(gcum_ptr + t * HV + i_hv, G, mask=row_ok)


@triton.jit
def _chunk_state_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, gcum_ptr, o_ptr, h0_ptr, ht_ptr, cu_seqlens_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):
    i_n = tl.program_id(0) // HV
    i_hv = tl.program_id(0) % HV
    i_h = i_hv // (HV // H)
    v0 = tl.program_id(1) * BV
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
    lower = rows[:, None] >= rows[None, :]
    for t0 in range(bos, eos, BT):
        n = tl.minimum(eos - t0, BT)
        row_ok = rows < n
        qc = _load_rows(q_ptr, t0, n, H * K, i_h * K, K, BT, BK)
        kc = _load_rows(k_ptr, t0, n, H * K, i_h * K, K, BT, BK)
        if L2NORM:
            qc = _l2norm_rows(qc)
            kc = _l2norm_rows(kc)
        u = _load_rows(u_ptr + i_hv * V, t0, n, HV * V, v0, V - v0, BT, BV)
        w = _load_rows(w_ptr + i_hv * K, t0, n, HV * K, 0, K, BT, BK)
        G = tl.load(gcum_ptr + (t0 + rows) * HV + i_hv, mask=row_ok, other=0.0)
        G_last = tl.sum(tl.where(rows == n - 1, G, 0.0), axis=0)
        G = tl.where(row_ok, G, G_last)  # padded rows: every exponent below stays <= 0
        new_v = u - tl.dot(w, S, input_precision="ieee")
        decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
        qk = tl.dot(qc, tl.trans(kc), input_precision="ieee") * decay
        o = scale * (tl.dot(qc * tl.exp(G)[:, None], S, input_precision="ieee") + tl.dot(qk, new_v, input_precision="ieee"))
        t = (t0 + rows).to(tl.int64)
        tl.store(o_ptr + (t * HV + i_hv)[:, None] * V + cv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cv < V)[None, :])
        k_decayed = kc * tl.where(row_ok, tl.exp(G_last - G), 0.0)[:, None]
        S = tl.exp(G_last) * S + tl.dot(tl.trans(k_decayed), new_v, input_precision="ieee")
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


def chunk_gated_delta_rule_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens):
    """Launch both kernels on packed inputs (B = 1, cu_seqlens given). Returns (o, final or None)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1
    BK, BV_full = triton.next_power_of_2(K), triton.next_power_of_2(V)
    u = torch.empty(T, HV, V, dtype=torch.float32, device=q.device)
    w = torch.empty(T, HV, K, dtype=torch.float32, device=q.device)
    gcum = torch.empty(T, HV, dtype=torch.float32, device=q.device)
    start, length = chunk_table(cu_seqlens, T)
    _chunk_wy_kernel[(start.numel(), HV)](
        k, v, g, beta, u, w, gcum, start, length,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=BV_full, L2NORM=l2, num_warps=4,
    )
    o = torch.empty_like(v)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    block_v = min(32, BV_full)
    _chunk_state_kernel[(N * HV, triton.cdiv(V, block_v))](
        q, k, u, w, gcum, o, initial_state if initial_state is not None else u, final if final is not None else u,
        cu_seqlens, float(scale), H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=block_v,
        L2NORM=l2, HAS_H0=initial_state is not None, STORE_HT=final is not None, num_warps=4,
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
