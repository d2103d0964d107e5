"""``sample_tokens`` against the engine's previous sampler at Qwen3.5's vocabulary (GPU only).

    python benchmarks/sampling.py [--batch-sizes 1 8 32] [--sweep]

Prints a table per batch size: GPU time (one call captured in a CUDA graph, the graph replayed)
and as called (the eager Python call), both ``triton.testing.do_bench`` medians in µs, bf16
logits [B, 248320]. The previous sampler (``previous_sampler``, the engine's
``sample_next_tokens`` before ``sample_tokens``) takes Python-constant parameters: a greedy argmax,
or softmax + exponential race with a full sort for top-p. ``--sweep`` also times the sampled
kernel over launch geometries (block, warps, programs per SM), the data behind the constants of
``fuselm/ops/sampling/kernels.py``. Also timed: ``token_logprobs`` (the drawn tokens'
log-probabilities, ``SamplingParams.logprobs``, which the engine runs after a step whose requests
ask for them) beside its PyTorch definition ``token_logprobs_ref``; ``apply_penalties`` (the
penalised variants' first launch) and the draw after it on its fp32 logits (their cut-offs take the
sort).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fuselm.ops.sampling import (PROMPT_BIT, apply_penalties, cutoffs, keep_thresholds, sample_tokens, token_logprobs,
                                 token_logprobs_ref)
from fuselm.ops.sampling.kernels import sample_tokens_kernel, split_geometry
from fuselm.runtime import num_sms
from timing import bench, graph_bench

N_VOCAB = 248320
TEMPERATURE = 0.7
TOP_P = 0.9


def previous_sampler(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    """The engine's sampler before ``sample_tokens`` (a copy, kept as the baseline)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth_largest = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_scores = sorted_scores.masked_fill(mass_before >= top_p, float("-inf"))
        scores = scores.scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def _row_params(batch, temperature, top_p, top_k=0):
    device = "cuda"
    return (torch.full((batch,), temperature, dtype=torch.float32, device=device),
            torch.full((batch,), top_k, dtype=torch.int32, device=device),
            torch.full((batch,), top_p, dtype=torch.float32, device=device),
            torch.arange(batch, dtype=torch.int64, device=device) * 7919,
            torch.full((batch,), 100, dtype=torch.int64, device=device))


def cases(logits):
    """(name, call) pairs at the batch of ``logits``."""
    batch = logits.shape[0]
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    drawn = logits.argmax(dim=-1)  # token_logprobs' ids
    greedy = _row_params(batch, 0.0, 1.0)
    sampled = _row_params(batch, TEMPERATURE, 1.0)
    nucleus = _row_params(batch, TEMPERATURE, TOP_P)
    qwen_defaults = _row_params(batch, 0.6, 0.95, top_k=20)  # Qwen3.5's generation_config
    qwen_instruct = _row_params(batch, 0.7, 0.8, top_k=20)  # Qwen's non-thinking settings, with presence 1.5
    # 300 generated tokens and a 512-token prompt marked per row; presence 1.5 (repetition 1.05: the prompt's too)
    counts = torch.zeros(batch, logits.shape[1], dtype=torch.int32, device=logits.device)
    counts[:, torch.randint(0, logits.shape[1], (300,))] = 1
    counts[:, torch.randint(0, logits.shape[1], (512,))] += PROMPT_BIT
    penalties = (torch.full((batch,), 1.05, device=logits.device), torch.zeros(batch, device=logits.device),
                 torch.full((batch,), 1.5, device=logits.device))
    penalised = apply_penalties(logits, counts, *penalties)
    return [
        ("previous: greedy argmax", lambda: previous_sampler(logits)),
        (f"previous: T={TEMPERATURE}", lambda: previous_sampler(logits, TEMPERATURE)),
        (f"previous: T={TEMPERATURE} top_p={TOP_P} (sort)", lambda: previous_sampler(logits, TEMPERATURE, top_p=TOP_P)),
        ("sample_tokens: greedy, filtered=False", lambda: sample_tokens(logits, *greedy, filtered=False, out=out)),
        (f"sample_tokens: T={TEMPERATURE}, filtered=False",
         lambda: sample_tokens(logits, *sampled, filtered=False, out=out)),
        (f"sample_tokens: T={TEMPERATURE} top_p={TOP_P}, filtered=True (16-bit logits: key-count cut-offs)",
         lambda: sample_tokens(logits, *nucleus, filtered=True, out=out)),
        ("sample_tokens: T=0.6 top_k=20 top_p=0.95 (key-count cut-offs)",
         lambda: sample_tokens(logits, *qwen_defaults, filtered=True, out=out)),
        (f"cut-offs alone, T={TEMPERATURE} top_p={TOP_P}: keep_thresholds (the sort, the definition)",
         lambda: keep_thresholds(logits, *nucleus[:3])),
        (f"cut-offs alone, T={TEMPERATURE} top_p={TOP_P}: cutoffs (key counts)", lambda: cutoffs(logits, *nucleus[:3])),
        ("cut-offs alone, T=0.6 top_k=20 top_p=0.95: cutoffs (key counts)",
         lambda: cutoffs(logits, *qwen_defaults[:3])),
        ("apply_penalties (repetition 1.05, presence 1.5) -> fp32 logits",
         lambda: apply_penalties(logits, counts, *penalties)),
        ("sample_tokens on the penalised fp32 logits: greedy, filtered=False",
         lambda: sample_tokens(penalised, *greedy, filtered=False, out=out)),
        ("sample_tokens on the penalised fp32 logits: T=0.7 top_k=20 top_p=0.8 (the sort's cut-offs)",
         lambda: sample_tokens(penalised, *qwen_instruct, filtered=True, out=out)),
        ("sample_tokens on the penalised fp32 logits: T=0.7 top_k=20 top_p=0.8, max_top_k=64 (topk's cut-offs)",
         lambda: sample_tokens(penalised, *qwen_instruct, filtered=True, max_top_k=64, out=out)),
        ("sample_tokens: T=0.7 top_k=20 top_p=0.8 on the bf16 logits (key-count cut-offs)",
         lambda: sample_tokens(logits, *qwen_instruct, filtered=True, out=out)),
        *[(f"{name}, {k} top (SamplingParams.logprobs = {k})", lambda k=k, op=op: op(logits, drawn, k))
          for k in (0, 5, 20) for name, op in (("token_logprobs_ref (PyTorch)", token_logprobs_ref),
                                                ("token_logprobs (Triton)", token_logprobs))],
    ]


