"""``decode_linear``: a decode-time linear layer (<= 32 tokens) with a fused elementwise prologue.

    y = prologue(x) @ weight.T        x, gate [..., K]; weight [N, K]; y [..., N] in x's dtype

Paths (M = prod(x.shape[:-1]) rows), on a Triton device:
- M = 1: one launch of ``_decode_linear_vector_kernel`` (CUDA cores, no token padding), the
  prologue applied to x in registers.
- 2 <= M <= 32 (``DECODE_MAX_M``), M <= FUSED_PROLOGUE_MAX_M[prologue] or no prologue: one launch
  of ``_decode_linear_kernel``, which streams the weight once through a tensor-core tile and
  applies the prologue to the input tile in registers.
- More rows with a prologue: the prologue on its own first (``_prologue_kernel``, one launch and
  one temporary [M, K]; PyTorch's ``naive.py`` for a head_dim the kernel cannot tile: not a power
  of two, or not dividing an overriding ``config``'s BLOCK_K), then the plain kernel.
- M > 32: this is a decode-only op; the prologue as above, then ``torch.mm`` (cuBLAS).
- CPU without the Triton interpreter: the reference ``decode_linear_ref``.
``linear_prologue`` is the prologue alone (into ``out`` or in place), for callers that gate rows
where they are made and then run the projection plain (a mixed step's two halves).

On Hopper the one-row kernel is a programmatic dependent launch (``fuselm.runtime.use_pdl``): it
reads ``weight`` (and ``norm_weight``) before it waits for the kernel ahead of it, so a weight must
not be written by the kernel right before the call (inference weights are not; FUSELM_PDL=0 turns it
off). x and gate are read after the wait, and after it the kernel lets the next one begin (the Gated
DeltaNet step, the norm: programmatic dependents that load their weights and state early).

Numerics (all paths): the prologue's roundings of ``naive.py``, an fp32 accumulator, one
rounding of y to x's dtype (the cuBLAS path follows torch's matmul settings, e.g. TF32).

CUDA-graph safe: only metadata checks, no host sync, and with ``out`` given the kernel path
allocates nothing but the prologue's temporary past FUSED_PROLOGUE_MAX_M rows (inputs whose rows cannot be viewed with a unit column stride are copied, as
``fuselm.runtime.as_rows`` does). Inference only: no autograd.
"""

from __future__ import annotations

import math

import torch

from fuselm.ops.common.matmul import DECODE_MAX_M
from fuselm.ops.decode_linear.kernels import (
    FUSED_PROLOGUE_MAX_M, PROLOGUE_CODES, DecodeLinearConfig, DecodeVectorConfig, check_config, decode_linear_config,
    decode_linear_kernel, decode_linear_vector_kernel, decode_vector_config, fused_prologue_ok, prologue_kernel,
    prologue_kernel_ok,
)
from fuselm.ops.decode_linear.naive import decode_linear_ref, prologue_ref
from fuselm.runtime import (
    KERNEL_DTYPES, arch_major, as_rows, check_finite_float, check_match, check_positive_int, check_same_device,
    check_tensor,
    needs_autograd, use_triton,
)


def _check_x(x) -> None:
    """x: a tensor [..., K] with a unit last stride."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: must have at least one dimension, [..., K]")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"x: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")


def _refuse_autograd(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and needs_autograd(t):
            raise ValueError(f"{name}: requires grad, but {op} is inference-only (no autograd); "
                             "call it under torch.no_grad()")


def _prologue_rows(x2, prologue, gate2, norm_weight, eps, head_dim, out=None) -> torch.Tensor:
    """prologue(x2) for rows x2 and gate2 [M, K] (unit column stride), into ``out`` [M, K] when
    given: one launch of the prologue kernel, PyTorch's ``naive.py`` for heads it cannot tile."""
    if prologue_kernel_ok(prologue, head_dim):
        return prologue_kernel(x2, prologue, gate2, norm_weight, eps, head_dim, out=out)
    a = prologue_ref(x2, prologue, gate2, norm_weight, eps, head_dim)
    return a if out is None else out.copy_(a)


