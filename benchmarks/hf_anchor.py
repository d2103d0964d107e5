"""HF transformers beside ``fuselm serve`` (issue 17's anchor), on the same checkpoint directory.

1. Static batches, ``model.generate`` (greedy, ``min_new_tokens`` = ``max_new_tokens``: no early
   end), random prompts of ``--prompt-len`` ids: time to the first token (``max_new_tokens=1``)
   and the whole run, for batch 1 and ``--batch``; output tok/s = batch x new tokens / run time.
2. Its continuous batching, ``model.generate_batch`` (paged attention KV; transformers has no
   Gated DeltaNet state in that path): run on a few greedy requests and compared token for token
   with (1)'s ``generate`` of the same prompts; what it returns (or raises) is written down.

    python benchmarks/hf_anchor.py DIR --out OUT_DIR     (needs a GPU; DIR from fuselm init-checkpoint)
Writes OUT_DIR/hf_anchor.json and hf_anchor.md.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--check-requests", type=int, default=4)
    parser.add_argument("--check-tokens", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(args.directory, dtype=torch.bfloat16, device_map="cuda").eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    results = {"model": str(args.directory), "gpu": torch.cuda.get_device_name(), "prompt_len": args.prompt_len,
               "max_new_tokens": args.max_new_tokens, "static": {}}

    def generate(ids, new_tokens):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        for batch in (1, args.batch):
            ids = prompts[:batch].cuda()
            generate(ids, 2)  # warm-up
            ttft = timed(lambda: generate(ids, 1))
            total = timed(lambda: generate(ids, args.max_new_tokens))
            results["static"][batch] = {"ttft_ms": 1e3 * ttft, "seconds": total,
                                        "output_tokens_per_s": batch * args.max_new_tokens / total,
                                        "decode_ms_per_step": 1e3 * (total - ttft) / (args.max_new_tokens - 1)}
            print(f"HF generate batch {batch}: {results['static'][batch]}", flush=True)

        check = [prompts[i, :args.prompt_len - 7 * i].tolist() for i in range(args.check_requests)]
        expected = [generate(torch.tensor([p]).cuda(), args.check_tokens)[0, len(p):].tolist() for p in check]
        cb = {"requests": len(check), "tokens": args.check_tokens}
        try:
            start = time.perf_counter()
            outputs = model.generate_batch(check, GenerationConfig(max_new_tokens=args.check_tokens, do_sample=False,
                                                                   eos_token_id=-1, pad_token_id=0))
            cb["seconds"] = time.perf_counter() - start
            got = [list(outputs[key].generated_tokens) for key in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
            cb["generated_lengths"] = [len(g) for g in got]
            cb["equal_to_generate"] = [g == e for g, e in zip(got, expected)]
            cb["first_difference"] = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None)
                                      for g, e in zip(got, expected)]
        except Exception as error:  # what it does on Qwen3.5 is the finding
            cb["error"] = f"{type(error).__name__}: {error}"
            cb["traceback"] = traceback.format_exc()[-2000:]
        results["generate_batch"] = cb
        print(f"HF generate_batch: {cb}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_anchor.json").write_text(json.dumps(results, indent=1))
    lines = [f"## HF transformers on {args.directory.name} ({results['gpu']}, bf16), prompt {args.prompt_len}, "
             f"{args.max_new_tokens} new tokens, greedy", "",
             "| static batch | TTFT ms | decode ms/step | output tok/s |", "|---|---|---|---|"]
    for batch, r in results["static"].items():
        lines.append(f"| {batch} | {r['ttft_ms']:.1f} | {r['decode_ms_per_step']:.2f} | {r['output_tokens_per_s']:,.1f} |")
    lines += ["", f"generate_batch (continuous batching) on {len(check)} greedy requests of {args.check_tokens} tokens: "
              + json.dumps({k: v for k, v in cb.items() if k != "traceback"})]
    (args.out / "hf_anchor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
