"""Where does the bf16 logit gap between fuselm and HF transformers come from?

Qwen3.5-9B config, random bf16 weights (fuselm.models.qwen35.presets), 4 prompts of 512 random
ids, prefill logits at a few positions. Runs fuselm's prefill with one component at a time
swapped for HF's own module on the same weights (the MLP, the Gated DeltaNet mixer, only the
DeltaNet's chunk kernel (fla-core's, as HF calls it), the attention mixer), and reports the
logit cosine of each variant against HF bf16 and against HF fp32 (the bf16 weights upcast).
A component whose swap closes the gap to HF bf16 is where fuselm's bf16 roundings differ from
HF's. Also, on layer 0's real inputs: the DeltaNet kernel's and the MLP's relative error of
fuselm and of HF/FLA against a float64/fp32 reference.
Needs a GPU with ~60 GB, transformers; fla-core optional (HF uses it when installed).
Usage: PYTHONPATH=src python benchmarks/qwen35_parity_sources.py [--out DIR]"""
import argparse
import importlib.util
import json
import os

import torch
import torch.nn.functional as F

import fuselm.models.qwen35.layers as qwen35_layers
import fuselm.models.qwen35.model as qwen35_model
import fuselm.ops.swiglu_mlp.op as swiglu_op
from fuselm.models.qwen35 import Qwen35
from fuselm.models.qwen35.presets import WEIGHT_SCHEMES, config_9b, random_hf_qwen35, tiny_config
from fuselm.ops.gated_delta_rule.naive import chunk_gated_delta_rule_ref
# HF's RMSNorm op for op (both rounding modes; add_rms_norm_ref: HF's bf16 residual add first)
from fuselm.ops.rms_norm.naive import add_rms_norm_ref, rms_norm_ref
from fuselm.testing import rel_err

POSITIONS = (0, 63, 255, 511)


