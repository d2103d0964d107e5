"""Fused recurrent gated delta rule: decode (T = 1) and short spans (speculative verification).

One launch. A program owns one (sequence, value head) pair and a BLOCK_V slice of the value
dim, keeps its [K, BLOCK_V] slice of the fp32 state in registers and walks the tokens:
    S *= exp(g_t);  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  o_t = scale S^T q_t
(the recurrence of ``naive.py``). Optional in-kernel pieces, each a constexpr:
- gates from the raw projections: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b);
- q/k l2-normalisation (x * rsqrt(sum(x^2) + 1e-6));
- a state pool: ``state_indices`` [N] names each sequence's slot in ``initial_state`` [P, HV, K, V];
  the state is read from and written back to that slot in place, and a negative index (a padded
  row) reads a zero state and writes no state.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from fuselm.ops.gated_delta_rule.naive import (decay_gate, gates_from_projections, recurrent_gated_delta_rule_ref,
                                              run_on_state_pool)
from fuselm.runtime import (KERNEL_DTYPES, arch_major, cdiv, check_same_device, check_tensor, needs_autograd,
                            next_power_of_2, num_sms, use_triton)


@triton.jit
def softplus(x):
    """torch's softplus in fp32: x past 20, else log(1 + exp(x)) (the Gated DeltaNet decay gate
    -exp(A_log) softplus(a + dt_bias) in every kernel that computes it)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _gated_delta_step(S, q, k, v, g, beta, scale, L2NORM: tl.constexpr):
    """One token on an fp32 state slice S [K, BV] (q, k [K] and v [BV] in fp32; with L2NORM, q and
    k are l2-normalised here, x * rsqrt(sum(x^2) + 1e-6)):
        S' = e^g S + k u^T,   u = beta (v - e^g S^T k),   o = scale S'^T q = scale (e^g S^T q + (k.q) u).
    Every reduction reads only the loaded q, k and the old S (the norms scale their results), so
    all five run side by side instead of each waiting for the one before; equal to normalising
    first and computing o from S' up to fp32 rounding. Returns (S', o)."""
    decay = tl.exp(g)
    Sk = tl.sum(S * k[:, None], axis=0)
    Sq = tl.sum(S * q[:, None], axis=0)
    kq = tl.sum(k * q)
    if L2NORM:
        rk = tl.rsqrt(tl.sum(k * k) + 1e-6)
        rq = tl.rsqrt(tl.sum(q * q) + 1e-6)
    else:
        rk = 1.0
        rq = 1.0
    u = beta * (v - (decay * rk) * Sk)
    o = scale * ((decay * rq) * Sq + (rk * rq * kq) * u)
    return S * decay + (k * rk)[:, None] * u[None, :], o


