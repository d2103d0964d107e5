"""Plain-PyTorch reference for the gated delta rule (Gated DeltaNet), in fp32.

Per sequence and value head, with state S [K, V] (fp32):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = scale * S_t^T q_t
Shapes (flash-linear-attention conventions): q, k [B, T, H, K]; v [B, T, HV, V] with HV a
multiple of H (value head hv reads q/k head hv // (HV // H)); g (log-decay, <= 0) and beta
[B, T, HV]; states [N, HV, K, V]. With ``cu_seqlens`` [N + 1] the batch is one packed sequence
(B = 1) of N variable-length sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (FLA's in-kernel l2 norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def decay_gate(A_log, a, dt_bias=None):
    """The log-decay g = -exp(A_log) * softplus(a + dt_bias) in fp32 (Qwen3.5 / FLA); a [..., HV],
    A_log and dt_bias [HV] (None: no bias)."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() if dt_bias is None else a.float() + dt_bias.float())


def gates_from_projections(A_log, a, dt_bias, b):
    """Qwen3.5 / FLA gates from raw projections: g = ``decay_gate``, beta = sigmoid(b); a, b
    [B, T, HV], A_log and dt_bias [HV]. In fp32."""
    return decay_gate(A_log, a, dt_bias), torch.sigmoid(b.float())


def gated_delta_gates_ref(A_log, a, dt_bias, b, token_mask=None):
    """A prefill's gates (``gates.gated_delta_gates``): g = ``decay_gate`` fp32 and beta =
    sigmoid(b) in b's dtype (HF's ``b.sigmoid()``), [B, T, HV]; zeros where ``token_mask`` [B, T]
    is False (padding: the state passes such a token unchanged)."""
    g, beta = decay_gate(A_log, a, dt_bias), b.sigmoid()
    if token_mask is not None:
        g, beta = g.masked_fill(~token_mask[..., None], 0), beta.masked_fill(~token_mask[..., None], 0)
    return g, beta


