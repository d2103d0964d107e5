"""Qwen3.5 generation: the fuselm engine against Hugging Face transformers, in one run.

    python3 benchmarks/qwen35.py [--out DIR]          # the issue-6 targets, on a GPU (< 8 min on an H100)
    python3 benchmarks/qwen35.py --config tiny --prompt-len 8 --new-tokens 4 --batch 1 2 --hf-new-tokens 4
                                                      # a smoke run (also on the CPU, interpreter)
    python3 benchmarks/qwen35.py --config 35b-a3b     # Qwen3.5-MoE (issue 19; ~69 GB: the H200 kind)

Default: HF ``Qwen3_5TextConfig()`` (the 9B text model; ``--config`` any preset of
``fuselm.models.qwen35.presets``, e.g. 35b-a3b, tiny-moe), seeded random weights made on the
device in bf16, prompts of 512 random ids, 256 new tokens, batch 1, 8 and 32, greedy, no eos.

fuselm: ``Engine`` with one CUDA graph per measured batch size; the batch's requests are
generated together (``SamplingParams(temperature=0, ignore_eos=True)``) and timed by their own
metrics (``fuselm.bench.generate.request_timings``): prefill = first arrival to the last first
token (one ``model.prefill`` of the batch + the first token), decode = first first token to the
last finish (the remaining steps as graph replays, the host's reads pipelined one step behind);
best of ``--repeats`` runs after a warm-up. Then kernels, graph launches and host syncs per step
(``fuselm.engine.audit.launch_audit``: torch.profiler), one prefill's kernels and GPU kernel time
against its wall time (``prefill_profile``), and the slowest kernels of a prefill and a decode step
at the smallest and largest batch (issue 18's breakdowns). Weight floor = bytes of weights a decode
step reads (``decode_weight_bytes``) / the measured device copy bandwidth
(``fuselm.runtime.copy_bandwidth``: read + written bytes, TB/s).

HF: ``Qwen3_5ForCausalLM`` (``Qwen3_5MoeForCausalLM``) with the same seeded scheme (its own draws), bf16, built after ours
is freed (both at 9B do not fit beside each other with room to run), ``generate`` greedy
(``min_new_tokens`` = ``max_new_tokens``); it uses fla-core's kernels when fla is installed.
Prefill = ``generate(max_new_tokens=1)``; decode tok/s = batch x (n - 1) / (time(n) -
time(1)) for n = ``--hf-new-tokens`` (capped below --new-tokens to bound the run; its decode
rate is per step, so the cap changes only the KV length it averages over, noted in the table).
Writes ``qwen35.md`` and ``qwen35.json`` (MoE configs: ``qwen35_moe.*``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import torch

from fuselm.bench.generate import request_timings
from fuselm.engine import Engine, SamplingParams
from fuselm.engine.audit import decode_weight_bytes, kernel_time_rows, launch_audit, prefill_profile
from fuselm.models.qwen35.presets import PRESETS, preset_config, random_hf_qwen35, random_qwen35
from fuselm.runtime import copy_bandwidth
from timing import results_dir

TARGET_BATCH1_TOKENS_PER_S = 155.0  # issue 6, H100
TARGET_PERCENT_OF_FLOOR = 82.0
TARGET_SPEEDUP_OVER_HF = 15.0
MOE_TARGET_PERCENT_OF_FLOOR = 70.0  # issue 19: 35B-A3B decode at batch 1
CONFIG_NAMES = {"9b": "9B (HF Qwen3_5TextConfig() defaults)", "35b-a3b": "35B-A3B (HF Qwen3_5MoeTextConfig() defaults)"}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def package_version(*names):
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def run_fuselm(config, args, device) -> dict:
    start = time.perf_counter()
    model = random_qwen35(config, dtype=args.dtype, device=device, seed=0)
    engine = Engine(model, max_batch=max(args.batch), max_len=args.prompt_len + args.new_tokens,
                    graph_batch_sizes=tuple(args.batch), state_dtype=args.state_dtype)
    sync(device)
    result = {"build_and_capture_s": time.perf_counter() - start, "weight_bytes_per_step": decode_weight_bytes(model),
              "parameters": sum(p.numel() for p in model.parameters()), "batches": {}}
    print(f"fuselm: built and captured {engine.runner.batch_sizes} in {result['build_and_capture_s']:.1f} s",
          flush=True)
    generator = torch.Generator().manual_seed(1)
    for batch in args.batch:
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=generator)
        engine.generate(prompts, greedy(2))  # compiles the prefill kernels for this shape
        runs = [request_timings(engine.generate(prompts, greedy(args.new_tokens))) for _ in range(args.repeats)]
        prefill_s = min(r["prefill_seconds"] for r in runs)
        decode_s = min(r["decode_seconds"] for r in runs)
        steps = runs[0]["decode_steps"]
        row = {"prefill_s": prefill_s, "prefill_tokens_per_s": batch * args.prompt_len / prefill_s,
               "decode_steps": steps, "decode_s": decode_s, "decode_ms_per_step": 1e3 * decode_s / steps,
               "decode_tokens_per_s": batch * steps / decode_s, "graph_batch_size": engine.runner.batch_size_for(batch),
               "weight_bytes": decode_weight_bytes(model, batch),
               "launches": launch_audit(engine, batch, steps=4) if device.type == "cuda" else None,
               "prefill_profile": prefill_profile(model, prompts.to(device)) if device.type == "cuda" else None}
        result["batches"][batch] = row
        print(f"fuselm batch {batch}: prefill {row['prefill_tokens_per_s']:,.0f} tok/s, decode "
              f"{row['decode_tokens_per_s']:,.1f} tok/s ({row['decode_ms_per_step']:.3f} ms/step)", flush=True)
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    del engine, model
    free(device)
    return result


def run_hf(config, args, device) -> dict:
    start = time.perf_counter()
    hf_model = random_hf_qwen35(config, dtype=args.dtype, device=device, seed=0)
    sync(device)
    result = {"build_s": time.perf_counter() - start, "new_tokens": args.hf_new_tokens, "batches": {}}
    print(f"HF: built in {result['build_s']:.1f} s", flush=True)
    generator = torch.Generator().manual_seed(1)

    def timed_generate(model, prompts, new_tokens):
        sync(device)
        begin = time.perf_counter()
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        sync(device)
        return time.perf_counter() - begin

    for batch in args.batch:
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=generator).to(device)
        timed_generate(hf_model, prompts, 2)  # warm-up (kernel compilation, allocator)
        first = min(timed_generate(hf_model, prompts, 1) for _ in range(args.repeats))
        full = timed_generate(hf_model, prompts, args.hf_new_tokens)
        steps = args.hf_new_tokens - 1
        row = {"prefill_s": first, "prefill_tokens_per_s": batch * args.prompt_len / first, "decode_steps": steps,
               "decode_s": full - first, "decode_ms_per_step": 1e3 * (full - first) / steps,
               "decode_tokens_per_s": batch * steps / (full - first)}
        result["batches"][batch] = row
        print(f"HF batch {batch}: prefill {row['prefill_tokens_per_s']:,.0f} tok/s, decode "
              f"{row['decode_tokens_per_s']:,.1f} tok/s ({row['decode_ms_per_step']:.2f} ms/step)", flush=True)
    del hf_model
    free(device)
    return result


def kernel_time_lines(ours) -> list[str]:
    """Kernel time (torch.profiler) of one prefill and one decode step, at the smallest and the
    largest batch measured: the slowest kernels, ms a call (launches)."""
    batches = [b for b in sorted(ours["batches"]) if ours["batches"][b].get("prefill_profile")]
    lines = []
    for batch in sorted({batches[0], batches[-1]}) if batches else []:
        row = ours["batches"][batch]
        lines += ["", f"### Kernel time at batch {batch}: one prefill ({row['prefill_profile']['tokens']} tokens a row) "
                  "and one decode step (graph replay), ms (launches)", ""]
        lines += kernel_time_rows({"prefill": row["prefill_profile"]["kernel_ms"],
                                   "decode step": row["launches"]["kernel_ms"]})
    return lines


def config_is_moe(ours) -> bool:
    """Whether the weight bytes of a step grow with the batch (an MoE model's experts)."""
    return len({row["weight_bytes"] for row in ours["batches"].values()}) > 1


def markdown(meta, ours, hf) -> str:
    floor_ms = meta.get("weight_floor_ms_per_step")
    lines = [f"# Qwen3.5 {meta['config']}: fuselm engine vs HF transformers, {meta['dtype']}, {meta['gpu']}", "",
             f"Command: `{meta['command']}` ({meta['date']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"transformers {meta['transformers']}, fla-core {meta['fla'] or 'not installed'}, "
             f"causal-conv1d {meta['causal_conv1d'] or 'not installed'}).", "",
             f"Random weights, prompt {meta['prompt_len']} random ids, greedy, no eos. fuselm: {meta['new_tokens']} new "
             f"tokens, best of {meta['repeats']} runs, {meta.get('state_dtype', 'float32')} recurrent states; "
             + ("HF: not run" if hf is None else f"HF: {hf['new_tokens']} new tokens"
                + (f" (capped from {meta['new_tokens']}: its per-step rate)" if hf["new_tokens"] < meta["new_tokens"] else ""))
             + ". Decode tok/s = batch x decode steps / decode time (the first token comes from prefill).", ""]
    if floor_ms is not None:
        lines += [f"Weight floor: {ours['weight_bytes_per_step'] / 1e9:.2f} GB of weights per decode step / "
                  f"{meta['copy_tbps']:.2f} TB/s measured copy bandwidth = {floor_ms:.3f} ms per step "
                  f"({1e3 / floor_ms:.1f} tok/s at batch 1)"
                  + ("; an MoE step at batch B reads the experts its B tokens pick, so each row's floor counts "
                     "its own bytes (`decode_weight_bytes(model, B)`: " + ", ".join(
                         f"B {b} {row['weight_bytes'] / 1e9:.2f} GB" for b, row in ours["batches"].items()) + ")"
                     if config_is_moe(ours) else "") + ".", ""]
    lines += ["## Decode", "",
              "| batch | fuselm tok/s | ms/step | % of weight floor | HF tok/s | HF ms/step | fuselm / HF | kernels per "
              "step | graph launches per step | host syncs per step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, row in ours["batches"].items():
        ref = hf["batches"].get(batch) if hf else None
        launches = row["launches"] or {}
        # An MoE step reads more experts at a larger batch: each batch's own bytes (dense: the same).
        row_floor_ms = floor_ms and floor_ms * row.get("weight_bytes", ours["weight_bytes_per_step"]) \
            / ours["weight_bytes_per_step"]
        floor = f"{100 * row_floor_ms / row['decode_ms_per_step']:.1f}%" if floor_ms else "n/a"
        lines.append(f"| {batch} | {row['decode_tokens_per_s']:,.1f} | {row['decode_ms_per_step']:.3f} | {floor} | "
                     + (f"{ref['decode_tokens_per_s']:,.1f} | {ref['decode_ms_per_step']:.2f} | "
                        f"{row['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.1f}x | " if ref else "n/a | n/a | n/a | ")
                     + f"{launches.get('kernels', 'n/a')} | {launches.get('graph_launches', 'n/a')} | "
                     + f"{launches.get('host_syncs', 'n/a')} |")
    lines += ["", "## Prefill", "", "| batch x prompt | fuselm tok/s | fuselm ms | HF tok/s | HF ms | fuselm / HF | "
              "kernels (copies) | GPU kernel ms / wall ms of one `model.prefill` |", "|---|---|---|---|---|---|---|---|"]
    for batch, row in ours["batches"].items():
        ref = hf["batches"].get(batch) if hf else None
        prof = row.get("prefill_profile")
        lines.append(f"| {batch} x {meta['prompt_len']} | {row['prefill_tokens_per_s']:,.0f} | {1e3 * row['prefill_s']:.1f} | "
                     + (f"{ref['prefill_tokens_per_s']:,.0f} | {1e3 * ref['prefill_s']:.1f} | "
                        f"{row['prefill_tokens_per_s'] / ref['prefill_tokens_per_s']:.2f}x |" if ref else "n/a | n/a | n/a |")
                     + (f" {prof['kernels']:g} ({prof['copies']:g}) | {prof['gpu_ms']:.2f} / {prof['wall_ms']:.2f} |"
                        if prof else " n/a | n/a |"))
    lines += kernel_time_lines(ours)
    one = ours["batches"].get(1)
    if one is not None and floor_ms is not None and meta["config"].startswith("9B"):
        ref = hf["batches"].get(1) if hf else None
        speedup = one["decode_tokens_per_s"] / ref["decode_tokens_per_s"] if ref else None
        launches = [row["launches"] for row in ours["batches"].values()]
        single = all(x["graph_launches"] == 1 and x["kernel_launches_outside_graphs"] == 0 for x in launches)
        no_sync = all(x["host_syncs"] == 0 and x["sync_debug_error"] is None for x in launches)
        percent = 100 * floor_ms / one["decode_ms_per_step"]
        lines += ["", "## Issue-6 targets (batch 1)", "", "| target | result | met |", "|---|---|---|",
                  f"| decode >= {TARGET_BATCH1_TOKENS_PER_S:.0f} tok/s | {one['decode_tokens_per_s']:.1f} tok/s | "
                  f"{'yes' if one['decode_tokens_per_s'] >= TARGET_BATCH1_TOKENS_PER_S else 'no'} |",
                  f"| >= {TARGET_PERCENT_OF_FLOOR:.0f}% of the weight floor | {percent:.1f}% | "
                  f"{'yes' if percent >= TARGET_PERCENT_OF_FLOOR else 'no'} |",
                  f"| >= {TARGET_SPEEDUP_OVER_HF:.0f}x HF transformers (+ fla) | "
                  + (f"{speedup:.1f}x | {'yes' if speedup >= TARGET_SPEEDUP_OVER_HF else 'no'} |" if speedup else "n/a | n/a |"),
                  f"| one graph launch per decode step, no kernel launched outside it | "
                  f"{[x['graph_launches'] for x in launches]} graph launches | {'yes' if single else 'no'} |",
                  f"| zero host syncs inside the step | {[x['host_syncs'] for x in launches]}; sync debug mode: "
                  f"{[x['sync_debug_error'] or 'no error' for x in launches]} | {'yes' if no_sync else 'no'} |"]
    if one is not None and floor_ms is not None and meta["config"].startswith("35B-A3B"):
        percent = 100 * floor_ms / one["decode_ms_per_step"]
        lines += ["", "## Issue-19 target (batch 1)", "", "| target | result | met |", "|---|---|---|",
                  f"| decode >= {MOE_TARGET_PERCENT_OF_FLOOR:.0f}% of the weight floor | {percent:.1f}% "
                  f"({one['decode_tokens_per_s']:.1f} tok/s; the floor {1e3 / floor_ms:.1f}) | "
                  f"{'yes' if percent >= MOE_TARGET_PERCENT_OF_FLOOR else 'no'} |"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--config", default="9b", choices=PRESETS)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--hf-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-hf", dest="hf", action="store_false")
    parser.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="fuselm's Gated DeltaNet recurrent states in the cache (HF keeps fp32)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.hf_new_tokens = min(args.hf_new_tokens, args.new_tokens)
    if args.new_tokens < 2 or args.hf_new_tokens < 2:
        raise SystemExit("--new-tokens and --hf-new-tokens: at least 2 (one decode step)")
    args.batch = sorted(set(args.batch))
    config = preset_config(args.config)
    import triton

    meta = {"config": CONFIG_NAMES.get(args.config, f"{args.config} (built-in)"),
            "dtype": str(args.dtype)[6:], "state_dtype": args.state_dtype,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "command": "python3 " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "transformers": package_version("transformers"),
            "fla": package_version("fla-core", "flash-linear-attention"), "causal_conv1d": package_version("causal-conv1d"),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats}
    if device.type == "cuda":
        meta["copy_tbps"] = copy_bandwidth()
    started = time.perf_counter()
    ours = run_fuselm(config, args, device)
    if device.type == "cuda":
        meta["weight_floor_ms_per_step"] = ours["weight_bytes_per_step"] / (meta["copy_tbps"] * 1e12) * 1e3
    hf = run_hf(config, args, device) if args.hf else None
    meta["total_s"] = time.perf_counter() - started
    text = markdown(meta, ours, hf)
    print("\n" + text)
    out = results_dir(args.out) if device.type == "cuda" or args.out else None
    if out is not None:
        name = "qwen35_moe" if config.is_moe else "qwen35"
        (out / f"{name}.md").write_text(text)
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "fuselm": ours, "hf": hf}, indent=1))
        print(f"wrote {out / name}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
