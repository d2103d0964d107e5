"""``linear_cross_entropy``: the loss of ``cross_entropy(hidden @ weight.T (+ bias), labels)`` and
its gradients without the [tokens, vocab] logits. Checked host functions, autograd, the
``torch.library`` ops and the module.

The vocabulary is taken ``chunk_size`` columns at a time (chunk c: vocab ids v0 .. v1 - 1), every
row at once; two loops over the chunks:

forward (the loss):
    buf = hidden @ weight[v0:v1].T (+ bias[v0:v1])      torch GEMM into an [N, C] workspace
    (M, S), target = stats(buf, labels)                  per row: running max and sum of exp, fp32
    lse = M + log S,  loss = lse - target                saved for the backward: lse [N] fp32
backward (recomputes each chunk's logits):
    buf = hidden @ weight[v0:v1].T (+ bias[v0:v1])
    buf = scale_r (exp(buf - lse) - onehot)              in place (the logits' gradient)
    grad_weight[v0:v1] = buf.T @ hidden                  torch GEMM over all N rows, written once
    grad_bias[v0:v1]   = buf.sum(0)                      fp32 column sums
    grad_hidden_acc   += buf @ weight[v0:v1]             fp32 accumulator [N, H]

So no gradient is accumulated over the vocabulary-sized dimension: each chunk's weight gradient
is one GEMM reducing over every token (cuBLAS accumulates in fp32 inside), and the only
accumulator is [N, H] (hidden's size, fp32). Four GEMMs of N x V x H in all (the logits twice),
where computing the gradients in the forward (Liger-Kernel's FusedLinearCrossEntropy, fuselm
before) takes three but accumulates [V, H] over the token chunks: 12 bytes per weight element per
chunk (the fp32 accumulator read and written, a 16-bit product written and read), which is what
set the step time (H200, Qwen3.5-0.8B at 4 x 4096 tokens: 121 ms of adds over 128 chunks). The
forward holds nothing but lse; the backward holds the workspace, the [N, H] accumulator and its
16-bit product, and writes the gradients.

The kernels are ``kernels.py`` on a Triton device (GPU, or CPU under TRITON_INTERPRET=1), otherwise
``naive.chunk_stats_ref`` / ``naive.chunk_grad_ref`` (same loops, same memory bound).

scale_r is 1 for "mean" / "sum" (the factor grad_output / n_valid is applied after the GEMMs, in
fp32: in fp16, p / n underflows for a 248K vocabulary and 16K tokens) and grad_output[r] for
"none" (applied in the kernel). The backward is not itself differentiable (no double backward); a
second backward through the same graph (``retain_graph=True``) gives the same gradients. Under
``torch.compile`` the same loops run inside the ``fuselm::linear_cross_entropy`` and
``fuselm::linear_cross_entropy_backward`` custom ops; no host check of the labels is made there.

Numerics contract (fp32, fp16, bf16):
- logits: torch's GEMM in the input dtype (fp32 accumulation inside cuBLAS / the CPU BLAS,
  one rounding to the input dtype; fp32 follows torch's matmul precision settings, e.g. TF32).
- per row: max, sum of exp (online over chunks and vocab blocks), logsumexp and loss in fp32;
  the loss is returned in fp32; "mean" is the fp32 sum of row losses / max(1, n_valid).
- d loss / d logits = scale_r (softmax - onehot), rounded once to the input dtype, in place.
- grad_weight: per chunk one torch GEMM over all rows; on CUDA its fp32 result (``out_dtype``)
  times the fp32 factor, rounded once to the input dtype; elsewhere (16-bit) rounded, times the
  factor, rounded again. grad_bias: fp32 column sums times the factor, rounded once.
- grad_hidden: per chunk a torch GEMM added to the fp32 accumulator (fp32 inputs: ``addmm_`` in
  place; 16-bit on CUDA: the GEMM's fp32 result; elsewhere rounded to the input dtype first: the
  chunks' parts largely cancel, so these roundings add up, 1.6e-2 relative in bf16 at Qwen3.5's
  vocabulary, where the CUDA path keeps one rounding); times the factor, rounded once.

``ignore_index`` rows: loss 0, gradient 0, not counted in the mean. All rows ignored (or no
rows): "mean" gives 0 and zero gradients, where ``torch.nn.functional.cross_entropy`` gives NaN.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from fuselm.ops.linear_cross_entropy.kernels import chunk_grad_kernel, chunk_stats_kernel
from fuselm.ops.linear_cross_entropy.naive import REDUCTIONS, chunk_grad_ref, chunk_stats_ref
from fuselm.runtime import (
    as_rows, check_positive_int, check_same_device, check_tensor, needs_autograd, use_triton,
)

# ----------------------------------------------------------------------------- chunking
CHUNK_ALIGN = 256
"""Chunk columns are a multiple of this (a GEMM tile's N), unless one chunk takes the vocabulary."""
MIN_WORKSPACE = 1 << 26
"""Elements the [N, C] workspace may always take (128 MB in 16 bits): fewer, wider chunks."""


def chunk_columns(n_rows: int, n_vocab: int, hidden_size: int, chunk_size: int | None = None) -> int:
    """Vocab columns per chunk: ``chunk_size`` if given (at most ``n_vocab``), else the default rule.

    Default: the [N, C] workspace holds max(N x H, MIN_WORKSPACE) elements (at least hidden's
    size, as Liger-Kernel's rule), C rounded down to a multiple of CHUNK_ALIGN (at least one), at
    most V. Example: Qwen3.5 (V = 248320) at 4 x 4096 tokens: 4096 columns (61 chunks, a 134 MB
    bf16 workspace, where the logits would take 8.1 GB in bf16, 16 GB in fp32) for H = 1024 and
    for H = 4096; the per-chunk [N, H] accumulation then costs ~1/10 of the chunk's GEMMs.
    """
    if chunk_size is not None:
        return max(1, min(chunk_size, n_vocab))
    columns = max(n_rows * hidden_size, MIN_WORKSPACE) // max(1, n_rows)
    return max(1, min(n_vocab, max(CHUNK_ALIGN, columns // CHUNK_ALIGN * CHUNK_ALIGN)))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer the op writes before reading (workspace, gradient parts, grad_weight, grad_bias)
    comes from here: the tests replace it with NaN-filled allocation to show that every element is
    written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _chunk_logits(workspace, hidden2d, weight, bias, v0, v1):
    """hidden2d @ weight[v0:v1].T (+ bias) into the first N x (v1 - v0) elements of ``workspace``
    (a contiguous [N, v1 - v0] view)."""
    buf = workspace.view(-1)[: hidden2d.shape[0] * (v1 - v0)].view(hidden2d.shape[0], v1 - v0)
    if bias is None:
        torch.mm(hidden2d, weight[v0:v1].t(), out=buf)
    else:
        torch.addmm(bias[v0:v1], hidden2d, weight[v0:v1].t(), out=buf)
    return buf


def _forward_loop(hidden2d, weight, bias, labels1d, ignore_index, columns, block_v=None):
    """Row losses [N] fp32 and lse [N] fp32 (the forward of the module docstring)."""
    n_rows, n_vocab = hidden2d.shape[0], weight.shape[0]
    device = hidden2d.device
    row_max = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=device)
    row_sum = torch.zeros((n_rows,), dtype=torch.float32, device=device)
    target = torch.full((n_rows,), float("nan"), dtype=torch.float32, device=device)
    if n_rows:
        workspace = _empty((n_rows, columns), hidden2d.dtype, device)
        triton_ok = use_triton(workspace)
        for v0 in range(0, n_vocab, columns):
            buf = _chunk_logits(workspace, hidden2d, weight, bias, v0, min(v0 + columns, n_vocab))
            if triton_ok:
                chunk_stats_kernel(buf, labels1d, v0, row_max, row_sum, target, ignore_index, block_v)
            else:
                chunk_stats_ref(buf, labels1d, v0, row_max, row_sum, target, ignore_index)
    lse = row_max + torch.log(row_sum)
    loss = torch.where(labels1d == ignore_index, 0.0, lse - target)
    return loss, lse


@functools.cache
def _has_fp32_out_mm(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` takes 16-bit a, b on this device type
    (CUDA, torch >= 2.8): the GEMM's fp32 accumulator comes out unrounded. Probed once."""
    if device_type != "cuda":
        return False
    a = torch.zeros((1, 1), dtype=torch.bfloat16, device=device_type)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _backward_loop(hidden2d, weight, bias, labels1d, lse, ignore_index, columns, row_scale, factor,
                   want_hidden, want_weight, want_bias, block_v=None):
    """(grad_hidden [N, H], grad_weight [V, H], grad_bias [V]) in the input dtypes, None where not
    wanted: the gradients of sum_r row_scale[r] * loss_r (row_scale None: 1), times ``factor``
    (fp32 0-dim, or None: 1). The backward of the module docstring."""
    (n_rows, hidden_size), n_vocab = hidden2d.shape, weight.shape[0]
    device, dtype = hidden2d.device, hidden2d.dtype
    grad_weight = _empty((n_vocab, hidden_size), weight.dtype, device) if want_weight else None
    grad_bias = _empty((n_vocab,), bias.dtype, device) if want_bias else None
    acc = torch.zeros((n_rows, hidden_size), dtype=torch.float32, device=device) if want_hidden else None
    if n_rows == 0:
        if grad_weight is not None:
            grad_weight.zero_()
        if grad_bias is not None:
            grad_bias.zero_()
    else:
        workspace = _empty((n_rows, columns), dtype, device)
        wide = dtype != torch.float32 and _has_fp32_out_mm(device.type)
        rounded_parts = want_hidden and dtype != torch.float32 and not wide
        part = _empty((n_rows, hidden_size), dtype, device) if rounded_parts else None
        triton_ok = use_triton(workspace)
        for v0 in range(0, n_vocab, columns):
            v1 = min(v0 + columns, n_vocab)
            buf = _chunk_logits(workspace, hidden2d, weight, bias, v0, v1)
            if triton_ok:
                chunk_grad_kernel(buf, labels1d, v0, n_vocab, lse, row_scale, ignore_index, block_v)
            else:
                chunk_grad_ref(buf, labels1d, v0, n_vocab, lse, row_scale, ignore_index)
            if want_weight:
                if wide:  # cuBLAS's fp32 result, scaled, rounded once
                    torch.mul(torch.mm(buf.t(), hidden2d, out_dtype=torch.float32), 1.0 if factor is None else factor,
                              out=grad_weight[v0:v1])
                else:
                    torch.mm(buf.t(), hidden2d, out=grad_weight[v0:v1])
                    if factor is not None:
                        grad_weight[v0:v1].mul_(factor)
            if want_bias:
                column_sums = buf.sum(0, dtype=torch.float32)
                grad_bias[v0:v1] = column_sums if factor is None else column_sums * factor
            if want_hidden:
                if dtype == torch.float32:
                    acc.addmm_(buf, weight[v0:v1])
                elif wide:
                    acc.add_(torch.mm(buf, weight[v0:v1], out_dtype=torch.float32))
                else:
                    torch.mm(buf, weight[v0:v1], out=part)
                    acc.add_(part)
    grad_hidden = None
    if want_hidden:
        grad_hidden = (acc if factor is None else acc.mul_(factor)).to(dtype)
    return grad_hidden, grad_weight, grad_bias


def _reduce(loss_rows, labels, ignore_index, reduction):
    if reduction == "none":
        return loss_rows.view(labels.shape)
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    return total / _n_valid(labels, ignore_index)


def _n_valid(labels, ignore_index):
    """max(1, non-ignored labels) as an fp32 0-dim tensor on the labels' device (no host sync)."""
    return (labels != ignore_index).sum().clamp_min(1).to(torch.float32)


def _backward(grad_loss, hidden, weight, bias, labels, lse, ignore_index, reduction, columns, want_h, want_w, want_b,
              block_v=None):
    """The gradients for ``grad_loss`` (0-dim for "mean"/"sum", labels' shape for "none"): hidden's
    shape, the input dtypes; None where not wanted."""
    hidden2d, labels1d = _flat(hidden, labels)
    if reduction == "none":
        row_scale, factor = grad_loss.reshape(-1).to(torch.float32).contiguous(), None
    else:
        row_scale, factor = None, grad_loss.to(torch.float32)
        if reduction == "mean":
            factor = factor / _n_valid(labels1d, ignore_index)
    gh, gw, gb = _backward_loop(hidden2d, weight, bias, labels1d, lse, ignore_index, columns, row_scale, factor,
                                want_h, want_w, want_b and bias is not None, block_v)
    return (None if gh is None else gh.view(hidden.shape)), gw, gb


# ----------------------------------------------------------------------------- argument checks
def _check_inputs(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size) -> None:
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    if bias is not None:
        check_tensor("bias", bias)
    check_tensor("labels", labels, dtypes=(torch.int64,))
    check_same_device(hidden=hidden, weight=weight, bias=bias, labels=labels)
    if hidden.dim() == 0:
        raise ValueError("hidden: must have at least one dimension, [..., H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} is not [V, H] with H = hidden's last dim {hidden.shape[-1]}")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight: needs V >= 1 and H >= 1, got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} does not match hidden {hidden.dtype}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: shape {tuple(bias.shape)} does not match the vocab ({weight.shape[0]},)")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} does not match hidden {hidden.dtype}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels: shape {tuple(labels.shape)} does not match hidden's leading dims {tuple(hidden.shape[:-1])}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index: expected an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing: only 0.0 is supported, got {label_smoothing!r}")
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)


def check_label_values(labels: torch.Tensor, n_vocab: int, ignore_index: int) -> None:
    """ValueError naming ``labels`` when one lies outside [0, n_vocab) and is not ``ignore_index``.
    Reads a flag back to the host: a device sync on CUDA."""
    bad = ((labels < 0) | (labels >= n_vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        first = int(labels[bad].reshape(-1)[0])
        raise ValueError(
            f"labels: {int(bad.sum())} label(s) outside [0, {n_vocab}) that are not ignore_index "
            f"({ignore_index}), e.g. {first}"
        )


def _resolve_check(check_labels, labels) -> bool:
    if torch.compiler.is_compiling():
        return False
    if check_labels is None:
        return labels.device.type == "cpu"
    return bool(check_labels)


def _prepare(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size, check_labels) -> int:
    """Checks; returns the vocab columns per chunk."""
    _check_inputs(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size)
    if _resolve_check(check_labels, labels):
        check_label_values(labels, weight.shape[0], ignore_index)
    return chunk_columns(labels.numel(), weight.shape[0], weight.shape[1], chunk_size)


def _flat(hidden, labels):
    """hidden as [N, H] rows (a view when possible), labels as a contiguous [N]."""
    return as_rows("hidden", hidden), labels.reshape(-1).contiguous()


# ----------------------------------------------------------------------------- checked host function
class LinearCrossEntropyOutput(NamedTuple):
    """The loss and its gradients for grad_output = 1 (for reduction "none": of ``loss.sum()``);
    a gradient not asked for is None."""

    loss: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


def linear_cross_entropy_forward(
    hidden, weight, labels, bias=None, *, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0, chunk_size: int | None = None, check_labels: bool | None = None,
    compute_grads: bool = True, block_v: int | None = None,
) -> LinearCrossEntropyOutput:
    """The loss and (``compute_grads``) its gradients, both loops, without autograd: for a custom
    training step, and for the tests. Gradients in the dtypes of hidden/weight/bias, as the
    contract rounds them. ``block_v`` (a power of two) forces the kernels' vocab block."""
    columns = _prepare(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size,
                       check_labels)
    hidden2d, labels1d = _flat(hidden, labels)
    with torch.no_grad():
        loss_rows, lse = _forward_loop(hidden2d, weight, bias, labels1d, ignore_index, columns, block_v)
        loss = _reduce(loss_rows, labels, ignore_index, reduction)
        if not compute_grads:
            return LinearCrossEntropyOutput(loss, None, None, None)
        ones = torch.ones(loss.shape, dtype=torch.float32, device=hidden.device)
        grads = _backward(ones, hidden, weight, bias, labels, lse, ignore_index, reduction, columns, True, True, True,
                          block_v)
        return LinearCrossEntropyOutput(loss, *grads)


# ----------------------------------------------------------------------------- autograd (eager)
class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, columns):
        ctx.meta = (ignore_index, reduction, columns)
        hidden2d, labels1d = _flat(hidden, labels)
        loss_rows, lse = _forward_loop(hidden2d, weight, bias, labels1d, ignore_index, columns)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        return _reduce(loss_rows, labels, ignore_index, reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        ignore_index, reduction, columns = ctx.meta
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        gh, gw, gb = _backward(grad_loss, hidden, weight, bias, labels, lse, ignore_index, reduction, columns,
                               *ctx.needs_input_grad[:3])
        return gh, gw, gb, None, None, None, None


# ----------------------------------------------------------------------------- torch.library ops (compile)
def _no_grad_tensor(device) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.float32, device=device)


@torch.library.custom_op("fuselm::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    ignore_index: int, reduction: str, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse [N] fp32): the forward loop."""
    hidden2d, labels1d = _flat(hidden, labels)
    loss_rows, lse = _forward_loop(hidden2d, weight, bias, labels1d, ignore_index, chunk_size)
    return _reduce(loss_rows, labels, ignore_index, reduction), lse


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, reduction, chunk_size):
    device = hidden.device
    loss = torch.empty(labels.shape if reduction == "none" else (), dtype=torch.float32, device=device)
    return loss, torch.empty((labels.numel(),), dtype=torch.float32, device=device)


@torch.library.custom_op("fuselm::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    labels: torch.Tensor, lse: torch.Tensor, ignore_index: int, reduction: str, chunk_size: int,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward loop: gradients in the input dtypes (empty [0] when not asked for)."""
    gh, gw, gb = _backward(grad_loss, hidden, weight, bias, labels, lse, ignore_index, reduction, chunk_size,
                           grad_hidden, grad_weight, grad_bias)
    empty = _no_grad_tensor(hidden.device)
    return (empty if gh is None else gh, empty.clone() if gw is None else gw, empty.clone() if gb is None else gb)


@_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, bias, labels, lse, ignore_index, reduction, chunk_size, grad_hidden, grad_weight,
      grad_bias):
    device = hidden.device
    gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if grad_hidden else _no_grad_tensor(device)
    gw = torch.empty(weight.shape, dtype=weight.dtype, device=device) if grad_weight else _no_grad_tensor(device)
    gb = (torch.empty(bias.shape, dtype=bias.dtype, device=device) if grad_bias and bias is not None
          else _no_grad_tensor(device))
    return gh, gw, gb


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, ignore_index, reduction, chunk_size = inputs
    ctx.meta = (ignore_index, reduction, chunk_size)
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])


def _autograd_backward(ctx, grad_loss, _grad_lse):
    ignore_index, reduction, chunk_size = ctx.meta
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    want_h, want_w, want_b = ctx.needs_input_grad[:3]
    gh, gw, gb = _linear_cross_entropy_backward_op(grad_loss, hidden, weight, bias, labels, lse, ignore_index,
                                                   reduction, chunk_size, want_h, want_w, want_b and bias is not None)
    return (gh if want_h else None, gw if want_w else None, gb if want_b and bias is not None else None,
            None, None, None, None)


torch.library.register_autograd(
    "fuselm::linear_cross_entropy", _autograd_backward, setup_context=_setup_context
)


# ----------------------------------------------------------------------------- public API
def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None, *,
    ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
    chunk_size: int | None = None, check_labels: bool | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` and its gradients, vocab chunk by vocab
    chunk: no [tokens, vocab] tensor is ever allocated (numerics contract: this module's docstring).

    Args:
        hidden: [..., H] fp16/bf16/fp32 (any leading shape; flattened to N rows).
        weight: [V, H] (nn.Linear / lm_head layout), hidden's dtype.
        labels: [...] int64, hidden's leading shape.
        bias: optional [V], hidden's dtype.
        ignore_index: rows with this label have loss 0 and gradient 0 and do not count in the mean.
        reduction: "mean" (over non-ignored rows; 0 when there are none, where torch gives NaN),
            "sum", or "none" (per-row losses, labels' shape).
        label_smoothing: only 0.0.
        chunk_size: vocab columns per chunk; None: ``chunk_columns``'s rule (a workspace of at
            least hidden's size).
        check_labels: True: raise ValueError for a label outside [0, V) that is not
            ``ignore_index`` (a host sync on CUDA); False: no check, such a row gets a NaN loss
            (and NaN gradients) on the device; None (default): check on CPU only. Under
            ``torch.compile`` no host check is made.
    Returns:
        The fp32 loss: 0-dim for "mean"/"sum", ``labels.shape`` for "none".
    """
    columns = _prepare(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size,
                       check_labels)
    if torch.compiler.is_compiling():
        return _linear_cross_entropy_op(hidden, weight, bias, labels, ignore_index, reduction, columns)[0]
    if needs_autograd(hidden, weight, *(() if bias is None else (bias,))):
        return _LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, ignore_index, reduction, columns)
    hidden2d, labels1d = _flat(hidden, labels)
    return _reduce(_forward_loop(hidden2d, weight, bias, labels1d, ignore_index, columns)[0], labels, ignore_index,
                   reduction)


class LinearCrossEntropy(nn.Module):
    """The loss module: ``LinearCrossEntropy(...)(hidden, weight, labels, bias=None)`` =
    ``linear_cross_entropy(hidden, weight, labels, bias, ...)``; the weight (e.g. the model's
    ``lm_head.weight``) is passed in, not owned."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None,
                 check_labels: bool | None = None):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        self.ignore_index, self.reduction, self.chunk_size, self.check_labels = (
            ignore_index, reduction, chunk_size, check_labels)

    def forward(self, hidden, weight, labels, bias=None):
        return linear_cross_entropy(hidden, weight, labels, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, chunk_size=self.chunk_size,
                                    check_labels=self.check_labels)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, chunk_size={self.chunk_size}"
