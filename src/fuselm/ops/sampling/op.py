"""``sample_tokens``: the decode step's per-row sampler, every parameter a device tensor.

One CUDA graph serves requests with any mix of settings: temperature, top-k, top-p, seed and
position are [B] tensors read on the device; nothing syncs with the host and every shape is
static. A request's draw depends only on its (seed, position) and its logits, never on the row it
sits in or on the other rows of the batch.

Paths:
- Triton device (CUDA, or CPU under the interpreter): with ``filtered``, ``cutoffs.cutoffs``
  gives each row its cut-off (the values of ``naive.keep_thresholds``, the sort-based
  definition, without a sort for 16-bit logits: from a count of the row's tokens per logit
  value); then the noisy-argmax kernel(s) of ``kernels.py`` read the logits once. H100, bf16
  [B, 248320], CUDA graph replay (benchmarks/sampling.py): unfiltered 9.8 / 15 / 34 µs at
  B = 1 / 8 / 32 (the previous sampler: 98 / 116 / 246 µs; greedy 8.7 / 10 / 16 µs against
  argmax's 13 / 15 / 26). H200 (session 43): T 0.7 / top-p 0.9 36 / 68 / 217 µs (the previous
  sampler's sort 278 / 780 / 1,511), the cut-offs alone 29 / 62 / 182 at any top-k / top-p
  (benchmarks/NOTES.md 98); fp32 logits take the sort (on bf16 logits it took
  0.15 / 0.31 / 0.90 ms).
- CPU without the interpreter: the float64 reference ``sample_tokens_ref``.
Eager calls run the path directly; under ``torch.compile`` the call goes through the
``fuselm::sample_tokens`` custom op (traced with its fake implementation). Inference only.

``advance_slots``: after a draw, each slot's counters, stop test and next input in one launch
(integer arithmetic only; the reference is ``naive.advance_slots_ref``).
"""

from __future__ import annotations

from typing import Optional

import torch

from fuselm.ops.sampling.kernels import advance_slots_kernel, sample_tokens_kernel
from fuselm.ops.sampling.cutoffs import cutoffs
from fuselm.ops.sampling.naive import advance_slots_ref, sample_tokens_ref
from fuselm.runtime import cdiv, check_same_device, check_tensor, next_power_of_2, use_triton

# (name, dtype) of the per-row parameters, in argument order.
_ROW_PARAMETERS = (("temperature", torch.float32), ("top_k", torch.int32), ("top_p", torch.float32),
                   ("seeds", torch.int64), ("positions", torch.int64), ("min_p", torch.float32))