@triton.jit
def _fused_recurrent_gdr_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    o_ptr, h0_ptr, ht_ptr, cu_seqlens_ptr, state_indices_ptr,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    RAW_GATES: tl.constexpr, L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    VARLEN: tl.constexpr, INDEXED: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # Launched as a programmatic dependent (Hopper+): this grid may be scheduled while the
        # kernel before it finishes. Wait until that kernel's writes are visible before reading
        # anything, then let the next such kernel be scheduled during this one.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i_v = tl.program_id(0)
    i_n = tl.program_id(1) // HV
    i_hv = tl.program_id(1) % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    kk = tl.arange(0, BLOCK_K)
    vv = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < K
    v_ok = vv < V
    state_offs = i_hv * K * V + kk[:, None] * V + vv[None, :]
    if INDEXED:
        slot = tl.load(state_indices_ptr + i_n).to(tl.int64)
        rows = tl.where(slot >= 0, K, 0)  # a padded row (negative slot) reads and writes no state
    else:
        slot = i_n.to(tl.int64)
        rows = K
    state_mask = (kk < rows)[:, None] & v_ok[None, :]
    S = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if HAS_H0:
        S = tl.load(h0_ptr + slot * HV * K * V + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    if RAW_GATES:
        neg_A = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    for t in range(bos, eos):
        q = tl.load(q_ptr + (t * H + i_h) * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (t * H + i_h) * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (t * HV + i_hv) * V + vv, mask=v_ok, other=0.0).to(tl.float32)
        if RAW_GATES:
            g = neg_A * softplus(tl.load(a_ptr + t * HV + i_hv).to(tl.float32) + dt_bias)
            beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + t * HV + i_hv).to(tl.float32)))
        else:
            g = tl.load(g_ptr + t * HV + i_hv).to(tl.float32)
            beta = tl.load(beta_ptr + t * HV + i_hv).to(tl.float32)
        S, o = _gated_delta_step(S, q, k, v, g, beta, scale, L2NORM)
        tl.store(o_ptr + (t * HV + i_hv) * V + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    if STORE_HT:
        tl.store(ht_ptr + slot * HV * K * V + state_offs, S.to(ht_ptr.dtype.element_ty), mask=state_mask)


# Value columns and warps per program. H100 sweep (benchmarks/gdn.py, HV=32 K=V=128, per call of 20
# in one graph): 1 warp is best or within 1% at every size; 16 columns when 32 would leave fewer
# than two programs per SM (B=1: 3.14 vs 3.40 us), else 32 (B=32: 49.4 vs 49.9 us); 8 is 15% slower.
BLOCK_V = None  # None: decode_block_v decides; benchmarks/gdn.py sets it to sweep
NUM_WARPS = 1  # at least; decode_num_warps adds warps for wider slices (K > 128)
# Programmatic dependent launch on Hopper and newer: the launch of this kernel overlaps the tail of
# the kernel before it in the stream (also inside a CUDA graph). benchmarks/gdn.py times both.
PDL = True


def decode_num_warps(block_k: int, block_v: int) -> int:
    """NUM_WARPS, raised so a thread holds at most 128 fp32 state values (K = 256 at 32 columns
    would otherwise spill)."""
    return max(NUM_WARPS, block_k * block_v // (32 * 128))


def decode_block_v(programs: int, V: int, device: torch.device) -> int:
    """Value columns per program for ``programs`` (sequence, value head) pairs of V columns."""
    if BLOCK_V is not None:
        return min(BLOCK_V, next_power_of_2(V))
    block_v = min(32, next_power_of_2(V))
    if block_v > 16 and device.type == "cuda" and programs * cdiv(V, block_v) < 2 * num_sms(device):
        block_v //= 2
    return block_v


def _check(q, k, v, g, beta, raw, initial_state, cu_seqlens, state_indices):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name}: expected [B, T, heads, dim], got shape {tuple(t.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    B, T, H, _ = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v: leading dims {tuple(v.shape[:2])} do not match q's (B, T) = {(B, T)}")
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"v: {HV} value heads is not a multiple of the {H} q/k heads")
    gate_args = {"a": raw[0], "b": raw[1]} if raw else {"g": g, "beta": beta}
    for name, t in gate_args.items():
        if t is None:
            raise ValueError(f"{name}: required (pass g and beta, or A_log, a, dt_bias and b)")
        check_tensor(name, t)
        if t.shape != (B, T, HV):
            raise ValueError(f"{name}: expected [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")
    if raw:
        for name, t in (("A_log", raw[2]), ("dt_bias", raw[3])):
            check_tensor(name, t)
            if t.shape != (HV,):
                raise ValueError(f"{name}: expected [HV] = ({HV},), got {tuple(t.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: a packed batch must have B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: expected a 1-D int32/int64 tensor [N + 1]")
        capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not bool((cu_seqlens[1:] >= cu_seqlens[:-1]).all() and cu_seqlens[0] == 0
                                      and cu_seqlens[-1] == T):
            raise ValueError(f"cu_seqlens: must start at 0, never decrease and end at T = {T}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        pool_dtypes = STATE_POOL_DTYPES if state_indices is not None else (torch.float32,)
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype not in pool_dtypes:
            raise TypeError("initial_state: expected an fp32 tensor [N, HV, K, V] (fp16 / bf16 are taken to fp32), "
                            "or with state_indices a pool in fp32, bf16 or fp16")
        rows = initial_state.shape[0] if state_indices is not None else N
        if initial_state.shape != (rows, HV, q.shape[3], v.shape[3]) or not initial_state.is_contiguous():
            raise ValueError(f"initial_state: expected a contiguous [{'P' if state_indices is not None else N}, "
                             f"{HV}, {q.shape[3]}, {v.shape[3]}] tensor, got {tuple(initial_state.shape)}")
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices: needs initial_state, the state pool they index")
        if state_indices.shape != (N,) or state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"state_indices: expected int32/int64 [N] = ({N},), got {tuple(state_indices.shape)}")
    a, b, A_log, dt_bias = raw if raw else (None,) * 4
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                      initial_state=initial_state, cu_seqlens=cu_seqlens, state_indices=state_indices)
    return N


# A state pool's dtypes, every kernel dtype: the kernels load a row, compute in fp32 and round the
# final state once into the pool's dtype (16 bits: vLLM's default, the model dtype; fp32: HF's).
STATE_POOL_DTYPES = KERNEL_DTYPES


def check_state_pool_layout(state_indices, initial_state, state_v_first: bool) -> None:
    """A ``state_indices`` pool [P, HV, K, V] is updated in place in its own dtype: ValueError for
    the FLA option that would need a converted copy (``state_v_first``)."""
    if state_indices is not None and state_v_first:
        raise ValueError("state_indices: the pool is updated in place as [P, HV, K, V]; "
                         "state_v_first is not supported with it")


def fla_state_layout(state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """FLA's ``state_v_first``, with its deprecated alias ``transpose_state_layout`` (a warning)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("transpose_state_layout: the deprecated name of state_v_first; pass only state_v_first")
    warnings.warn("transpose_state_layout is deprecated, renamed state_v_first (as in flash-linear-attention)",
                  DeprecationWarning, stacklevel=3)
    return bool(transpose_state_layout)


def fla_input_options(v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, state_v_first, pool=False):
    """flash-linear-attention's input options as PyTorch ops before the kernels (differentiable:
    gradients reach the raw inputs) -> (g, beta, initial_state) as fuselm's kernels take them.
    use_gate_in_kernel: g is the raw gate input, g = -exp(A_log) softplus(g + dt_bias) in fp32
    (A_log [HV] required, dt_bias [HV] optional); use_beta_sigmoid_in_kernel: beta holds logits,
    beta = sigmoid(beta) in fp32, times 2 with allow_neg_eigval; a 16-bit initial state is taken
    to fp32 (as FLA does; not a state ``pool``, updated in place in its dtype), a state_v_first one
    ([N, HV, V, K]) transposed to [N, HV, K, V]."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires use_beta_sigmoid_in_kernel=True (it scales sigmoid(beta) by 2)")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True")
        HV = v.shape[2] if isinstance(v, torch.Tensor) and v.dim() == 4 else None
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (HV,)):
                raise ValueError(f"{name}: expected [HV] = ({HV},), got {tuple(getattr(t, 'shape', ()))}")
        if g is None:
            raise ValueError("g: required with use_gate_in_kernel=True (the raw gate input)")
        g = decay_gate(A_log, g, dt_bias)
    if use_beta_sigmoid_in_kernel:
        if beta is None:
            raise ValueError("beta: required with use_beta_sigmoid_in_kernel=True (the logits)")
        beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if isinstance(initial_state, torch.Tensor):
        if initial_state.dtype in (torch.float16, torch.bfloat16) and not pool:
            initial_state = initial_state.float()
        if state_v_first:
            initial_state = initial_state.transpose(-1, -2).contiguous()
    return g, beta, initial_state


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None, *,
    A_log: torch.Tensor | None = None, a: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    b: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    gk: torch.Tensor | None = None, gv: torch.Tensor | None = None, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
):
    """Gated delta rule, token by token, in one launch (keyword names as flash-linear-attention's).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H.
        g, beta: [B, T, HV] log-decay (<= 0) and write strength; or leave them None and pass the
            raw projections ``A_log`` [HV], ``a`` [B, T, HV], ``dt_bias`` [HV], ``b`` [B, T, HV]
            (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), computed in the kernel).
        scale: on q; default K ** -0.5.
        initial_state: fp32 [N, HV, K, V]; with ``state_indices``, a pool [P, HV, K, V] (fp32, bf16
            or fp16).
        output_final_state: also return the final state (new [N, HV, K, V] tensor).
        use_qk_l2norm_in_kernel: l2-normalise q and k per head first.
        cu_seqlens: [N + 1] offsets of N packed sequences (B = 1); no host sync while a CUDA
            graph is being captured (the offsets are then trusted).
        state_indices: int [N] slot of each sequence in the pool; the pool is updated in place
            and returned as the final state; a negative slot (a padded row) starts from zero and
            writes no state.
        gk, gv, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first:
            flash-linear-attention's options, keyword only (``fla_input_options``; with
            use_gate_in_kernel, g is the raw gate input and A_log / dt_bias make it the log-decay);
            per-key / per-value gates (gk, gv) are not supported. A 16-bit initial state is taken
            to fp32 (not a state_indices pool: updated in place in its dtype, fp32 / bf16 / fp16,
            each sequence's final state rounded once into it). ``transpose_state_layout``:
            the deprecated name of state_v_first.
    Returns:
        (o [B, T, HV, V] in v's dtype, final_state or None).
    """
    state_v_first = fla_state_layout(state_v_first, transpose_state_layout)
    if gk is not None or gv is not None:
        raise NotImplementedError("gk, gv: per-key / per-value decay is not supported; pass g [B, T, HV]")
    if use_gate_in_kernel and (a is not None or b is not None):
        raise ValueError("a, b: not used with use_gate_in_kernel=True (pass g, the raw gate input, and beta)")
    check_state_pool_layout(state_indices, initial_state, state_v_first)
    g, beta, initial_state = fla_input_options(
        v, g, beta, initial_state, use_gate_in_kernel, A_log if use_gate_in_kernel else None,
        dt_bias if use_gate_in_kernel else None, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
        pool=state_indices is not None)
    if use_gate_in_kernel:
        A_log = dt_bias = None
    o, final = _fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                 use_qk_l2norm_in_kernel, cu_seqlens, A_log, a, dt_bias, b,
                                                 state_indices)
    if final is not None and state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final


