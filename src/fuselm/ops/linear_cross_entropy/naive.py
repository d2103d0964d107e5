"""Plain-PyTorch references for ``linear_cross_entropy``.

- ``linear_cross_entropy_ref``: the whole op, materialising the [tokens, vocab] logits (tests,
  small shapes). Differentiable through autograd.
- ``chunk_stats_ref`` / ``chunk_grad_ref``: what the two Triton kernels do to one vocab chunk of
  logits (the rows' running max and sum of exp and their targets; the logits' gradient written
  in place); the op's chunk loops call them where Triton cannot run, so the CPU fallback keeps
  the op's memory bound.

Numerics contract (both, and the kernel): logits are ``hidden @ weight.T (+ bias)`` computed by
torch in the input dtype (one GEMM with its own fp32 accumulation, rounded once to the input
dtype); everything after that is in fp32 (float64 for float64 input, where the references are the
exact function): ``loss_r = logsumexp(logits_r) - logits_r[t_r]``, 0 for ``ignore_index`` rows.
``mean`` divides the fp32 sum of the row losses by max(1, number of non-ignored rows): all rows
ignored gives a 0 loss and zero gradients (torch's ``cross_entropy`` gives NaN there).
A label outside [0, V) that is not ``ignore_index`` gives a NaN loss for its row.
"""

from __future__ import annotations

import torch

from fuselm.ops.common.precision import work_dtype

REDUCTIONS = ("mean", "sum", "none")


def _row_losses(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-row loss of [R, V] logits (in the working dtype), NaN for out-of-range labels."""
    n_vocab = logits.shape[-1]
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < n_vocab)
    target = logits.gather(1, torch.where(in_range, labels, 0).unsqueeze(1)).squeeze(1)
    loss = torch.logsumexp(logits, dim=-1) - target
    loss = torch.where(in_range, loss, torch.full_like(loss, float("nan")))
    return torch.where(ignored, torch.zeros_like(loss), loss)


def linear_cross_entropy_ref(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
    ignore_index: int = -100, reduction: str = "mean",
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` under the contract above: fp32 loss
    (float64 for float64 input), 0-dim for "mean"/"sum", ``labels.shape`` for "none"."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    work = work_dtype(hidden)
    h = hidden.reshape(-1, hidden.shape[-1])
    logits = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
    flat_labels = labels.reshape(-1)
    loss = _row_losses(logits.to(work), flat_labels, ignore_index)
    if reduction == "none":
        return loss.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum()
    n_valid = (flat_labels != ignore_index).sum().clamp_min(1)
    return loss.sum() / n_valid.to(work)


@torch.no_grad()
def chunk_stats_ref(logits: torch.Tensor, labels: torch.Tensor, v0: int, row_max: torch.Tensor,
                    row_sum: torch.Tensor, target: torch.Tensor, ignore_index: int) -> None:
    """What ``kernels.chunk_stats_kernel`` does to one vocab chunk ``logits`` [N, C] (ids v0 ..
    v0 + C - 1): merges it into the running ``row_max`` / ``row_sum`` [N] fp32 and writes
    ``target`` for the rows whose label lies in the chunk; ignored rows are left alone."""
    x = logits.to(work_dtype(logits))
    ignored = labels == ignore_index
    chunk_max = torch.where(ignored, float("-inf"), x.amax(dim=1))  # a chunk has >= 1 column
    new_max = torch.maximum(row_max, chunk_max.to(row_max.dtype))
    shift = torch.where(new_max == float("-inf"), 0.0, new_max)
    chunk_sum = torch.where(ignored, 0.0, torch.exp(x - shift.to(x.dtype)[:, None]).sum(dim=1))
    row_sum.copy_(row_sum * torch.exp(row_max - shift) + chunk_sum.to(row_sum.dtype))
    row_max.copy_(new_max)
    col = labels - v0
    here = (col >= 0) & (col < x.shape[1]) & ~ignored
    rows = torch.nonzero(here).squeeze(1)
    target[rows] = x[rows, col[rows]].to(target.dtype)


@torch.no_grad()
def chunk_grad_ref(logits: torch.Tensor, labels: torch.Tensor, v0: int, n_vocab: int, lse: torch.Tensor,
                   row_scale: torch.Tensor | None, ignore_index: int) -> None:
    """What ``kernels.chunk_grad_kernel`` does: overwrites the chunk ``logits`` [N, C] with
    ``round(scale_r * (exp(logits_r - lse_r) - onehot(t_r - v0)))``: 0 on ignored rows, NaN on rows
    with an out-of-range label; scale_r = ``row_scale[r]`` or 1."""
    work = work_dtype(logits)
    x = logits.to(work)
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < n_vocab)
    grad = torch.exp(x - lse.to(work)[:, None])
    col = labels - v0
    rows = torch.nonzero((col >= 0) & (col < x.shape[1]) & ~ignored).squeeze(1)
    grad[rows, col[rows]] -= 1.0
    scale = torch.ones(x.shape[0], dtype=work, device=x.device) if row_scale is None else row_scale.to(work)
    scale = torch.where(in_range, scale, torch.full_like(scale, float("nan")))
    logits.copy_(torch.where(ignored.unsqueeze(1), torch.zeros_like(grad), grad * scale.unsqueeze(1)))
