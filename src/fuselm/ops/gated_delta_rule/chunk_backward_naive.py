"""Plain-PyTorch chunk-wise backward of the gated delta rule: the ground truth for the Triton
backward (``chunk_backward.py``). Any float dtype (float64 for the exact checks).

Forward, per sequence, value head and chunk of C tokens (naive.chunk_gated_delta_rule_ref), with
the state S0 [K, V] at the chunk start, G = cumsum(g) from the chunk start, G_C its last entry,
Gamma_ij = exp(G_i - G_j) (j <= i, else 0), Q and K the (l2-normalised) keys [C, K]:
    A   = strictly_lower(diag(beta) (K K^T * Gamma)),   T = (I + A)^-1
    U   = T Vb,  Vb = diag(beta) V;      W = T Kb,  Kb = diag(beta e^G) K
    N   = U - W S0
    O   = Qg S0 + Aqk N,         Qg = diag(e^G) Q scale,  Aqk = lower(Q K^T * Gamma) scale
    S1  = e^{G_C} S0 + Kd^T N,   Kd = diag(e^{G_C - G}) K

Backward (chain rule, read bottom-up; dX is dLoss/dX; given dO [C, V] and dS1 [K, V]):
    dN   = Aqk^T dO + Kd dS1
    dS0  = Qg^T dO + e^{G_C} dS1 - W^T dN           (carried to the previous chunk)
    dQg  = dO S0^T,   dAqk = lower(dO N^T),   dKd = N dS1^T,   dW = -dN S0^T,   dU = dN
    dVb  = T^T dU,    dKb = T^T dW,    dT = dU Vb^T + dW Kb^T
    dA   = strictly_lower(-T^T dT T^T)              (d(X^-1) = -X^-1 dX X^-1)
  then the leaves:
    dV    = diag(beta) dVb
    dQ    = diag(e^G) dQg scale + dP K,                    dP = dAqk * Gamma scale
    dK    = dP^T Q + diag(e^{G_C-G}) dKd + diag(beta e^G) dKb + dB K + dB^T K,   dB = diag(beta) dA * Gamma
    dbeta = rowsum(dVb * V) + e^G rowsum(dKb * K) + rowsum(dA * K K^T * Gamma)
    dG    = x - r + rowsum(M) - colsum(M) + [last row] (e^{G_C} sum(dS1 * S0) + sum(r)),  with
            x = rowsum(dQg * Qg) + rowsum(dKb * Kb)     (terms in e^{G_i})
            r = rowsum(dKd * Kd)                        (e^{G_C - G_i}; G_C is the last row's G)
            M = dAqk * Aqk + dA * A                     (Gamma_ij = e^{G_i - G_j}: + row i, - column j)
    dg    = reverse_cumsum(dG)  (G = cumsum(g): dg_t = sum_{i >= t} dG_i), summed pair by pair:
    dg_t  = sum_{i >= t} x_i + e^{G_C} sum(dS1 * S0) + sum_{i < t} r_i + sum_{i >= t > j} M_ij.
    (The terms of dG that cancel in the reverse cumsum are left out: with strong decay dg is tiny
    next to the terms of dG, and reverse_cumsum(dG) in fp32 lost it to rounding, 2.6e-3 relative
    at g ~ -10; in this form every term carries the decay across t.)
Across chunks dS0 of chunk c is dS1 of chunk c - 1; d(initial_state) is dS0 of the first chunk,
and dS1 of the last chunk is the gradient flowing into the final state (zero when unused).
Heads: value head hv reads key head hv // (HV / H), so dq and dk sum over the value heads sharing
a key head. l2 norm y = x rsqrt(|x|^2 + eps): dx = rsqrt(|x|^2 + eps) (dy - y <y, dy>).
"""

from __future__ import annotations

import torch

from fuselm.ops.gated_delta_rule.naive import l2norm


