"""``gated_delta_gates``: a Gated DeltaNet layer's gates from its input projection, one launch.

    g    = -exp(A_log) * softplus(a + dt_bias)      fp32,        [B, T, HV]
    beta = sigmoid(b), rounded to b's dtype          (HF's ``b.sigmoid()``), [B, T, HV]
    tokens outside ``token_mask`` [B, T]: g = 0, beta = 0 (a padded token passes the state unchanged)

a, b: [B, T, HV], unit stride over HV (views of the projection, any other strides); A_log,
dt_bias: [HV]. Numerics: the decode-step kernel's (``decode_step.py``): A_log, dt_bias and a in
fp32; softplus(x) = x past 20, else log(1 + exp(x)) (torch's log1p form: within 1e-7 absolute,
where exp(x) < 1e-7); beta = sigmoid in fp32, one rounding. Reference: ``gated_delta_gates_ref``
(``naive.gates_from_projections`` with the mask), also the CPU fallback. In the prefill path this
replaces a dozen elementwise launches per layer. Inference only (no autograd); no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.fused_recurrent import softplus
from fuselm.ops.gated_delta_rule.naive import gated_delta_gates_ref
from fuselm.runtime import check_match, check_same_device, check_tensor, needs_autograd, next_power_of_2, use_triton

BLOCK_TOKENS = 16  # tokens per program


@triton.jit
def _gates_kernel(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, mask_ptr, g_ptr, beta_ptr, n_tokens, T,
                  stride_ab, stride_at, stride_bb, stride_bt, HV, HAS_MASK: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """A program per BLOCK_T tokens (flat index i = batch * T + t) x all HV heads."""
    i = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    ok = (i[:, None] < n_tokens) & (h[None, :] < HV)
    batch, t = i // T, i % T
    a = tl.load(a_ptr + (batch * stride_ab + t * stride_at)[:, None] + h[None, :], mask=ok, other=0.0)
    b = tl.load(b_ptr + (batch * stride_bb + t * stride_bt)[:, None] + h[None, :], mask=ok, other=0.0)
    A_log = tl.load(A_log_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    g = -tl.exp(A_log)[None, :] * softplus(a.to(tl.float32) + dt_bias[None, :])
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    if HAS_MASK:
        real = tl.load(mask_ptr + i, mask=i < n_tokens, other=0).to(tl.int1)[:, None]
        g = tl.where(real, g, 0.0)
        beta = tl.where(real, beta, 0.0)
    out = i[:, None] * HV + h[None, :]
    tl.store(g_ptr + out, g, mask=ok)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=ok)


def _check(A_log, a, dt_bias, b, token_mask):
    for name, t in (("A_log", A_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        check_tensor(name, t)
    if a.dim() != 3:
        raise ValueError(f"a: expected [B, T, HV], got shape {tuple(a.shape)}")
    check_match("b", b, "a", a)
    for name, t in (("a", a), ("b", b)):
        if t.stride(2) != 1 and t.shape[2] > 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(t.stride())}")
    HV = a.shape[2]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (HV,):
            raise ValueError(f"{name}: expected [HV] = ({HV},), got {tuple(t.shape)}")
    if token_mask is not None:
        check_tensor("token_mask", token_mask, (torch.bool,))
        if token_mask.shape != a.shape[:2]:
            raise ValueError(f"token_mask: expected [B, T] = {tuple(a.shape[:2])}, got {tuple(token_mask.shape)}")
    check_same_device(A_log=A_log, a=a, dt_bias=dt_bias, b=b, token_mask=token_mask)
    for name, t in (("A_log", A_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        if needs_autograd(t):
            raise ValueError(f"{name}: requires grad, but gated_delta_gates is inference-only; "
                             "use gated_delta_gates_ref (or call it under torch.no_grad())")


def gated_delta_gates(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
                      token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [B, T, HV] fp32, beta [B, T, HV] in b's dtype), contiguous (module doc).

    Args:
        A_log, dt_bias: [HV] (any float dtype). a, b: [B, T, HV] projections (one dtype; strided
            rows allowed). token_mask: optional [B, T] bool, False for padding.
    """
    _check(A_log, a, dt_bias, b, token_mask)
    if not use_triton(a):
        g, beta = gated_delta_gates_ref(A_log, a, dt_bias, b, token_mask)
        return g.contiguous(), beta.contiguous()
    B, T, HV = a.shape
    g = torch.empty(B, T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty(B, T, HV, dtype=b.dtype, device=a.device)
    if g.numel() == 0:
        return g, beta
    mask = token_mask.contiguous() if token_mask is not None else g
    _gates_kernel[(triton.cdiv(B * T, BLOCK_TOKENS),)](
        a, b, A_log, dt_bias, mask, g, beta, B * T, T, a.stride(0), a.stride(1), b.stride(0), b.stride(1), HV,
        HAS_MASK=token_mask is not None, BLOCK_T=BLOCK_TOKENS, BLOCK_H=next_power_of_2(HV),
    )
    return g, beta
