"""What sharing a prompt's prefill saves n samples (Qwen3.5-9B shape, random bf16 weights).

    python benchmarks/prefill_sharing.py [--prompt-lens 512 2048] [--n 8] [--out DIR]

One engine (max_batch = n, CUDA graphs). For each prompt length, in one run and alternating:
  - shared:   one request of n samples (SamplingParams(n=...)): the first prefills T - 1 tokens,
              the others copy its state and pages, and each prefills its last token;
  - separate: n requests of one sample each with the same prompt and seeds (each prefills T).
Reported: the time to the last sample's first token and to the last token, from the requests'
host clocks (median of --runs), the prompt tokens the engine prefilled (its step log), and how
many samples drew the same tokens both ways (in bf16 the last token's chunk of one rounds
otherwise than a whole prompt's chunk: a sampled token may then differ, as with any chunking;
in fp32 they are the same, tests/test_engine.py).
Prints a markdown table; writes prefill_sharing.md / .json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import torch

from fuselm.engine import Engine, SamplingParams
from fuselm.models.qwen35.presets import preset_config, random_qwen35
from timing import write_table


def run(engine: Engine, prompt: list[int], params: SamplingParams, shared: bool) -> dict:
    engine.step_log = []
    if shared:
        requests = engine.add_requests([{"prompt_token_ids": prompt, "params": params}])[0]
    else:
        requests = [r for group in engine.add_requests([{"prompt_token_ids": prompt, "params": sample}
                                                        for sample in params.samples()]) for r in group]
    engine.run()
    torch.cuda.synchronize()
    arrival = min(r.metrics.arrival_time for r in requests)
    result = {"first_token_ms": 1e3 * (max(r.metrics.first_token_time for r in requests) - arrival),
              "total_ms": 1e3 * (max(r.metrics.finished_time for r in requests) - arrival),
              "prompt_tokens_prefilled": sum(entry["prompt_tokens"] for entry in engine.step_log),
              "tokens": [r.output_token_ids for r in requests]}
    engine.step_log = None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", default="9b")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    model = random_qwen35(preset_config(args.config), dtype=torch.bfloat16, device="cuda", seed=0)
    engine = Engine(model, max_batch=args.n, max_len=max(args.prompt_lens) + args.max_tokens, seed=0)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, n=args.n, ignore_eos=True)
    rows, results = [], []
    for length in args.prompt_lens:
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()
        for shared in (True, False):  # captures and first-use costs out of the measured runs
            run(engine, prompt, dataclasses.replace(params, max_tokens=4), shared)
        measured = {True: [], False: []}
        for _ in range(args.runs):
            for shared in (True, False):
                measured[shared].append(run(engine, prompt, params, shared))
        same = sum(a == b for a, b in zip(measured[True][0]["tokens"], measured[False][0]["tokens"]))
        summary = {"same_tokens": same}
        for shared, label in ((True, "shared"), (False, "separate")):
            runs = measured[shared]
            summary[label] = {key: statistics.median(r[key] for r in runs)
                              for key in ("first_token_ms", "total_ms", "prompt_tokens_prefilled")}
        results.append({"prompt_len": length, "n": args.n, "max_tokens": args.max_tokens, **summary})
        s, p = summary["shared"], summary["separate"]
        rows.append(f"| {length} | {args.n} | {same} of {args.n} | {p['prompt_tokens_prefilled']:,.0f} -> "
                    f"{s['prompt_tokens_prefilled']:,.0f} "
                    f"| {p['first_token_ms']:.1f} -> {s['first_token_ms']:.1f} "
                    f"({p['first_token_ms'] / s['first_token_ms']:.2f}x) | {p['total_ms']:.1f} -> {s['total_ms']:.1f} "
                    f"({p['total_ms'] / s['total_ms']:.2f}x) |")
    header = (f"Qwen3.5 {args.config} config, random bf16 weights, {torch.cuda.get_device_name()}; n = {args.n} "
              f"samples (T 0.8), {args.max_tokens} new tokens, ignore_eos; separate requests -> shared prefill; "
              f"median of {args.runs} runs\n\n| prompt | n | samples with the same tokens | prompt tokens prefilled | "
              "last first token ms | last token ms |\n|---|---|---|---|---|---|\n")
    write_table(args.out, "prefill_sharing", header + "\n".join(rows) + "\n", results)


if __name__ == "__main__":
    main()
