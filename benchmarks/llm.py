"""Text in, text out on a GPU: checkpoint load time and LLM decode speed (issue 16's targets).

    python benchmarks/llm.py --checkpoint DIR [--config 9b] [--out DIR]

1. Writes a random-weight checkpoint in the released layout (``fuselm init-checkpoint``) unless
   DIR already holds one.
2. Load time, alternating (page cache warm for both after the write): HF transformers'
   ``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16, device_map="cuda")`` and
   ``Qwen35.from_pretrained(DIR, dtype=bfloat16, device="cuda")``; median of ``--load-runs``.
3. Decode at batch 1, alternating: ``LLM.generate`` (tokenizer, incremental detokenization, stop
   checks) and ``Engine.generate`` on the same prompt ids (ids only), greedy with ignore_eos, a
   512-token prompt and 256 new tokens; decode tok/s = (tokens - 1) / (finish - first token),
   time to first token = first token - arrival. Median of ``--decode-runs``.
Prints a markdown table and writes llm.json / llm.md to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from fuselm.bench.generate import request_timings


def _clear():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def timed_load(load, directory: Path) -> float:
    """Seconds for ``load(directory)`` to put the model on the GPU (the model is dropped after)."""
    _clear()
    start = time.perf_counter()
    model = load(directory)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    return seconds


def load_hf(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda")


def load_fuselm(directory: Path):
    from fuselm import Qwen35

    return Qwen35.from_pretrained(directory, dtype=torch.bfloat16, device="cuda")


def decode_figures(output) -> dict:
    """One request's time to first token and decode tok/s (``request_timings`` of it alone)."""
    timings = request_timings([output])
    return {"tokens": len(output.outputs[0].token_ids), "ttft_ms": 1e3 * timings["prefill_seconds"],
            "decode_tok_s": timings["decode_tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--config", default="9b")
    parser.add_argument("--load-runs", type=int, default=2)
    parser.add_argument("--decode-runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from fuselm import LLM, SamplingParams
    from fuselm.models.qwen35.presets import preset_config, write_random_checkpoint
    from fuselm.tokenizer import write_tokenizer_files

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": args.config}
    if not (args.checkpoint / "config.json").is_file():
        start = time.perf_counter()
        write_random_checkpoint(args.checkpoint, preset_config(args.config, vocab_size=248320), dtype=torch.bfloat16,
                                device="cuda", seed=0)
        write_tokenizer_files(args.checkpoint)
        results["init_checkpoint_s"] = time.perf_counter() - start
        _clear()
    size = sum(p.stat().st_size for p in args.checkpoint.glob("*.safetensors"))
    results["checkpoint_gb"] = size / 1e9
    print(f"checkpoint {args.checkpoint}: {size / 1e9:.2f} GB of safetensors", flush=True)

    hf_loads, our_loads = [], []
    for _ in range(args.load_runs):
        hf_loads.append(timed_load(load_hf, args.checkpoint))
        our_loads.append(timed_load(load_fuselm, args.checkpoint))
        print(f"load: HF {hf_loads[-1]:.2f} s, fuselm {our_loads[-1]:.2f} s", flush=True)
    results["load_s"] = {"hf": hf_loads, "fuselm": our_loads}
    _clear()

    llm = LLM(args.checkpoint, dtype="bfloat16", device="cuda", max_batch=1,
              max_len=args.prompt_len + args.new_tokens, seed=0)
    words = ("the quick brown fox jumps over the lazy dog while the band plays on " * 200).split()
    text = " ".join(words)
    ids = llm.tokenizer.encode(text)[: args.prompt_len]
    prompt = llm.tokenizer.decode(ids)
    ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # compile prefill shapes
    runs = {"llm.generate (text)": [], "Engine.generate (ids)": []}
    for _ in range(args.decode_runs):
        runs["llm.generate (text)"].append(decode_figures(llm.generate(prompt, params)[0]))
        runs["Engine.generate (ids)"].append(decode_figures(llm.engine.generate([ids], params)[0]))
    results["prompt_tokens"] = len(ids)
    results["decode"] = runs

    hf_load, our_load = statistics.median(hf_loads), statistics.median(our_loads)
    lines = [f"## Text in, text out ({results['gpu']}, bf16, {args.config} config, random weights)", "",
             f"Checkpoint: {size / 1e9:.2f} GB of safetensors in the released layout (`fuselm init-checkpoint`).", "",
             "| measure | HF transformers | fuselm | ratio |", "|---|---|---|---|",
             f"| load to GPU, median of {args.load_runs} (s) | {hf_load:.2f} | {our_load:.2f} | "
             f"{our_load / hf_load:.2f}x the time |", "",
             f"Decode at batch 1, prompt {len(ids)} tokens, {args.new_tokens} new tokens, greedy; median of "
             f"{args.decode_runs} alternating runs:", "",
             "| path | decode tok/s | time to first token (ms) |", "|---|---|---|"]
    medians = {}
    for name, figures in runs.items():
        medians[name] = statistics.median(f["decode_tok_s"] for f in figures)
        lines.append(f"| {name} | {medians[name]:.1f} | {statistics.median(f['ttft_ms'] for f in figures):.1f} |")
    ratio = medians["llm.generate (text)"] / medians["Engine.generate (ids)"]
    lines += ["", f"llm.generate / Engine.generate decode tok/s: {ratio:.4f}"]
    results.update(load_ratio=our_load / hf_load, text_over_ids=ratio)
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llm.json").write_text(json.dumps(results, indent=1))
        (args.out / "llm.md").write_text(markdown)


if __name__ == "__main__":
    main()