def _fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens, A_log, a, dt_bias, b, state_indices):
    """``fused_recurrent_gated_delta_rule`` on fuselm's own arguments."""
    raw = None if A_log is None and a is None and dt_bias is None and b is None else (a, b, A_log, dt_bias)
    if raw is not None and (g is not None or beta is not None):
        raise ValueError("g, beta: pass either g and beta, or the raw projections A_log, a, dt_bias, b")
    if raw is not None and any(t is None for t in raw):
        raise ValueError("A_log, a, dt_bias, b: the raw-projection gates need all four")
    N = _check(q, k, v, g, beta, raw, initial_state, cu_seqlens, state_indices)
    inputs = [t for t in (q, k, v, g, beta, *(raw or ())) if t is not None]
    if needs_autograd(*inputs):
        a_, b_, A_log_, dt_bias_ = (None,) * 4 if raw is None else (t.detach() for t in raw)
        o, final = _fused_recurrent_gated_delta_rule(
            *(t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v, g, beta)), scale, initial_state,
            output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, A_log_, a_, dt_bias_, b_, state_indices)
        return _NoBackward.apply(o, *inputs), final
    if not use_triton(q):
        return _reference_path(q, k, v, g, beta, raw, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, state_indices)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    gate_tensors = [t.contiguous() for t in raw] if raw else [g.contiguous(), beta.contiguous()]
    o = torch.empty_like(v)
    if state_indices is not None:
        final = initial_state
    elif output_final_state:
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    else:
        final = None
    if o.numel() == 0 and final is None:
        return o, None
    dummy = q
    a_, b_, A_log_, dt_bias_ = gate_tensors if raw else (dummy,) * 4
    g_, beta_ = (dummy, dummy) if raw else gate_tensors
    block_v = decode_block_v(N * HV, V, q.device)
    pdl = PDL and arch_major(q.device) >= 9
    _fused_recurrent_gdr_kernel[(cdiv(V, block_v), N * HV)](
        q, k, v, g_, beta_, a_, b_, A_log_, dt_bias_,
        o, initial_state if initial_state is not None else dummy, final if final is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy, state_indices if state_indices is not None else dummy,
        float(K**-0.5 if scale is None else scale), T,
        H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v,
        RAW_GATES=raw is not None, L2NORM=use_qk_l2norm_in_kernel, HAS_H0=initial_state is not None,
        STORE_HT=final is not None, VARLEN=cu_seqlens is not None, INDEXED=state_indices is not None,
        PDL=pdl, num_warps=decode_num_warps(next_power_of_2(K), block_v), launch_pdl=pdl,
    )
    return o, (final if (output_final_state or state_indices is not None) else None)


def _reference_path(q, k, v, g, beta, raw, scale, initial_state, output_final_state, l2, cu_seqlens, state_indices):
    """The CPU fallback (no interpreter): the reference, with the pool semantics of the kernel."""
    if raw is not None:
        a, b, A_log, dt_bias = raw
        g, beta = gates_from_projections(A_log, a, dt_bias, b)
    if state_indices is not None:
        return run_on_state_pool(lambda h0: recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale, h0, True, l2,
                                                                           cu_seqlens), initial_state, state_indices)
    o, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state, True, l2, cu_seqlens)
    return o, final if output_final_state else None


class _NoBackward(torch.autograd.Function):
    """Marks the output as part of the graph so that a backward through it fails clearly."""

    @staticmethod
    def forward(ctx, o, *inputs):
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("fused_recurrent_gated_delta_rule has no backward (inference kernel); "
                                  "train with recurrent_gated_delta_rule_ref")
