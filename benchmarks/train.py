"""Training step time and peak memory (issue 20; GPU only): HF transformers' Qwen3.5 as users train
it — with fla-core's Gated DeltaNet kernels when installed and liger-kernel's
``apply_liger_kernel_to_qwen3_5`` (the anchor) — against the same model patched by
``fuselm.patch_hf``; and the Gated DeltaNet chunk forward + backward against fla-core's.

    python benchmarks/train.py [--config 0.8b] [--batch 4] [--seq-len 4096] [--steps 6] [--gdn-lengths 4096 16384]
        [--variants fuselm liger hf] [--out DIR]

Step: forward with labels, backward, AdamW step, zero_grad, bf16 weights (AdamW states in bf16
as the parameters), random token ids (the data does not change the time). The first two steps
warm up (Triton JIT, autotuning, allocator); the median of the rest is reported, each step timed
with CUDA events; tokens/s = batch x seq_len / step. Peak memory: torch.cuda.max_memory_allocated
over the timed steps, after a reset (weights, gradients and optimizer states included).
GDN: q, k [1, T, 16, 128], v [1, T, 32, 128] (the 9B's heads), g, beta, bf16, l2-normalised q/k
in the kernel, do_bench median of forward + backward, fuselm's ``chunk_gated_delta_rule`` against
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``. Writes train.md and train.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from finetune_qwen35 import build_model  # noqa: E402  (the example's model: HF init, patched per variant)

try:
    from timing import bench  # run from benchmarks/ (PYTHONPATH)
except ImportError:  # pragma: no cover
    from benchmarks.timing import bench


def step_time(config_name: str, variant: str, batch: int, seq_len: int, steps: int) -> dict:
    model = build_model(config_name, variant, torch.bfloat16, "cuda", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 248320, (batch, seq_len), device="cuda")
    times = []
    for i in range(steps):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    timed = sorted(times[2:])
    ms = timed[len(timed) // 2]
    result = {"variant": variant, "step_ms": ms, "tokens_per_s": batch * seq_len / ms * 1e3,
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def gdn_fwd_bwd(T: int) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    from fuselm import chunk_gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(1, T, 16, 128), make(1, T, 16, 128), make(1, T, 32, 128)
    gate = -torch.rand(1, T, 32, device="cuda", generator=g).mul(0.5).to(torch.bfloat16)
    beta = torch.rand(1, T, 32, device="cuda", generator=g).to(torch.bfloat16)
    do = make(1, T, 32, 128)
    inputs = [t.requires_grad_() for t in (q, k, v, gate, beta)]

    def run(fn):
        def call():
            out = fn(*inputs, scale=128 ** -0.5, use_qk_l2norm_in_kernel=True)[0]
            out.backward(do)
        return bench(call)

    ours, fla = run(chunk_gated_delta_rule), run(fla_chunk)
    return {"T": T, "fuselm_ms": ours, "fla_ms": fla, "speedup": fla / ours}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="0.8b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gdn-lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--variants", nargs="+", default=["fuselm", "liger", "hf"])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    gdn = [gdn_fwd_bwd(T) for T in args.gdn_lengths]
    steps = [step_time(args.config, v, args.batch, args.seq_len, args.steps) for v in args.variants]
    lines = [f"## Training (issue 20), {name}, bf16", "",
             "### Gated DeltaNet chunk, forward + backward (q/k 16 heads, v 32 heads, dim 128)", "",
             "| T | fuselm ms | fla-core ms | speedup |", "|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['fuselm_ms']:.3f} | {r['fla_ms']:.3f} | {r['speedup']:.2f}x |" for r in gdn]
    lines += ["", f"### Training step, Qwen3.5 {args.config}, batch {args.batch} x {args.seq_len}, AdamW", "",
              "| variant | step ms | tokens/s | peak GB |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_gb']:.1f} |" for r in steps]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.md").write_text(text + "\n")
    (out / "train.json").write_text(json.dumps({"device": name, "args": vars(args), "gdn": gdn, "steps": steps},
                                               indent=1))


if __name__ == "__main__":
    main()
