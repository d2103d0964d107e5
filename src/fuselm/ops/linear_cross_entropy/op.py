"""``linear_cross_entropy``: the loss of ``cross_entropy(hidden @ weight.T (+ bias), labels)`` and
its gradients without the [tokens, vocab] logits. Checked host functions, autograd, the
``torch.library`` ops and the module.

Chunk loop (every path): the tokens are taken ``chunk_size`` rows at a time; per chunk

    buf          = hidden[c] @ weight.T (+ bias)        torch GEMM into a [chunk, V] workspace
    buf, loss[c] = kernel(buf, labels[c])                 per-row fp32 logsumexp and loss; the
                                                          logits' gradient written over buf
    grad_hidden[c]  = buf @ weight                        torch GEMM, in the input dtype
    grad_weight_acc += buf.T @ hidden[c]                  fp32 accumulator [V, H]
    grad_bias_acc   += buf.sum(0)                         fp32 accumulator [V]

The kernel is ``kernels.py`` on a Triton device (GPU, or CPU under TRITON_INTERPRET=1), otherwise
``naive.cross_entropy_rows_ref`` (same chunk loop, same memory bound).

When the gradients are computed:
- ``reduction`` "mean" / "sum": in the forward, as Liger-Kernel's FusedLinearCrossEntropy does.
  The kernel writes the *unscaled* gradient (softmax - onehot; the 1/n of the mean is not applied
  there: in fp16, p / n underflows for a 248K vocabulary and 16K tokens), and the backward
  multiplies the saved gradients by ``grad_output * (1 / n_valid or 1)`` (an fp32 factor on the
  device: no host sync). Held from forward to backward: grad_hidden [N, H] in the input dtype and
  the fp32 accumulators for weight [V, H] and bias [V]; during the forward also the workspace and
  (fp16/bf16 weight gradient) one V-slab temporary; no [N, V] tensor at any point.
- ``reduction`` "none": the forward computes only the per-row losses and saves hidden, weight,
  bias and labels; the backward runs the chunk loop again, the kernel scaling row r's gradient by
  ``grad_output[r]`` (4 GEMMs per chunk in all where mean/sum take 3: the logits are computed
  twice). A per-row upstream gradient cannot be applied to the weight gradient after the sum over
  rows, so nothing is precomputed.

A second backward through the same graph (``retain_graph=True``) gives the same gradients; the
backward is not itself differentiable (no double backward). Under ``torch.compile`` the same
chunk loop runs inside the ``fuselm::linear_cross_entropy`` custom op (and, for "none",
``fuselm::linear_cross_entropy_backward``); no host check of the labels is made there.

Numerics contract (fp32, fp16, bf16):
- logits: torch's GEMM in the input dtype (fp32 accumulation inside cuBLAS / the CPU BLAS,
  one rounding to the input dtype; fp32 follows torch's matmul precision settings, e.g. TF32).
- per row: max, sum of exp, logsumexp, loss and softmax in fp32 (online over vocab blocks);
  the loss is returned in fp32; "mean" is the fp32 sum of row losses / max(1, n_valid).
- d loss / d logits = softmax - onehot (times grad_output[r] for "none"), rounded once to the
  input dtype, in place in the workspace.
- grad_hidden: torch GEMM of that and weight, rounded to the input dtype, then (mean/sum) times
  the fp32 factor grad_output / n_valid, rounded again (two roundings).
- grad_weight and grad_bias: accumulated over chunks in fp32. For fp16/bf16 each chunk's
  product buf.T @ hidden[c] is a torch GEMM rounded once to the input dtype (in V-slabs: a
  temporary of about the workspace's size, at least 256 vocab rows) and then added to the fp32
  accumulator; fp32 inputs accumulate in place with ``addmm_``; the bias gradient is buf's column
  sum in fp32. The result is multiplied by the fp32 factor and rounded once to the parameter's
  dtype (for "none" the factor is already in buf: one rounding of the fp32 sum). (fp32 accumulation costs V x H x 4 bytes between forward and
  backward, twice a bf16 weight: 4.1 GB for Qwen3.5-9B's V = 248320, H = 4096.)

``ignore_index`` rows: loss 0, gradient 0, not counted in the mean. All rows ignored (or no
rows): "mean" gives 0 and zero gradients, where ``torch.nn.functional.cross_entropy`` gives NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from fuselm.ops.linear_cross_entropy.kernels import cross_entropy_rows_kernel
from fuselm.ops.linear_cross_entropy.naive import REDUCTIONS, cross_entropy_rows_ref
from fuselm.runtime import (
    as_rows, cdiv, check_positive_int, check_same_device, check_tensor, needs_autograd, use_triton,
)

# ----------------------------------------------------------------------------- chunking
CHUNK_ALIGN = 64
"""Chunk rows are a multiple of this (a GEMM tile's M), unless one chunk takes every row."""
MIN_SLAB = 256
"""Fewest vocab rows per slab of the fp16/bf16 weight-gradient GEMM."""


def chunk_rows(n_rows: int, n_vocab: int, hidden_size: int, chunk_size: int | None = None) -> int:
    """Rows per chunk: ``chunk_size`` if given (at most ``n_rows``), else the default rule.

    Default: n_chunks = ceil(V / H) chunks, each of ceil(N / n_chunks) rows rounded up to a
    multiple of CHUNK_ALIGN (64), at most N. The [chunk, V] workspace then holds about as many
    elements as ``hidden`` itself: chunk * V <= N * H + 64 * V elements (Liger-Kernel's rule,
    without its rounding up to a power of two, which can double the workspace). Example: Qwen3.5-9B
    (V = 248320, H = 4096) at 4 x 4096 tokens: 52 chunks of 320 rows (the last 64), a 159 MB bf16
    workspace where the logits would take 8.1 GB in bf16, 16 GB in fp32.
    """
    if chunk_size is not None:
        return max(1, min(chunk_size, n_rows))
    n_chunks = cdiv(n_vocab, hidden_size)
    rows = cdiv(cdiv(n_rows, n_chunks), CHUNK_ALIGN) * CHUNK_ALIGN
    return max(1, min(rows, n_rows))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer the op writes before reading (workspace, row losses, grad_hidden) comes from
    here: the tests replace it with NaN-filled allocation to show that every element is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _rows(logits, labels, loss, row_scale, ignore_index, write_grad, block_v):
    if use_triton(logits):
        return cross_entropy_rows_kernel(logits, labels, loss, row_scale, ignore_index, write_grad, block_v)
    return cross_entropy_rows_ref(logits, labels, loss, row_scale, ignore_index, write_grad)


def _accumulate_grad_weight(acc, dlogits, h, slab_rows, slab):
    """acc [V, H] fp32 += dlogits.T @ h; fp16/bf16 through ``slab`` [slab_rows, H] (see the contract)."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), h)
        return
    n_vocab = acc.shape[0]
    for v0 in range(0, n_vocab, slab_rows):
        v1 = min(v0 + slab_rows, n_vocab)
        part = slab[: v1 - v0]
        torch.mm(dlogits[:, v0:v1].t(), h, out=part)
        acc[v0:v1].add_(part)


def _chunk_loop(hidden2d, weight, bias, labels1d, ignore_index, chunk_size, row_scale,
                want_hidden, want_weight, want_bias, block_v=None):
    """The chunk loop of the module docstring on flat inputs (hidden2d [N, H], labels1d [N]).

    Returns (row losses [N] fp32, grad_hidden [N, H] input dtype or None, grad_weight [V, H] fp32
    or None, grad_bias [V] fp32 or None): the gradients of sum_r scale_r * loss_r, scale_r =
    ``row_scale[r]`` (fp32 [N]) or 1."""
    n_rows, hidden_size = hidden2d.shape
    n_vocab = weight.shape[0]
    device, dtype = hidden2d.device, hidden2d.dtype
    write_grad = want_hidden or want_weight or want_bias
    loss = _empty((n_rows,), torch.float32, device)
    grad_hidden = _empty((n_rows, hidden_size), dtype, device) if want_hidden else None
    grad_weight = torch.zeros((n_vocab, hidden_size), dtype=torch.float32, device=device) if want_weight else None
    grad_bias = torch.zeros((n_vocab,), dtype=torch.float32, device=device) if want_bias else None
    if n_rows == 0:
        return loss, grad_hidden, grad_weight, grad_bias
    rows = chunk_rows(n_rows, n_vocab, hidden_size, chunk_size)
    workspace = _empty((rows, n_vocab), dtype, device)
    slab_rows, slab = 0, None
    if want_weight and dtype != torch.float32:
        slab_rows = min(n_vocab, max(MIN_SLAB, rows * n_vocab // hidden_size))
        slab = _empty((slab_rows, hidden_size), dtype, device)
    weight_t = weight.t()
    for r0 in range(0, n_rows, rows):
        r1 = min(r0 + rows, n_rows)
        h, buf = hidden2d[r0:r1], workspace[: r1 - r0]
        if bias is None:
            torch.mm(h, weight_t, out=buf)
        else:
            torch.addmm(bias, h, weight_t, out=buf)
        _rows(buf, labels1d[r0:r1], loss[r0:r1], None if row_scale is None else row_scale[r0:r1],
              ignore_index, write_grad, block_v)
        if want_hidden:
            torch.mm(buf, weight, out=grad_hidden[r0:r1])
        if want_weight:
            _accumulate_grad_weight(grad_weight, buf, h, slab_rows, slab)
        if want_bias:
            grad_bias.add_(buf.sum(0, dtype=torch.float32))
    return loss, grad_hidden, grad_weight, grad_bias


def _like(t):
    return None if t is None else (t.shape, t.dtype)


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


def _grad_factor(grad_loss, labels, ignore_index, reduction):
    """grad_output (0-dim) times 1 / max(1, n_valid) for "mean", in fp32."""
    factor = grad_loss.to(torch.float32)
    return factor / _n_valid(labels, ignore_index) if reduction == "mean" else factor


def _scaled(grad, factor, like):
    """round(grad * factor) as a new tensor of ``like`` = (shape, dtype), one rounding (no fp32
    temporary)."""
    if grad is None:
        return None
    out = torch.empty(like[0], dtype=like[1], device=grad.device)
    torch.mul(grad, factor, out=out.view(grad.shape))
    return out


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
    """Checks; returns the rows per chunk."""
    _check_inputs(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size)
    if _resolve_check(check_labels, labels):
        check_label_values(labels, weight.shape[0], ignore_index)
    return chunk_rows(labels.numel(), weight.shape[0], weight.shape[1], chunk_size)


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
    """The loss and (``compute_grads``) its gradients in one chunk loop, without autograd: for a
    custom training step, and for the tests. Gradients in the dtypes of hidden/weight/bias, as
    the contract rounds them. ``block_v`` (a power of two) forces the kernel's vocab block."""
    rows = _prepare(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size, check_labels)
    hidden2d, labels1d = _flat(hidden, labels)
    with torch.no_grad():
        loss_rows, gh, gw, gb = _chunk_loop(hidden2d, weight, bias, labels1d, ignore_index, rows, None,
                                            compute_grads, compute_grads, compute_grads and bias is not None, block_v)
        loss = _reduce(loss_rows, labels, ignore_index, reduction)
        if not compute_grads:
            return LinearCrossEntropyOutput(loss, None, None, None)
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        factor = _grad_factor(one, labels1d, ignore_index, "mean" if reduction == "mean" else "sum")
        grads = (_scaled(g, factor, _like(t)) for g, t in ((gh, hidden), (gw, weight), (gb, bias)))
        return LinearCrossEntropyOutput(loss, *grads)


# ----------------------------------------------------------------------------- autograd (eager)
class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, rows):
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        ctx.meta = (ignore_index, reduction, rows, want)
        ctx.likes = (_like(hidden), _like(weight), _like(bias))
        hidden2d, labels1d = _flat(hidden, labels)
        if reduction == "none":
            loss_rows = _chunk_loop(hidden2d, weight, bias, labels1d, ignore_index, rows, None, False, False, False)[0]
            ctx.save_for_backward(hidden, weight, bias, labels1d)
        else:
            loss_rows, gh, gw, gb = _chunk_loop(hidden2d, weight, bias, labels1d, ignore_index, rows, None, *want)
            # Only the gradients and labels: hidden's data is not needed (it may be freed).
            ctx.save_for_backward(labels1d, gh, gw, gb)
        return _reduce(loss_rows, labels, ignore_index, reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        ignore_index, reduction, rows, want = ctx.meta
        if reduction == "none":
            hidden, weight, bias, labels1d = ctx.saved_tensors
            gh, gw, gb = _backward_none(grad_loss, hidden, weight, bias, labels1d, ignore_index, rows, *want)
        else:
            labels1d, gh, gw, gb = ctx.saved_tensors
            factor = _grad_factor(grad_loss, labels1d, ignore_index, reduction)
            gh, gw, gb = (_scaled(g, factor, like) for g, like in zip((gh, gw, gb), ctx.likes))
        return gh, gw, gb, None, None, None, None


def _backward_none(grad_loss, hidden, weight, bias, labels1d, ignore_index, rows, want_h, want_w, want_b):
    """Gradients for reduction "none": the chunk loop again, row r's gradient scaled by grad_loss[r]."""
    row_scale = grad_loss.reshape(-1).to(torch.float32).contiguous()
    _, gh, gw, gb = _chunk_loop(as_rows("hidden", hidden), weight, bias, labels1d, ignore_index, rows, row_scale,
                                want_h, want_w, want_b)
    return (None if gh is None else gh.view(hidden.shape),
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype))


