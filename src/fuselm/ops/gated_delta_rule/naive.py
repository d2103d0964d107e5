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


def gates_from_projections(A_log, a, dt_bias, b):
    """Qwen3.5 / FLA gates from raw projections: g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b); a, b [B, T, HV], A_log and dt_bias [HV]. In fp32."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def recurrent_gated_delta_rule_ref(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None,
):
    """Token-by-token recurrence in fp32. Returns (o [B, T, HV, V] in v's dtype, final_state
    [N, HV, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    group = HV // H
    qf, kf = qf.repeat_interleave(group, dim=2), kf.repeat_interleave(group, dim=2)  # [B, T, HV, K]
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
        for t in range(start, end):
            S = S * torch.exp(gf[row, t])[:, None, None]
            kt = kf[row, t]  # [HV, K]
            u = (vf[row, t] - torch.einsum("hkv,hk->hv", S, kt)) * bf[row, t][:, None]
            S = S + kt[:, :, None] * u[:, None, :]
            o[row, t] = scale * torch.einsum("hkv,hk->hv", S, qf[row, t])
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(v.dtype), final
