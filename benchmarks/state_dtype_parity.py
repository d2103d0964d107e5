"""What a 16-bit Gated DeltaNet state costs in accuracy: decode logits against HF fp32.

Qwen3.5-9B config, random bf16 weights (``presets.random_hf_qwen35``, "spread" scheme), B prompts
of P random ids, then S forced tokens (random ids, the same for every path). The reference is HF
transformers in fp32 (the bf16 weights upcast) over the whole P + S sequence in one forward: the
model's exact logits at positions P - 1 .. P + S - 1. Beside it, each as a user runs it:
- HF bf16, the same one forward (its own distance from the exact model: the parity bar's yardstick);
- fuselm bf16 with fp32 recurrent states (the default, HF's numerics): prefill P, then S decode
  steps fed the forced tokens;
- fuselm bf16 with bf16 recurrent states (``state_dtype``, vLLM's default): the same.
Reports per decode step the logit cosine to HF fp32 (min over rows) and whether the argmax agrees,
summarised over the S steps; a JSON file and a markdown table.
Needs a GPU with ~60 GB and transformers (fla-core optional: HF's chunk kernel when installed).
Usage: PYTHONPATH=src python benchmarks/state_dtype_parity.py [--steps 64] [--out DIR]"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from fuselm.models.qwen35 import Qwen35
from fuselm.models.qwen35.presets import config_9b, random_hf_qwen35, tiny_config


def row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, S] cosine of each row's and position's logits (float64)."""
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """HF's logits at positions prompt_len - 1 .. end (one forward over the whole sequence), fp32."""
    return hf(ids).logits[:, prompt_len - 1:].float()


@torch.no_grad()
def fuselm_logits(model: Qwen35, ids: torch.Tensor, prompt_len: int, state_dtype: str) -> torch.Tensor:
    """fuselm's logits at the same positions: prefill the prompts, then one decode step per forced
    token (the engine's path: the decode kernels, states rounded into the cache's dtype)."""
    B, T = ids.shape
    cache = model.new_cache(B, T + 1, state_dtype=state_dtype)
    logits = [model.prefill(ids[:, :prompt_len], cache).float()]
    for t in range(prompt_len, T):
        logits.append(model.decode_step(ids[:, t].contiguous(), cache).float())
    return torch.stack(logits, dim=1)


def summary(cos: torch.Tensor, agree: torch.Tensor) -> dict:
    per_step = cos.min(dim=0).values  # the worst row at each position
    return {"cosine_min": per_step.min().item(), "cosine_mean": cos.mean().item(),
            "cosine_first": per_step[0].item(), "cosine_last": per_step[-1].item(),
            "argmax_agreement": agree.float().mean().item(), "per_step_min_cosine": per_step.tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a smoke test of this script)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    config = tiny_config() if args.tiny else config_9b()
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len + args.steps), generator=generator)
    ids = ids.to(device)
    hf = random_hf_qwen35(config, dtype=torch.bfloat16, device=device, seed=0)
    reference = hf_logits(hf.float(), ids, args.prompt_len)  # the bf16 weights upcast: exact
    hf = hf.bfloat16()
    paths = {"HF bf16": hf_logits(hf, ids, args.prompt_len)}
    model = Qwen35.from_hf(hf)
    del hf
    model_dtype = "bfloat16" if not args.tiny else "float32"
    model = model.to(getattr(torch, model_dtype))
    for state_dtype in ("float32", "bfloat16"):
        paths[f"fuselm {model_dtype}, {state_dtype} states"] = fuselm_logits(model, ids, args.prompt_len, state_dtype)
    target = reference.argmax(-1)
    results = {"config": "tiny" if args.tiny else "9B", "batch": args.batch, "prompt_len": args.prompt_len,
               "steps": args.steps, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
               "paths": {name: summary(row_cosines(logits, reference), logits.argmax(-1) == target)
                         for name, logits in paths.items()}}
    lines = [f"## Decode logits against HF fp32: {results['config']} config, random bf16 weights (spread), "
             f"{args.batch} x {args.prompt_len} prompt ids + {args.steps} forced tokens, {results['gpu']}", "",
             "Cosine of each position's logits to HF fp32 (one forward over the whole sequence), the worst row at "
             "each position: over the prefill's last position and the decode steps; argmax agreement with HF fp32.",
             "", "| path | min cosine | mean cosine | first position | last position | argmax agreement |",
             "|---|---|---|---|---|---|"]
    for name, s in results["paths"].items():
        lines.append(f"| {name} | {s['cosine_min']:.6f} | {s['cosine_mean']:.6f} | {s['cosine_first']:.6f} | "
                     f"{s['cosine_last']:.6f} | {100 * s['argmax_agreement']:.1f}% |")
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state_dtype_parity.json").write_text(json.dumps(results, indent=1))
    (out / "state_dtype_parity.md").write_text(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