# ----------------------------------------------------------------------------- torch.library ops (compile)
def _no_grad_tensor(device) -> torch.Tensor:
    return torch.empty((0,), dtype=torch.float32, device=device)


@torch.library.custom_op("fuselm::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    ignore_index: int, reduction: str, chunk_size: int, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight fp32, grad_bias fp32): the gradients as the chunk loop leaves
    them (unscaled; empty [0] when not asked for or reduction is "none")."""
    hidden2d, labels1d = _flat(hidden, labels)
    if reduction == "none":
        grad_hidden = grad_weight = grad_bias = False
    loss_rows, gh, gw, gb = _chunk_loop(hidden2d, weight, bias, labels1d, ignore_index, chunk_size, None,
                                        grad_hidden, grad_weight, grad_bias)
    empty = _no_grad_tensor(hidden.device)
    return (_reduce(loss_rows, labels, ignore_index, reduction),
            empty if gh is None else gh.view(hidden.shape), empty.clone() if gw is None else gw,
            empty.clone() if gb is None else gb)


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, reduction, chunk_size, grad_hidden, grad_weight, grad_bias):
    device = hidden.device
    loss = torch.empty(labels.shape if reduction == "none" else (), dtype=torch.float32, device=device)
    on = reduction != "none"
    gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if on and grad_hidden else _no_grad_tensor(device)
    gw = torch.empty(weight.shape, dtype=torch.float32, device=device) if on and grad_weight else _no_grad_tensor(device)
    gb = (torch.empty((weight.shape[0],), dtype=torch.float32, device=device) if on and grad_bias and bias is not None
          else _no_grad_tensor(device))
    return loss, gh, gw, gb


@torch.library.custom_op("fuselm::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    labels: torch.Tensor, ignore_index: int, chunk_size: int, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of reduction "none" for a per-row ``grad_loss`` (labels' shape), in the input
    dtypes (empty [0] when not asked for)."""
    gh, gw, gb = _backward_none(grad_loss, hidden, weight, bias, labels.reshape(-1).contiguous(), ignore_index,
                                chunk_size, grad_hidden, grad_weight, grad_bias and bias is not None)
    empty = _no_grad_tensor(hidden.device)
    return (empty if gh is None else gh, empty.clone() if gw is None else gw, empty.clone() if gb is None else gb)


@_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, bias, labels, ignore_index, chunk_size, grad_hidden, grad_weight, grad_bias):
    device = hidden.device
    gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if grad_hidden else _no_grad_tensor(device)
    gw = torch.empty(weight.shape, dtype=weight.dtype, device=device) if grad_weight else _no_grad_tensor(device)
    gb = (torch.empty(bias.shape, dtype=bias.dtype, device=device) if grad_bias and bias is not None
          else _no_grad_tensor(device))
    return gh, gw, gb


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, ignore_index, reduction, chunk_size, want_h, want_w, want_b = inputs
    ctx.meta = (ignore_index, reduction, chunk_size, (want_h, want_w, want_b and bias is not None))
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, labels)
    else:  # the gradients and labels only (hidden's data is not needed)
        ctx.save_for_backward(labels, *output[1:])