def _spans(B, T, cu_seqlens):
    """(batch row, first token, end token) of each sequence."""
    if cu_seqlens is None:
        return [(n, 0, T) for n in range(B)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def recurrent_gated_delta_rule_autograd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                        use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The token recurrence of ``naive.recurrent_gated_delta_rule_ref`` in the inputs' own dtype
    (that one computes in fp32), built from out-of-place ops so that torch.autograd goes through
    it: the float64 ground truth for the gradients. Returns (o, final or None) like it."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    outs, finals = [], []
    for n, (row, start, end) in enumerate(_spans(B, T, cu_seqlens)):
        S = (initial_state[n].to(v.dtype) if initial_state is not None
             else torch.zeros(HV, K, v.shape[3], dtype=v.dtype, device=v.device))
        o_seq = []
        for t in range(start, end):
            S = S * torch.exp(g[row, t])[:, None, None]
            u = (v[row, t] - torch.einsum("hkv,hk->hv", S, k[row, t])) * beta[row, t][:, None]
            S = S + k[row, t][:, :, None] * u[:, None, :]
            o_seq.append(scale * torch.einsum("hkv,hk->hv", S, q[row, t]))
        outs.append(torch.stack(o_seq) if o_seq else v.new_zeros(0, *v.shape[2:]))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outs)
    else:
        o = torch.cat(outs)[None]
    return o, (torch.stack(finals) if output_final_state else None)