def _check_prologue(x, prologue, gate, norm_weight, eps, head_dim) -> float:
    """The prologue's argument checks (metadata only); returns eps (0 unless gated_rms_norm)."""
    if prologue not in PROLOGUE_CODES:
        raise ValueError(f"prologue: expected None, 'sigmoid_gate' or 'gated_rms_norm', got {prologue!r}")

    if prologue is None:
        if gate is not None:
            raise ValueError("gate: only used with a prologue ('sigmoid_gate' or 'gated_rms_norm'); prologue is None")
    else:
        if gate is None:
            raise ValueError(f"gate: required with prologue={prologue!r}")
        check_tensor("gate", gate)
        if gate.dim() == x.dim() + 1 and gate.shape[:-2] == x.shape[:-1]:  # heads of columns, strided
            if gate.shape[-2] * gate.shape[-1] != x.shape[-1] or gate.dtype != x.dtype or gate.device != x.device:
                raise ValueError(f"gate: as [..., heads, head] it must hold x's K = {x.shape[-1]} columns in x's "
                                 f"dtype and device, got {tuple(gate.shape)} {gate.dtype} on {gate.device}")
        else:
            check_match("gate", gate, "x", x)
        if gate.stride(-1) != 1 and gate.shape[-1] > 1:
            raise ValueError(f"gate: the last dim must be contiguous (stride 1), got strides {tuple(gate.stride())}")

    if prologue == "gated_rms_norm":
        if norm_weight is None:
            raise ValueError("norm_weight: required with prologue='gated_rms_norm'")
        if head_dim is None:
            raise ValueError("head_dim: required with prologue='gated_rms_norm'")
        check_positive_int("head_dim", head_dim)
        if x.shape[-1] % head_dim:
            raise ValueError(f"head_dim: {head_dim} does not divide x's last dim K = {x.shape[-1]}")
        check_tensor("norm_weight", norm_weight)
        if norm_weight.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"norm_weight: dtype {norm_weight.dtype} must be x's ({x.dtype}) or float32")
        if norm_weight.shape != (head_dim,):
            raise ValueError(f"norm_weight: expected shape ({head_dim},) = (head_dim,), got {tuple(norm_weight.shape)}")
        if norm_weight.stride(0) != 1 and head_dim > 1:
            raise ValueError("norm_weight: must be contiguous")
        eps = check_finite_float("eps", eps, nonnegative=True)
    else:
        if norm_weight is not None:
            raise ValueError(f"norm_weight: only used with prologue='gated_rms_norm', got prologue={prologue!r}")
        if head_dim is not None:
            raise ValueError(f"head_dim: only used with prologue='gated_rms_norm', got prologue={prologue!r}")
        eps = 0.0
    return eps


