"""Is the bf16 logit gap to HF ours? Qwen3.5-9B config, random bf16 weights, 4 prompts of 512
random ids: last-position prefill logits of HF transformers in bf16, fuselm in bf16, and HF in
fp32 on the same weights (the bf16 model upcast); the cosine of each bf16 run against fp32.
Needs a GPU with ~60 GB and transformers (fla-core optional: HF uses it when installed).
Usage: PYTHONPATH=src python benchmarks/qwen35_parity_fp32.py"""
import torch, torch.nn.functional as F
from fuselm.models.qwen35 import Qwen35
from fuselm.models.qwen35_random import config_9b, random_hf_qwen35
import importlib.util
print("fla installed:", importlib.util.find_spec("fla") is not None)
dev = "cuda"
hf = random_hf_qwen35(config_9b(), dtype=torch.bfloat16, device=dev, seed=0)
prompts = torch.randint(0, 248000, (4, 512), generator=torch.Generator().manual_seed(0)).to(dev)
with torch.no_grad():
    hf_bf16 = hf(prompts, logits_to_keep=1).logits[:, -1].float()
    model = Qwen35.from_hf(hf)
    ours = model.prefill(prompts, model.new_cache(4, 512)).float()
    del model
    torch.cuda.empty_cache()
    hf.float()
    hf_fp32 = hf(prompts, logits_to_keep=1).logits[:, -1].float()
def cos(a, b):
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
def cos_rows(a, b):
    return [round(F.cosine_similarity(a[i], b[i], dim=0).item(), 6) for i in range(a.shape[0])]
print(f"cos(HF bf16, HF fp32) = {cos(hf_bf16, hf_fp32):.6f} rows {cos_rows(hf_bf16, hf_fp32)}")
print(f"cos(fuselm bf16, HF fp32) = {cos(ours, hf_fp32):.6f} rows {cos_rows(ours, hf_fp32)}")
print(f"cos(fuselm bf16, HF bf16) = {cos(ours, hf_bf16):.6f} rows {cos_rows(ours, hf_bf16)}")
print(f"max abs: HF bf16 vs fp32 {(hf_bf16 - hf_fp32).abs().max():.3f}, fuselm vs fp32 {(ours - hf_fp32).abs().max():.3f}, "
      f"logits up to {hf_fp32.abs().max():.2f}")