def _autograd_backward(ctx, grad_loss, *_unused):
    ignore_index, reduction, chunk_size, (want_h, want_w, want_b) = ctx.meta
    if reduction == "none":
        hidden, weight, bias, labels = ctx.saved_tensors
        gh, gw, gb = _linear_cross_entropy_backward_op(grad_loss, hidden, weight, bias, labels, ignore_index,
                                                       chunk_size, want_h, want_w, want_b)
    else:
        labels, gh, gw, gb = ctx.saved_tensors
        factor = _grad_factor(grad_loss, labels, ignore_index, reduction)
        dtype_h, dtype_w, dtype_b = ctx.dtypes
        gh = (gh * factor).to(dtype_h) if want_h else None
        gw = (gw * factor).to(dtype_w) if want_w else None
        gb = (gb * factor).to(dtype_b) if want_b else None
    return (gh if want_h else None, gw if want_w else None, gb if want_b else None,
            None, None, None, None, None, None, None)


torch.library.register_autograd(
    "fuselm::linear_cross_entropy", _autograd_backward, setup_context=_setup_context
)


# ----------------------------------------------------------------------------- public API
def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None, *,
    ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
    chunk_size: int | None = None, check_labels: bool | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` and its gradients, chunk by chunk: no
    [tokens, vocab] tensor is ever allocated (numerics contract: this module's docstring).

    Args:
        hidden: [..., H] fp16/bf16/fp32 (any leading shape; flattened to N rows).
        weight: [V, H] (nn.Linear / lm_head layout), hidden's dtype.
        labels: [...] int64, hidden's leading shape.
        bias: optional [V], hidden's dtype.
        ignore_index: rows with this label have loss 0 and gradient 0 and do not count in the mean.
        reduction: "mean" (over non-ignored rows; 0 when there are none, where torch gives NaN),
            "sum", or "none" (per-row losses, labels' shape; its backward recomputes the logits).
        label_smoothing: only 0.0.
        chunk_size: rows per chunk; None: ``chunk_rows``'s rule (workspace about hidden's size).
        check_labels: True: raise ValueError for a label outside [0, V) that is not
            ``ignore_index`` (a host sync on CUDA); False: no check, such a row gets a NaN loss
            (and NaN gradients) on the device; None (default): check on CPU only. Under
            ``torch.compile`` no host check is made.
    Returns:
        The fp32 loss: 0-dim for "mean"/"sum", ``labels.shape`` for "none".
    """
    rows = _prepare(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size, check_labels)
    if torch.compiler.is_compiling():
        grad_on = torch.is_grad_enabled()
        return _linear_cross_entropy_op(
            hidden, weight, bias, labels, ignore_index, reduction, rows, grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad, grad_on and bias is not None and bias.requires_grad,
        )[0]
    if needs_autograd(hidden, weight, *(() if bias is None else (bias,))):
        return _LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, ignore_index, reduction, rows)
    hidden2d, labels1d = _flat(hidden, labels)
    loss_rows = _chunk_loop(hidden2d, weight, bias, labels1d, ignore_index, rows, None, False, False, False)[0]
    return _reduce(loss_rows, labels, ignore_index, reduction)


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
