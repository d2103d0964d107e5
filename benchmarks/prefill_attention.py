"""``prefill_attention`` (a prompt chunk's causal attention over paged K/V) at Qwen3.5-9B's heads,
by key columns per step (GPU only).

    python benchmarks/prefill_attention.py [--steps 32 64] [--out DIR]   -> prefill_attention.md / .json

Qwen3.5-9B's full-attention layer: 16 query heads, 4 kv heads, head dim 256, bf16, 64-token pages
(the model cache's page size), the pages of each row scattered. Cases (rows x chunk tokens @ tokens
already cached): a serving mixed step's continued chunk (1 x 224 @ 256), a fresh one (1 x 480 @ 0),
later chunks of long prompts (4 x 512 @ 1536, 1 x 2048 @ 6144). Each BLOCK_N of ``--steps`` (key
columns a step; kernels.BLOCK_N, set before the launch) timed in the same run: do_bench medians.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fuselm.ops.attention_prefill import kernels
from fuselm.ops.attention_prefill.op import prefill_attention
from timing import bench, results_dir

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 256, 64
CASES = [(1, 224, 256), (1, 480, 0), (4, 512, 1536), (1, 2048, 6144)]  # rows, chunk tokens, cached before


def case_inputs(rows: int, tokens: int, start: int, generator: torch.Generator):
    pages_per_row = (start + tokens + PAGE - 1) // PAGE
    num_pages = rows * pages_per_row
    table = torch.randperm(num_pages, generator=generator).view(rows, pages_per_row).to(torch.int32).cuda()
    k = torch.randn(num_pages, KV_HEADS, PAGE, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    v = torch.randn(num_pages, KV_HEADS, PAGE, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    q = torch.randn(rows, tokens, HEADS, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16).transpose(1, 2)
    starts = torch.full((rows,), start, dtype=torch.int32, device="cuda")
    lengths = torch.full((rows,), tokens, dtype=torch.int32, device="cuda")
    return q, k, v, table, starts, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[32, 64], help="key columns per step to time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    default = kernels.BLOCK_N
    results = []
    for rows, tokens, start in CASES:
        inputs = case_inputs(rows, tokens, start, generator)
        row = {"rows": rows, "tokens": tokens, "start": start, "ms": {}}
        outputs = {}
        for step in args.steps:
            kernels.BLOCK_N = step
            outputs[step] = prefill_attention(*inputs, HEAD_DIM ** -0.5)
            row["ms"][step] = bench(lambda: prefill_attention(*inputs, HEAD_DIM ** -0.5))
        kernels.BLOCK_N = default
        first = outputs[args.steps[0]].float()
        row["max_diff"] = max((o.float() - first).abs().max().item() for o in outputs.values())
        results.append(row)
        print(row, flush=True)
    lines = [f"## prefill_attention, Qwen3.5-9B heads (16 q, 4 kv, head dim 256), bf16, {PAGE}-token pages, "
             f"{torch.cuda.get_device_name()} (do_bench medians, ms; default BLOCK_N {default})", "",
             "| rows x tokens @ cached | " + " | ".join(f"BLOCK_N {s}" for s in args.steps) + " | max |diff| |",
             "|---|" + "---|" * (len(args.steps) + 1)]
    for row in results:
        lines.append(f"| {row['rows']} x {row['tokens']} @ {row['start']} | "
                     + " | ".join(f"{row['ms'][s]:.4f}" for s in args.steps) + f" | {row['max_diff']:.2e} |")
    text = "\n".join(lines) + "\n"
    out = results_dir(args.out)
    (out / "prefill_attention.md").write_text(text)
    (out / "prefill_attention.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