def _check(x, weight, prologue, gate, norm_weight, eps, head_dim, out, config):
    """All argument checks (metadata only); returns (eps, out shape)."""
    _check_x(x)
    check_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K] (nn.Linear layout), got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight: in-features {weight.shape[1]} do not match x's last dim {x.shape[-1]}")
    if weight.stride(-1) != 1 and weight.shape[1] > 1:
        raise ValueError("weight: rows must be contiguous (last-dim stride 1); pass weight.contiguous() once at load")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} does not match x {x.dtype}")
    eps = _check_prologue(x, prologue, gate, norm_weight, eps, head_dim)

    out_shape = (*x.shape[:-1], weight.shape[0])
    if out is not None:
        check_tensor("out", out, KERNEL_DTYPES)
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out: shape {tuple(out.shape)} does not match the output {out_shape} = (*x.shape[:-1], N)")
        if out.dtype != x.dtype:
            raise TypeError(f"out: dtype {out.dtype} does not match x {x.dtype}")
        if not out.is_contiguous():
            raise ValueError("out: must be contiguous")
    check_same_device(x=x, weight=weight, gate=gate, norm_weight=norm_weight, out=out)
    _refuse_autograd("decode_linear", x=x, weight=weight, gate=gate, norm_weight=norm_weight)
    if config is not None:
        check_config(config)
        rows = math.prod(out_shape[:-1])
        if isinstance(config, DecodeVectorConfig) and rows != 1:
            raise ValueError(f"config: a DecodeVectorConfig is for one token, got {rows} rows of x")
    return eps, out_shape


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    prologue: str | None = None,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    head_dim: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeLinearConfig | None = None,
) -> torch.Tensor:
    """``prologue(x) @ weight.T`` for decode: the weight is streamed once, the prologue fused.

    Args:
        x: [..., K] fp16/bf16/fp32, at most 32 rows in all for the weight-streaming kernel (more
            run the prologue, then cuBLAS). Rows may be strided (e.g. a ``proj.split`` view);
            the last dim must be contiguous.
        weight: [N, K] (nn.Linear layout) in x's dtype, rows contiguous.
        prologue: None (y = x @ weight.T); ``"sigmoid_gate"``: a = x * sigmoid(gate) (Qwen3.5
            gated attention before o_proj); ``"gated_rms_norm"``: HF ``Qwen3_5RMSNormGated`` per
            head of ``head_dim`` columns with z = gate (Gated DeltaNet before out_proj). The
            roundings are PyTorch eager's: see ``fuselm/ops/decode_linear/naive.py``.
        gate: [..., K] like x (its own row stride), required iff a prologue is set; or
            [..., heads, head] with heads x head = K, the heads strided (e.g. Qwen3.5 attention's
            gate, interleaved with the query in the projection: read in place at one row, copied
            into rows for the other paths).
        norm_weight: [head_dim], x's dtype or fp32 (gated_rms_norm only).
        eps: the RMSNorm epsilon (gated_rms_norm only).
        head_dim: columns per head, dividing K (gated_rms_norm only; fused for powers of two).
        out: optional contiguous [..., N] buffer in x's dtype, fully overwritten (must not
            overlap the inputs); with it the kernel path allocates nothing.
        config: a :class:`DecodeLinearConfig` overriding ``decode_linear_config`` (the tile
            kernel, also at one row), or for one row a :class:`DecodeVectorConfig` overriding
            ``decode_vector_config`` (tuning).
    Returns:
        y: [..., N] in x's dtype (``out`` when given).
    """
    eps, out_shape = _check(x, weight, prologue, gate, norm_weight, eps, head_dim, out, config)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    N, K = weight.shape
    M = math.prod(x.shape[:-1])
    out2 = out.view(M, N)

    if not use_triton(x):
        if gate is not None and gate.dim() == x.dim() + 1:
            gate = gate.flatten(-2)
        return out.copy_(decode_linear_ref(x, weight, prologue, gate, norm_weight, eps, head_dim))
    x2 = as_rows("x", x)
    arch = arch_major(x.device)
    vector = M == 1 and not isinstance(config, DecodeLinearConfig)
    gate2 = None
    if gate is not None and gate.dim() == x.dim() + 1:  # heads of columns: in place at one row
        gate2 = gate.reshape(1, *gate.shape[-2:]) if vector else as_rows("gate", gate.flatten(-2))
    elif gate is not None:
        gate2 = as_rows("gate", gate)
    if vector:
        cfg = config or decode_vector_config(arch, x.dtype, prologue, head_dim)
        fuse = fused_prologue_ok(prologue, head_dim, cfg)
    else:
        cfg = config or decode_linear_config(arch, x.dtype, prologue, head_dim)
        fuse = prologue is None or (M <= FUSED_PROLOGUE_MAX_M[prologue] and fused_prologue_ok(prologue, head_dim, cfg))
    if not fuse:
        # The prologue on its own first (one launch; PyTorch for heads the kernel cannot tile),
        # then the plain product: a fused GEMV's every program would recompute it over all rows.
        if gate2.dim() == 3:
            gate2 = as_rows("gate", gate2.flatten(-2))
        x2 = _prologue_rows(x2, prologue, gate2, norm_weight, eps, head_dim)
        prologue, gate2, norm_weight, head_dim = None, None, None, None
        if config is None and not vector:
            cfg = decode_linear_config(arch, x.dtype)
    if vector:
        decode_linear_vector_kernel(x2, weight, out2, prologue, gate2, norm_weight, eps, head_dim, config=cfg)
    elif M > DECODE_MAX_M:
        torch.mm(x2, weight.T, out=out2)
    else:
        decode_linear_kernel(x2, weight, out2, prologue, gate2, norm_weight, eps, head_dim, config=cfg)
    return out


def linear_prologue(
    x: torch.Tensor,
    prologue: str,
    gate: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    head_dim: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``prologue(x)`` alone: the input ``decode_linear`` multiplies with its weight (arguments as
    there), for a caller that gates its rows where they are made and runs the projection plain
    (a mixed step gates each half's heads before the halves join). ``out``: a contiguous tensor of
    x's shape and dtype, x itself allowed (in place). One launch on a Triton device (PyTorch's
    ``naive.py`` for a head_dim the kernel cannot tile; a gate in strided heads is first copied
    into rows); the roundings of ``naive.py``. Metadata checks only, no host sync; inference only."""
    _check_x(x)
    if prologue not in ("sigmoid_gate", "gated_rms_norm"):
        raise ValueError(f"prologue: expected 'sigmoid_gate' or 'gated_rms_norm', got {prologue!r}")
    eps = _check_prologue(x, prologue, gate, norm_weight, eps, head_dim)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {x.dtype} tensor of x's shape {tuple(x.shape)}, got "
                         f"{tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}")
    check_same_device(x=x, gate=gate, norm_weight=norm_weight, out=out)
    _refuse_autograd("linear_prologue", x=x, gate=gate, norm_weight=norm_weight)
    if out.numel() == 0:
        return out
    if gate.dim() == x.dim() + 1:  # heads of columns, strided: into rows
        gate = gate.flatten(-2)
    if not use_triton(x):
        return out.copy_(prologue_ref(x, prologue, gate, norm_weight, eps, head_dim))
    _prologue_rows(as_rows("x", x), prologue, as_rows("gate", gate), norm_weight, eps, head_dim,
                   out=out.view(-1, x.shape[-1]))
    return out