def _chunk_terms(Q, Kc, Vc, gc, bc, scale):
    """The forward's per-chunk quantities; Q, Kc [HV, C, K], Vc [HV, C, V], gc, bc [HV, C]."""
    C = gc.shape[-1]
    G = gc.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=Q.device).tril()
    strict = lower.tril(-1)
    gamma = torch.exp(torch.where(lower, G[:, :, None] - G[:, None, :], float("-inf")))
    KK = Kc @ Kc.transpose(1, 2)
    A = torch.where(strict, bc[:, :, None] * KK * gamma, 0.0)
    eye = torch.eye(C, dtype=Q.dtype, device=Q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    Vb = bc[..., None] * Vc
    Kb = (bc * torch.exp(G))[..., None] * Kc
    return dict(G=G, gamma=gamma, KK=KK, A=A, T=Tinv, Vb=Vb, Kb=Kb, U=Tinv @ Vb, W=Tinv @ Kb, lower=lower,
                strict=strict, Aqk=torch.where(lower, (Q @ Kc.transpose(1, 2)) * gamma * scale, 0.0),
                Qg=Q * torch.exp(G)[..., None] * scale, Kd=Kc * torch.exp(G[:, -1:] - G)[..., None],
                decay=torch.exp(G[:, -1]), scale=scale)


def _chunk_backward(c, S0, Q, Kc, Vc, bc, dO, dS1):
    """One chunk's backward (module docstring); returns (dQ, dK, dV, dg, dbeta, dS0)."""
    T_ = c["T"]
    tr = lambda x: x.transpose(1, 2)  # noqa: E731
    N = c["U"] - c["W"] @ S0
    dN = tr(c["Aqk"]) @ dO + c["Kd"] @ dS1
    dS0 = tr(c["Qg"]) @ dO + c["decay"][:, None, None] * dS1 - tr(c["W"]) @ dN
    dQg = dO @ tr(S0)
    dAqk = torch.where(c["lower"], dO @ tr(N), 0.0)
    dKd = N @ tr(dS1)
    dW = -dN @ tr(S0)
    dVb, dKb = tr(T_) @ dN, tr(T_) @ dW
    dT = dN @ tr(c["Vb"]) + dW @ tr(c["Kb"])
    dA = torch.where(c["strict"], -tr(T_) @ dT @ tr(T_), 0.0)
    G, gamma, eG, scale = c["G"], c["gamma"], torch.exp(c["G"]), c["scale"]
    dP = dAqk * gamma * scale  # d(Q K^T) through Aqk
    dB = dA * bc[:, :, None] * gamma
    dV = bc[..., None] * dVb
    dQ = dQg * eG[..., None] * scale + dP @ Kc
    dK = tr(dP) @ Q + dKd * torch.exp(G[:, -1:] - G)[..., None] + dKb * (bc * eG)[..., None] + dB @ Kc + tr(dB) @ Kc
    dbeta = (dVb * Vc).sum(-1) + eG * (dKb * Kc).sum(-1) + (dA * c["KK"] * gamma).sum(-1)
    # dg_t = sum_{i >= t} dG_i, summed by where each term's decay crosses t (see the docstring)
    x = (dQg * c["Qg"]).sum(-1) + (dKb * c["Kb"]).sum(-1)  # e^{G_i}: every i >= t
    r = (dKd * c["Kd"]).sum(-1)  # e^{G_C - G_i}: every i < t
    M = dAqk * c["Aqk"] + dA * c["A"]  # e^{G_i - G_j}: every i >= t > j
    C = x.shape[-1]
    at_or_after = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()  # [i, t]: i >= t
    dg = ((x[:, :, None] * at_or_after).sum(1) + (r[:, :, None] * ~at_or_after).sum(1)
          + c["decay"][:, None] * (dS1 * S0).sum((-2, -1))[:, None]
          + ((M @ (~at_or_after).to(M.dtype)) * at_or_after).sum(1))
    return dQ, dK, dV, dg, dbeta, dS0


def _sequence_backward(S, q, k, v, g, beta, scale, do, dS, chunk_size):
    """One sequence: q, k [L, HV, K] (normalised, per value head), v, do [L, HV, V], g, beta
    [L, HV], S the initial state [HV, K, V], dS the gradient into the final state. A forward
    pass over the chunks keeps each chunk-start state h[c]; the reverse pass carries dS."""
    L = q.shape[0]
    starts = list(range(0, L, chunk_size))
    per_chunk = lambda x, c0: x[c0:c0 + chunk_size].transpose(0, 1)  # noqa: E731  [HV, C, *]
    states, terms = [], []
    for c0 in starts:
        Q, Kc, Vc, gc, bc = (per_chunk(x, c0) for x in (q, k, v, g, beta))
        c = _chunk_terms(Q, Kc, Vc, gc, bc, scale)
        states.append(S)
        terms.append(c)
        N = c["U"] - c["W"] @ S
        S = c["decay"][:, None, None] * S + c["Kd"].transpose(1, 2) @ N
    grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    for c0, S0, c in reversed(list(zip(starts, states, terms))):
        Q, Kc, Vc, bc, dO = (per_chunk(x, c0) for x in (q, k, v, beta, do))
        out = _chunk_backward(c, S0, Q, Kc, Vc, bc, dO, dS)
        for grad, d in zip(grads, out[:5]):
            grad[c0:c0 + chunk_size] = d.transpose(0, 1)
        dS = out[5]
    return (*grads, dS)


def chunk_gated_delta_rule_backward_ref(q, k, v, g, beta, scale=None, initial_state=None, do=None, dht=None,
                                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size: int = 64):
    """Gradients of (o, final_state) of the gated delta rule, chunk by chunk, in the inputs'
    dtype. Arguments as ``naive.chunk_gated_delta_rule_ref`` plus ``do`` [B, T, HV, V] (dLoss/do)
    and ``dht`` [N, HV, K, V] (dLoss/d final_state, None for zero).
    Returns (dq, dk [B, T, H, K], dv [B, T, HV, V], dg, dbeta [B, T, HV], dh0 [N, HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G_ = HV // H
    scale = K**-0.5 if scale is None else scale
    dt = v.dtype
    qn, kn = (l2norm(q.to(dt)), l2norm(k.to(dt))) if use_qk_l2norm_in_kernel else (q.to(dt), k.to(dt))
    qh, kh = qn.repeat_interleave(G_, dim=2), kn.repeat_interleave(G_, dim=2)  # [B, T, HV, K]
    gf, bf, dof = g.to(dt), beta.to(dt), do.to(dt)
    dq_h, dk_h = torch.zeros_like(qh), torch.zeros_like(kh)
    dv, dg, dbeta = torch.zeros_like(v), torch.zeros_like(gf), torch.zeros_like(bf)
    spans = _spans(B, T, cu_seqlens)
    dh0 = torch.zeros(len(spans), HV, K, V, dtype=dt, device=v.device)
    for n, (row, start, end) in enumerate(spans):
        S = initial_state[n].to(dt) if initial_state is not None else dh0.new_zeros(HV, K, V)
        dS = dht[n].to(dt) if dht is not None else dh0.new_zeros(HV, K, V)
        s = slice(start, end)
        out = _sequence_backward(S, qh[row, s], kh[row, s], v[row, s], gf[row, s], bf[row, s], scale, dof[row, s],
                                 dS, chunk_size)
        dq_h[row, s], dk_h[row, s], dv[row, s], dg[row, s], dbeta[row, s], dh0[n] = out
    # value heads sharing a key head: sum their dq, dk; then back through the l2 norm
    dq, dk = dq_h.view(B, T, H, G_, K).sum(3), dk_h.view(B, T, H, G_, K).sum(3)
    if use_qk_l2norm_in_kernel:
        dq, dk = _l2norm_backward(q.to(dt), qn, dq), _l2norm_backward(k.to(dt), kn, dk)
    return dq, dk, dv, dg, dbeta, dh0


def _l2norm_backward(x, y, dy, eps: float = 1e-6):
    """dx for y = x rsqrt(|x|^2 + eps): rsqrt(|x|^2 + eps) (dy - y <y, dy>)."""
    r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))