def cosine(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def mismatch(a, b):
    """Fraction of elements that are not bit-equal."""
    return (a != b).float().mean().item()


def op_agreement(dev, D=4096, F_=12288, M=2048, hd=128, heads=32, dtype=torch.bfloat16):
    """fuselm's ops against HF's PyTorch code on identical bf16 inputs: the fraction of output
    elements that differ, and the relative difference."""
    from fuselm.ops.decode_linear import decode_linear
    from fuselm.ops.rms_norm import add_rms_norm, rms_norm
    from fuselm.ops.swiglu_mlp import interleave_gate_up, swiglu_mlp
    from fuselm.ops.swiglu_mlp.op import gemm_swiglu

    gen = torch.Generator(dev).manual_seed(1)
    bf = dtype

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(bf)

    out = {}
    x, r, w = randn(M, D, scale=3), randn(M, D, scale=5), randn(D, scale=0.3)
    out["rms_norm (zero-centered)"] = mismatch(rms_norm(x, w, 1e-6, 1.0), rms_norm_ref(x, w, 1e-6, 1.0))
    normed, s = add_rms_norm(x, r, w, 1e-6, 1.0)
    out["add_rms_norm residual"] = mismatch(s, r + x)
    out["add_rms_norm normed"] = mismatch(normed, rms_norm_ref(r + x, w, 1e-6, 1.0))
    out["rms_norm (offset 0)"] = mismatch(rms_norm(x, w, 1e-6, 0.0), rms_norm_ref(x, w, 1e-6, 0.0))
    wg, wu, w2 = randn(F_, D, scale=D ** -0.5), randn(F_, D, scale=D ** -0.5), randn(D, F_, scale=F_ ** -0.5)
    w13 = interleave_gate_up(wg, wu)
    for m in (M, 4):
        xm = x[:m]
        h_hf = F.silu(F.linear(xm, wg)) * F.linear(xm, wu)
        out[f"gemm_swiglu h, M={m}"] = mismatch(gemm_swiglu(xm, w13), h_hf)
        y_ref = F.linear(h_hf, w2)
        y = swiglu_mlp(xm, w13, w2)
        out[f"swiglu_mlp y, M={m}"] = mismatch(y, y_ref)
        out[f"swiglu_mlp y rel diff, M={m}"] = rel_err(y, y_ref)
    # decode_linear prologues (M = 4): HF's gated RMSNorm + out_proj, and attention's sigmoid gate + o_proj
    o, z, wn, wo = randn(4, heads, hd), randn(4, heads, hd), randn(hd, scale=0.3) + 1, randn(D, heads * hd, scale=0.02)
    gated = (rms_norm_ref(o, wn, 1e-6, 0.0).float() * F.silu(z.float())).to(bf)
    y_hf = F.linear(gated.flatten(1), wo)
    y = decode_linear(o.flatten(1), wo, prologue="gated_rms_norm", gate=z.flatten(1), norm_weight=wn, eps=1e-6,
                      head_dim=hd)
    out["decode_linear gated_rms_norm y"] = mismatch(y, y_hf)
    out["decode_linear gated_rms_norm y rel diff"] = rel_err(y, y_hf)
    a, gate = randn(4, heads * hd), randn(4, heads * hd)
    y_hf = F.linear(a * torch.sigmoid(gate), wo)
    y = decode_linear(a, wo, prologue="sigmoid_gate", gate=gate)
    out["decode_linear sigmoid_gate y"] = mismatch(y, y_hf)
    out["decode_linear sigmoid_gate y rel diff"] = rel_err(y, y_hf)
    out["F.linear vs F.linear on M=4 (cuBLAS, reference for rel diffs)"] = rel_err(
        F.linear(a, wo), (a.double() @ wo.double().T))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--weights", default="spread", choices=WEIGHT_SCHEMES)
    parser.add_argument("--skip-ops", action="store_true", help="skip the op-agreement table")
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a smoke test of this script)")
    args = parser.parse_args()
    has_fla = importlib.util.find_spec("fla") is not None
    print("fla installed:", has_fla, flush=True)
    dev = "cpu" if args.tiny else "cuda"
    config = tiny_config() if args.tiny else config_9b()
    hf = random_hf_qwen35(config, dtype=torch.float16 if args.tiny else torch.bfloat16, device=dev, seed=0,
                          weights=args.weights)
    B, T = (2, 40) if args.tiny else (4, 512)
    prompts = torch.randint(0, hf.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(dev)
    pos = [0, 17, 39] if args.tiny else list(POSITIONS)
    lm_head = hf.lm_head.weight

    def logits_of(hidden):  # final normed hidden [B, T, D] -> fp32 logits at POSITIONS
        return F.linear(hidden[:, pos], lm_head).float()

    results = {"positions": pos}
    results["weights"] = args.weights
    if not args.skip_ops:
        results["op_agreement"] = op_agreement(dev, 64, 96, 40, 16, 4, torch.float16) if args.tiny else op_agreement(dev)
    for name, value in results.get("op_agreement", {}).items():
        print(f"op agreement: {name}: {value:.3g}", flush=True)
    with torch.no_grad():
        ref_bf16 = logits_of(hf.model(prompts).last_hidden_state)
        model = Qwen35.from_hf(hf)
        hf_layers = hf.model.layers
        position_ids = torch.arange(T, device=dev).view(1, 1, -1).expand(3, B, T)
        rotary = hf.model.rotary_emb(torch.empty(1, dtype=hf.dtype, device=dev), position_ids)

        captured = {}
        ours_chunk = qwen35_layers.chunk_gated_delta_rule
        ours_mlp = swiglu_op.swiglu_mlp
        ours_norm, ours_add_norm = qwen35_model.rms_norm, qwen35_model.add_rms_norm
        layer_of_w13 = {id(layer.mlp.w13): i for i, layer in enumerate(model.layers)}

        def capturing_chunk(*a, **k):
            captured.setdefault("gdn", (a, k))
            return ours_chunk(*a, **k)

        def capturing_mlp(x, w13, w2, *a, **k):
            captured.setdefault("mlp", (x, w13, w2))
            return ours_mlp(x, w13, w2, *a, **k)

        def fla_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens=None):
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
            r = v.shape[2] // q.shape[2]
            return fla(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v, g, beta, scale=scale,
                       initial_state=initial_state, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_seqlens)

        def hf_mlp(x, w13, w2, *a, **k):
            return hf_layers[layer_of_w13[id(w13)]].mlp(x)

        def run(swap):
            """fuselm prefill logits with the components in ``swap`` taken from HF."""
            patched = []
            if "norms" in swap:
                qwen35_model.rms_norm, qwen35_model.add_rms_norm = rms_norm_ref, add_rms_norm_ref
                qwen35_layers.rms_norm = rms_norm_ref
            qwen35_layers.chunk_gated_delta_rule = fla_chunk if "gdn_kernel" in swap else capturing_chunk
            swiglu_op.swiglu_mlp = hf_mlp if "mlp" in swap else capturing_mlp
            for i, layer in enumerate(model.layers):
                mixer, hf_layer = layer.mixer, hf_layers[i]
                if "gdn" in swap and hasattr(hf_layer, "linear_attn"):
                    mixer.prefill = lambda x, cache, step, m=hf_layer.linear_attn: m(hidden_states=x)
                    patched.append(mixer)
                if "attn" in swap and hasattr(hf_layer, "self_attn"):
                    mixer.prefill = lambda x, cache, step, m=hf_layer.self_attn: m(
                        hidden_states=x, position_embeddings=rotary, attention_mask=None)[0]
                    patched.append(mixer)
            try:
                cache = model.new_cache(B, T)
                return logits_of(model._prefill(prompts, [T] * B, cache, torch.arange(B, device=dev)))
            finally:
                qwen35_layers.chunk_gated_delta_rule = ours_chunk
                swiglu_op.swiglu_mlp = ours_mlp
                qwen35_model.rms_norm, qwen35_model.add_rms_norm = ours_norm, ours_add_norm
                qwen35_layers.rms_norm = ours_norm
                for mixer in patched:
                    del mixer.prefill

        variants = {"fuselm": (), "mlp=HF": ("mlp",), "norms=HF": ("norms",), "attention=HF": ("attn",),
                    "deltanet=HF": ("gdn",), "all but deltanet=HF": ("mlp", "norms", "attn"),
                    "all=HF": ("mlp", "norms", "attn", "gdn")}
        if has_fla:
            variants["deltanet kernel=FLA"] = ("gdn_kernel",)
            variants["all but deltanet kernel=HF"] = ("mlp", "norms", "attn", "gdn_kernel")
        logits = {name: run(swap) for name, swap in variants.items()}

        # layer 0's DeltaNet kernel and MLP on their real inputs
        (q, k, v, g, beta, scale, *_), _ = captured["gdn"]
        ref_o, ref_s = chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g.float(), beta.float(), scale,
                                                  None, True, True)
        o, s = ours_chunk(q, k, v, g, beta, scale, None, True, True)
        kernel = {"fuselm o": rel_err(o, ref_o), "fuselm state": rel_err(s, ref_s)}
        if has_fla:
            fo, fs = fla_chunk(q, k, v, g, beta, scale, None, True, True)
            kernel.update({"fla o": rel_err(fo, ref_o), "fla state": rel_err(fs, ref_s),
                           "fuselm vs fla o": rel_err(o, fo)})
        x, w13, w2 = captured["mlp"]
        ref_y = ((F.silu(x.double() @ w13[0::2].double().T) * (x.double() @ w13[1::2].double().T)) @ w2.double().T)
        kernel.update({"mlp fuselm": rel_err(ours_mlp(x, w13, w2), ref_y), "mlp HF": rel_err(hf_layers[0].mlp(x), ref_y)})
        results["layer0_rel_err"] = kernel
        print("layer 0, rel err vs fp32/fp64:", json.dumps({k: round(v, 6) for k, v in kernel.items()}), flush=True)

        captured.clear()
        model = None  # frees its weights before HF goes to fp32
        torch.cuda.empty_cache()
        hf.float()
        ref_fp32 = logits_of(hf.model(prompts).last_hidden_state)

    table = {"HF bf16": {"vs HF bf16": 1.0, "vs HF fp32": cosine(ref_bf16, ref_fp32)}}
    for name, value in logits.items():
        table[name] = {"vs HF bf16": cosine(value, ref_bf16), "vs HF fp32": cosine(value, ref_fp32),
                       "vs HF bf16 per position": [cosine(value[:, i], ref_bf16[:, i]) for i in range(len(pos))]}
    results["cosine"] = table
    for name, row in table.items():
        per = row.get("vs HF bf16 per position")
        print(f"{name:32s} vs HF bf16 {row['vs HF bf16']:.6f}  vs HF fp32 {row['vs HF fp32']:.6f}"
              + (f"  per position {[round(c, 5) for c in per]}" if per else ""), flush=True)
    with open(os.path.join(args.out, f"qwen35_parity_sources_{args.weights.replace('-', '_')}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