def _check(logits, temperature, top_k, top_p, seeds, positions, filtered, out, min_p=None) -> None:
    """Metadata checks only (shapes, dtypes, devices, layout): nothing reads device memory."""
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [B, V], got shape {tuple(logits.shape)}")
    n_rows, n_vocab = logits.shape
    if n_vocab == 0:
        raise ValueError("logits: the vocabulary dim V is 0")
    if logits.stride(1) != 1 and n_vocab > 1:
        raise ValueError(f"logits: the last dim must be contiguous (stride 1), got strides {tuple(logits.stride())}")
    params = (temperature, top_k, top_p, seeds, positions, min_p)
    for (name, dtype), t in zip(_ROW_PARAMETERS, params):
        if t is None and name == "min_p":
            continue
        check_tensor(name, t, (dtype,))
        if tuple(t.shape) != (n_rows,):
            raise ValueError(f"{name}: expected shape ({n_rows},) = (B,), got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    if not isinstance(filtered, bool):
        raise TypeError(f"filtered: expected a bool, got {type(filtered).__name__}")
    if out is not None:
        check_tensor("out", out, (torch.int64,))
        if tuple(out.shape) != (n_rows,):
            raise ValueError(f"out: expected shape ({n_rows},) = (B,), got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out: must be contiguous")
    check_same_device(logits=logits, **{name: t for (name, _), t in zip(_ROW_PARAMETERS, params)}, out=out)


def _sample(logits, temperature, top_k, top_p, seeds, positions, filtered: bool, out, min_p=None,
            max_top_k=None) -> torch.Tensor:
    if out.numel() == 0:
        return out
    if not use_triton(logits):
        return out.copy_(sample_tokens_ref(logits, temperature, top_k, top_p, seeds, positions, filtered=filtered,
                                           min_p=min_p))
    thresholds = cutoffs(logits, temperature, top_k, top_p, min_p, max_top_k) if filtered else None
    return sample_tokens_kernel(logits, temperature, thresholds, seeds, positions, out)


@torch.library.custom_op("fuselm::sample_tokens", mutates_args=())
def _sample_tokens_op(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      seeds: torch.Tensor, positions: torch.Tensor, filtered: bool,
                      min_p: Optional[torch.Tensor] = None, max_top_k: Optional[int] = None) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    return _sample(logits, temperature, top_k, top_p, seeds, positions, filtered, out, min_p, max_top_k)


@_sample_tokens_op.register_fake
def _(logits, temperature, top_k, top_p, seeds, positions, filtered, min_p=None, max_top_k=None):
    return torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, positions: torch.Tensor, *, filtered: bool = True,
                  min_p: torch.Tensor | None = None, max_top_k: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row, greedy or sampled per row; CUDA-graph capturable.

    Args:
        logits: [B, V] fp32/fp16/bf16; the last dim contiguous, the row stride free (e.g. a view
            of the first B rows of a larger buffer, or of a wider padded vocabulary).
        temperature: [B] fp32; 0 = greedy (argmax) for that row, else > 0.
        top_k: [B] int32; keep the k most likely tokens (ties with the k-th kept); k <= 0 or
            k >= V is off.
        top_p: [B] fp32 in (0, 1]; keep the smallest most-likely set whose probability reaches
            top_p; 1 is off.
        seeds: [B] int64, each request's seed (any int64).
        positions: [B] int64, the index of the token being drawn within its request (e.g. the
            number of tokens generated so far). A request's random stream is a function of
            (seed, position, token index) only.
        filtered: a static promise, made on the host: False when no row uses top-k, top-p or
            min-p (their values are then ignored and the cut-off computation skipped). A CUDA
            graph is captured for one value.
        min_p: optional [B] fp32 in [0, 1]; keep the tokens at least min_p times as likely as the
            most likely one (0 or None is off; applied with ``filtered`` only).
        max_top_k: a static promise, made on the host, that every row with top_p < 1 has
            1 <= top_k <= max_top_k: the cut-offs of logits that are not 16-bit then come from the
            max_top_k largest logits rather than a sort of each row (``cutoffs``).
        out: optional contiguous [B] int64 buffer, fully overwritten (e.g. a graph's static output).
    Returns:
        ids: [B] int64 (``out`` when given).

    Semantics per row (HF transformers' order), with x the logits in fp32 (exact):
    - T = 0: the first index of max x. top-k / top-p do not apply.
    - T > 0: top-k, then top-p over the softmax of x / T of the top-k-kept tokens, then min-p,
      as a cut-off on x (``keep_thresholds``: top-p keeps every token tied with the last kept
      one; min-p keeps x_i >= max x + T log(min_p)); then a draw
      from softmax(x / T) over the kept tokens by the Gumbel-max trick: the first index of
      max x_i / T + g_i, with g_i the Gumbel noise of the counter-based RNG written out in
      ``fuselm/ops/sampling/naive.py``: 64 bits of stream key from (seed, position) through the
      lowbias32 hash, 32 random bits per token i, v in [2^-33, 1 - 2^-24] in fp32,
      g = -log(-log1p(-v)).

    Numerics: the kernel computes x_i + T g_i in fp32 (the same argmax), the cut-off masses in
    float64; the reference ``sample_tokens_ref`` all in float64, so the two agree on every id
    unless a row's two largest noisy values are within fp32 rounding of each other. NaN logits
    are unspecified.

    Not checked (that would read device memory, a host sync): temperature >= 0 and finite, top_p
    in (0, 1], top_k >= 0. The engine validates them on the host (``SamplingParams``). Out of
    range they are still safe: top_p <= 0 keeps the argmax, top_k < 0 is off.
    """
    _check(logits, temperature, top_k, top_p, seeds, positions, filtered, out, min_p)
    if max_top_k is not None and (not isinstance(max_top_k, int) or isinstance(max_top_k, bool) or max_top_k < 1):
        raise ValueError(f"max_top_k: expected None or an int >= 1, got {max_top_k!r}")
    if torch.compiler.is_compiling():
        ids = _sample_tokens_op(logits, temperature, top_k, top_p, seeds, positions, filtered, min_p, max_top_k)
        return ids if out is None else out.copy_(ids)
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    return _sample(logits, temperature, top_k, top_p, seeds, positions, filtered, out, min_p, max_top_k)


ADVANCE_ROWS = 64  # rows a program of advance_slots


def advance_slots(ids: torch.Tensor, active: torch.Tensor, positions: torch.Tensor, remaining: torch.Tensor,
                  stop_ids: torch.Tensor, slots: torch.Tensor | None = None,
                  next_inputs: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> None:
    """After a draw, the per-slot counters in place, in one launch (``advance_slots_ref``'s
    contract): row i's slot (``slots[i]``, distinct; default i) counts the draw if it was active
    (``positions`` += 1, ``remaining`` -= 1, and ``counts[slot, ids[i]]`` += 1 when given: the
    generated-token counts ``apply_penalties`` reads) and goes inactive on one of its ``stop_ids``
    or its last allowed token; ``next_inputs[slot] = ids[i]`` when given (the next decode step's
    input).

    Args: ids [n] int64; active [S] bool; positions, remaining [S] int64; stop_ids [S, M] int64
    (-1 pads); slots [n] int64 or None (then n <= S, the first n slots); next_inputs [S] int64;
    counts [S, V] int32 (an id outside [0, V) is not counted).
    No host sync, static shapes (inside the decode step's CUDA graph)."""
    check_tensor("ids", ids, (torch.int64,))
    check_tensor("active", active, (torch.bool,))
    for name, t in (("positions", positions), ("remaining", remaining), ("stop_ids", stop_ids)):
        check_tensor(name, t, (torch.int64,))
    S = active.shape[0] if active.dim() == 1 else -1
    if ids.dim() != 1 or active.dim() != 1 or (slots is None and ids.shape[0] > S):
        raise ValueError(f"ids: expected [n] with n <= active's length, got {tuple(ids.shape)} and active "
                         f"{tuple(active.shape)}")
    for name, t in (("active", active), ("positions", positions), ("remaining", remaining), ("ids", ids)):
        if not t.is_contiguous() or (name != "ids" and t.shape != (S,)):
            raise ValueError(f"{name}: expected a contiguous [{S}] tensor, got {tuple(t.shape)}")
    if stop_ids.dim() != 2 or stop_ids.shape[0] != S or not stop_ids.is_contiguous():
        raise ValueError(f"stop_ids: expected a contiguous [{S}, stops], got {tuple(stop_ids.shape)}")
    if slots is not None:
        check_tensor("slots", slots, (torch.int64,))
        if slots.shape != ids.shape or not slots.is_contiguous():
            raise ValueError(f"slots: expected a contiguous {tuple(ids.shape)} like ids, got {tuple(slots.shape)}")
    if next_inputs is not None:
        check_tensor("next_inputs", next_inputs, (torch.int64,))
        if next_inputs.shape != (S,) or not next_inputs.is_contiguous():
            raise ValueError(f"next_inputs: expected a contiguous [{S}] tensor, got {tuple(next_inputs.shape)}")
    if counts is not None:
        check_tensor("counts", counts, (torch.int32,))
        if counts.dim() != 2 or counts.shape[0] != S or not counts.is_contiguous():
            raise ValueError(f"counts: expected a contiguous [{S}, V] int32 tensor, got {tuple(counts.shape)}")
    check_same_device(ids=ids, active=active, positions=positions, remaining=remaining, stop_ids=stop_ids,
                      slots=slots, next_inputs=next_inputs, counts=counts)
    if not use_triton(ids):
        return advance_slots_ref(ids, active, positions, remaining, stop_ids, slots, next_inputs, counts)
    n = ids.shape[0]
    if n:
        advance_slots_kernel[(cdiv(n, ADVANCE_ROWS),)](
            ids, ids if slots is None else slots, active, positions, remaining, stop_ids,
            ids if next_inputs is None else next_inputs, ids if counts is None else counts, n,
            0 if counts is None else counts.shape[1], STOPS=stop_ids.shape[1],
            BLOCK_STOPS=max(2, next_power_of_2(stop_ids.shape[1])), BLOCK_ROWS=ADVANCE_ROWS,
            HAS_SLOTS=slots is not None, HAS_NEXT=next_inputs is not None, HAS_COUNTS=counts is not None)