def benchmark_sampling(batch_sizes=(1, 8, 32), dtype=torch.bfloat16) -> list[dict]:
    """Time every case at each batch size; print the table and return its rows."""
    rows = []
    print(f"V = {N_VOCAB}, {str(dtype).removeprefix('torch.')} logits, {torch.cuda.get_device_name()}")
    print(f"{'B':>3}  {'case':<80} {'graph µs':>9} {'eager µs':>9} {'logits GB/s':>12}")
    for batch in batch_sizes:
        logits = (torch.randn(batch, N_VOCAB, device="cuda") * 2.5).to(dtype)
        for name, call in cases(logits):
            graph_ms, eager_ms = graph_bench(call), bench(call)
            gbs = logits.numel() * logits.element_size() / graph_ms / 1e6
            rows.append(dict(batch=batch, case=name, graph_us=graph_ms * 1e3, eager_us=eager_ms * 1e3))
            print(f"{batch:>3}  {name:<80} {graph_ms * 1e3:>9.1f} {eager_ms * 1e3:>9.1f} {gbs:>12.0f}")
    return rows


def sweep_geometry(batch_sizes=(1, 8, 32), dtype=torch.bfloat16) -> None:
    """GPU time of the sampled, unfiltered kernel over (block, warps, programs per SM)."""
    sms = num_sms(torch.device("cuda"))
    print(f"{'B':>3} {'block':>6} {'warps':>5} {'prog/SM':>7} {'splits':>6} {'graph µs':>9}")
    for batch in batch_sizes:
        logits = (torch.randn(batch, N_VOCAB, device="cuda") * 2.5).to(dtype)
        temperature, _, _, seeds, positions = _row_params(batch, TEMPERATURE, 1.0)
        ids = torch.empty(batch, dtype=torch.int64, device="cuda")
        results = []
        for block, warps, per_sm in itertools.product((512, 1024, 2048, 4096), (4, 8, 16), (1, 2, 4, 8)):
            geo = split_geometry(batch, N_VOCAB, block, per_sm * sms, warps)
            us = graph_bench(lambda: sample_tokens_kernel(logits, temperature, None, seeds, positions, ids, geo)) * 1e3
            results.append((us, block, warps, per_sm, geo.n_splits))
        for us, block, warps, per_sm, splits in sorted(results)[:5]:
            print(f"{batch:>3} {block:>6} {warps:>5} {per_sm:>7} {splits:>6} {us:>9.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch geometry")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/sampling.py needs a CUDA device")
        return 1
    benchmark_sampling(tuple(args.batch_sizes))
    if args.sweep:
        sweep_geometry(tuple(args.batch_sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