def _run_sequences(run_sequence, q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens):
    """Shared driver of the references: fp32 inputs per value head, then ``run_sequence(S, q, k,
    v, g, beta, scale) -> (o, S)`` on each sequence ([L, HV, *] slices, S [HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if l2:
        qf, kf = l2norm(qf), l2norm(kf)
    qf, kf = qf.repeat_interleave(HV // H, dim=2), kf.repeat_interleave(HV // H, dim=2)  # [B, T, HV, K]
    vf, gf, bf = v.float(), g.float(), beta.float()
    if cu_seqlens is None:
        spans = [(n, 0, T) for n in range(B)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float32, device=q.device)
    finals = []
    for n, (row, start, end) in enumerate(spans):
        S = (initial_state[n].float().clone() if initial_state is not None
             else torch.zeros(HV, K, V, dtype=torch.float32, device=q.device))
        o[row, start:end], S = run_sequence(S, *(x[row, start:end] for x in (qf, kf, vf, gf, bf)), scale)
        finals.append(S)
    return o.to(v.dtype), (torch.stack(finals) if output_final_state else None)


def _recurrent_sequence(S, q, k, v, g, beta, scale):
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, None]
        u = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = scale * torch.einsum("hkv,hk->hv", S, q[t])
    return o, S


def recurrent_gated_delta_rule_ref(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None,
):
    """Token-by-token recurrence in fp32. Returns (o [B, T, HV, V] in v's dtype, final_state
    [N, HV, K, V] fp32 or None)."""
    return _run_sequences(_recurrent_sequence, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, cu_seqlens)


def _chunked_sequence(S, q, k, v, g, beta, scale, chunk_size=64):
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for c0 in range(0, q.shape[0], chunk_size):
        Q, Kc, Vc = (x[c0:c0 + chunk_size].transpose(0, 1) for x in (q, k, v))  # [HV, C, *]
        G = g[c0:c0 + chunk_size].transpose(0, 1).cumsum(-1)  # [HV, C]
        Bt = beta[c0:c0 + chunk_size].transpose(0, 1)
        C = G.shape[1]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        gamma = torch.exp(torch.where(lower, G[:, :, None] - G[:, None, :], float("-inf")))  # [HV, C, C]
        A = torch.eye(C, device=q.device) + (Bt[:, :, None] * (Kc @ Kc.transpose(1, 2)) * gamma).tril(-1)
        rhs = Bt[:, :, None] * (Vc - torch.exp(G)[:, :, None] * (Kc @ S))
        N = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [HV, C, V]
        o[c0:c0 + chunk_size] = (scale * ((Q * torch.exp(G)[:, :, None]) @ S
                                          + ((Q @ Kc.transpose(1, 2)) * gamma) @ N)).transpose(0, 1)
        S = torch.exp(G[:, -1])[:, None, None] * S + (Kc * torch.exp(G[:, -1:] - G)[:, :, None]).transpose(1, 2) @ N
    return o, S


def chunk_gated_delta_rule_ref(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size: int = 64,
):
    """The chunked algorithm in fp32, the ground truth for the chunked kernels.

    Within a chunk of C tokens (G = cumulative sum of g from the chunk start, Gamma_ij =
    exp(G_i - G_j) for j <= i, never a division by exp(G)): with the state S0 at the chunk start,
    the new values N (nu_i = beta_i (v_i - e^{g_i} S_{i-1}^T k_i)) solve
        (I + strictly_lower(diag(beta) (K K^T * Gamma))) N = diag(beta) (V - diag(e^G) K S0),
    i.e. N = U - W S0 with U = T diag(beta) V, W = T diag(beta) diag(e^G) K, T the inverse. Then
        O     = scale ((Q * e^G) S0 + lower(Q K^T * Gamma) N)      (lower: diagonal included)
        S_end = e^{G_C} S0 + (K * e^{G_C - G})^T N.
    Same arguments and returns as ``recurrent_gated_delta_rule_ref``.
    """
    return _run_sequences(lambda *a: _chunked_sequence(*a, chunk_size=chunk_size), q, k, v, g, beta, scale,
                          initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def run_on_state_pool(reference, pool, state_indices, has_initial_state=None):
    """A reference run on a state pool [P, HV, K, V]: sequence n starts from
    ``pool[state_indices[n]]`` (zeros where the index is negative or ``has_initial_state[n]`` is
    False) and leaves its final state there (a negative index: nowhere). ``reference(h0)`` returns
    (o, final [N, HV, K, V]). Returns (o, pool), the pool updated in place."""
    valid = state_indices >= 0
    read = valid if has_initial_state is None else valid & has_initial_state.to(torch.bool)
    h0 = torch.where(read[:, None, None, None], pool[state_indices.clamp(min=0).long()], 0.0)
    o, final = reference(h0)
    pool[state_indices[valid].long()] = final[valid].to(pool.dtype)  # a 16-bit pool: rounded once
    return o, pool


def gated_delta_rule_decode_step_ref(proj, conv_state, conv_weight, A_log, dt_bias, state, state_slots, positions,
                                     H, K, HV, V, scale=None):
    """One Qwen3.5 Gated DeltaNet decode token per row from the in_proj output ``proj`` [N, P]
    (see ``decode_step.py`` for the layout and the pool of circular conv states ``conv_state``
    [P, conv_dim, KW]), as HF's torch path computes it: F.conv1d over the window in the model dtype,
    SiLU, q/k l2-norm, g = -exp(A_log) softplus(a + dt_bias) (fp32), beta = sigmoid(b) (model
    dtype), then the recurrence (fp32). Row n's state in both pools is at slot ``state_slots[n]``;
    updates them in place for rows with ``state_slots >= 0`` (a negative slot's history and state
    read as zeros); returns o [N, HV, V] in proj's dtype."""
    N = proj.shape[0]
    KW = conv_weight.shape[-1]
    conv_dim = 2 * H * K + HV * V
    x = proj[:, :conv_dim]
    b, a = proj[:, conv_dim + HV * V:].split([HV, HV], dim=-1)
    active = state_slots >= 0
    slots = state_slots.long().clamp(min=0)
    columns = (positions.long()[:, None] + 1 + torch.arange(KW - 1, device=proj.device)) % KW  # oldest first
    history = conv_state[slots].gather(2, columns[:, None, :].expand(N, conv_dim, KW - 1))
    history = torch.where(active[:, None, None], history, 0)
    window = torch.cat([history, x[:, :, None]], dim=-1)
    conv_out = F.silu(F.conv1d(window, conv_weight, groups=conv_dim))[..., 0]  # [N, conv_dim]
    q, k, v = conv_out.split([H * K, H * K, HV * V], dim=-1)
    g = decay_gate(A_log, a, dt_bias)
    h0 = torch.where(active[:, None, None, None], state[slots], 0.0)
    o, final = recurrent_gated_delta_rule_ref(q.reshape(N, 1, H, K), k.reshape(N, 1, H, K), v.reshape(N, 1, HV, V),
                                              g[:, None], b.sigmoid()[:, None], scale, h0, True, True)
    state[slots[active]] = final[active].to(state.dtype)  # a 16-bit pool: rounded once
    conv_state[slots[active], :, positions.long()[active] % KW] = x[active]
    return o[:, 0]
