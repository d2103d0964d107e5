"""The gate/up GEMM with SwiGLU and the whole SwiGLU MLP at the Llama-8B shape (D=4096,
F=14336, bf16), against cuBLAS (+ Liger silu_mul) and Liger's fused MLP, in one run.

    python benchmarks/mlp.py [--sweep] [--out DIR]

GPU time is do_bench of the call replayed from a CUDA graph (see benchmarks/ops.py), the median of
three rounds that each time every provider once (``timing.interleaved_graph_bench``); the matrix
rate (8192^3 bf16 torch.mm) and the copy bandwidth are measured in the same run. Writes
``mlp.md``, ``mlp.json``, ``mlp.png``. ``--sweep`` also times the kernels' tile configs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from fuselm import gemm_swiglu, interleave_gate_up, silu_mul, swiglu_mlp
from fuselm.ops.common.activation import Activation
from fuselm.ops.swiglu_mlp.kernels import GemmConfig, GemvConfig, decode_gemv_kernel, gemm_swiglu_kernel
from fuselm.runtime import copy_bandwidth, matrix_rate
from timing import bench, graph_bench, interleaved_graph_bench, results_dir

try:
    from liger_kernel.ops.mlp import LigerMLPFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
except ImportError:
    LigerMLPFunction = LigerSiLUMulFunction = None

D, FF = 4096, 14336
DT = torch.bfloat16


def make_weights():
    """w_gate, w_up, fuselm's interleaved w13, and the concatenated [2F, D] weight the cuBLAS
    baselines use (gate columns then up columns of the product)."""
    wg, wu = (torch.randn(FF, D, device="cuda", dtype=DT) * D**-0.5 for _ in range(2))
    w2 = torch.randn(D, FF, device="cuda", dtype=DT) * FF**-0.5
    return wg, wu, interleave_gate_up(wg, wu), w2, torch.cat([wg, wu])


SKIPPED: dict[str, str] = {}


def runnable(providers: dict) -> dict:
    """The providers whose first (eager) call succeeds; a failure is recorded in SKIPPED."""
    ok = {}
    for name, fn in providers.items():
        try:
            fn()
            ok[name] = fn
        except Exception as error:  # e.g. a comparison library that rejects a shape
            SKIPPED[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return ok


def gemm_providers(x, w13, w_flat):
    p = {
        "fuselm gemm_swiglu": lambda: gemm_swiglu(x, w13),
        "cuBLAS mm alone": lambda: x @ w_flat.T,
        "cuBLAS + fuselm silu_mul": lambda: (lambda gu: silu_mul(gu[:, :FF], gu[:, FF:]))(x @ w_flat.T),
    }
    if LigerSiLUMulFunction is not None:
        p["cuBLAS + Liger silu_mul"] = lambda: (lambda gu: LigerSiLUMulFunction.apply(gu[:, :FF], gu[:, FF:]))(x @ w_flat.T)
    return p


def mlp_providers(x, wg, wu, w13, w2):
    p = {
        "fuselm swiglu_mlp": lambda: swiglu_mlp(x, w13, w2),
        "eager cuBLAS MLP": lambda: (F.silu(x @ wg.T) * (x @ wu.T)) @ w2.T,
    }
    if LigerMLPFunction is not None:
        # Liger's MLP takes [B, S, dim] input.
        p["Liger LigerMLPFunction"] = lambda: LigerMLPFunction.apply(x.unsqueeze(0), wg, wu, w2)
    return p


def peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def training_step(m, w13, w2, w_cat):
    """Forward + backward at M tokens: fuselm swiglu_mlp vs eager cuBLAS with a silu_mul kernel.
    Per provider: time of one step, peak extra memory during it, and the memory its forward holds
    until the backward (what each layer of a model keeps), output included."""
    x = torch.randn(m, D, device="cuda", dtype=DT)
    dy = torch.randn(m, D, device="cuda", dtype=DT)
    w13p, w2p, w_cat_p = (w.clone().requires_grad_(True) for w in (w13, w2, w_cat))
    xg = x.clone().requires_grad_(True)

    def unfused(act):
        return lambda: (lambda gu: act(gu[:, :FF], gu[:, FF:]) @ w2p.T)(xg @ w_cat_p.T)

    forwards = {"fuselm swiglu_mlp": lambda: swiglu_mlp(xg, w13p, w2p),
                "eager cuBLAS + fuselm silu_mul": unfused(silu_mul)}
    if LigerSiLUMulFunction is not None:
        forwards["eager cuBLAS + Liger silu_mul"] = unfused(LigerSiLUMulFunction.apply)
    out = {}
    for name, forward in forwards.items():
        def step():
            forward().backward(dy)

        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = forward()
        saved = torch.cuda.memory_allocated() - base
        del y
        out[name] = {"ms": bench(step), "peak_gb": peak_bytes(step) / 1e9, "saved_gb": saved / 1e9}
        xg.grad = w13p.grad = w2p.grad = w_cat_p.grad = None
    return out


def sweep(w13, w2):
    rows = []
    act = Activation()
    for m in (4096,):
        x = torch.randn(m, D, device="cuda", dtype=DT)
        h = torch.empty(m, FF, device="cuda", dtype=DT)
        for cfg in [GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 128, 32, 8, 8, 4),
                    GemmConfig(128, 64, 64, 8, 4, 4), GemmConfig(128, 64, 64, 8, 8, 4), GemmConfig(64, 128, 64, 8, 4, 4),
                    GemmConfig(128, 128, 64, 16, 8, 3), GemmConfig(256, 64, 64, 8, 8, 3)]:
            try:
                ms = bench(lambda: gemm_swiglu_kernel(x, w13, act, h, config=cfg))
            except Exception as error:  # out of shared memory / registers: recorded, not fatal
                rows.append({"kernel": "gemm", "m": m, "config": str(cfg), "error": str(error)[:80]})
                continue
            rows.append({"kernel": "gemm", "m": m, "config": str(cfg), "ms": ms,
                         "tflops": 2 * m * D * 2 * FF / ms / 1e9})
            print(rows[-1], flush=True)
    for m in (1, 16):
        x = torch.randn(m, D, device="cuda", dtype=DT)
        h = torch.empty(m, FF, device="cuda", dtype=DT)
        y = torch.empty(m, D, device="cuda", dtype=DT)
        for kernel, configs, fn_of, nbytes in (
            ("gemv gate/up", [GemvConfig(64, 128, 4, 4), GemvConfig(64, 128, 4, 3), GemvConfig(32, 256, 4, 4), GemvConfig(32, 128, 4, 5)],
             lambda cfg: (lambda: decode_gemv_kernel(x, w13, h, act, config=cfg)), 2 * FF * D * 2),
            ("gemv down", [GemvConfig(32, 512, 4, 3), GemvConfig(16, 512, 4, 4), GemvConfig(16, 1024, 4, 3), GemvConfig(32, 256, 8, 5)],
             lambda cfg: (lambda: decode_gemv_kernel(h, w2, y, config=cfg)), FF * D * 2),
        ):
            for cfg in configs:
                try:
                    ms = graph_bench(fn_of(cfg))
                except Exception as error:
                    rows.append({"kernel": kernel, "m": m, "config": str(cfg), "error": str(error)[:80]})
                    continue
                rows.append({"kernel": kernel, "m": m, "config": str(cfg), "ms": ms, "tbps": nbytes / ms / 1e9})
                print(rows[-1], flush=True)
    return rows


SMALL_M_CONFIGS = [GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 64, 64, 8, 4, 4),
                   GemmConfig(128, 64, 64, 8, 8, 4), GemmConfig(128, 64, 64, 8, 4, 3), GemmConfig(64, 128, 64, 8, 4, 4),
                   GemmConfig(64, 128, 64, 8, 4, 3), GemmConfig(64, 64, 64, 8, 4, 4), GemmConfig(64, 256, 64, 8, 8, 3),
                   GemmConfig(128, 64, 128, 8, 8, 3), GemmConfig(64, 128, 128, 8, 8, 3)]


def sweep_small_m(ms, ffn: int):
    """The gate/up GEMM + SwiGLU at a mixed step's token counts (a running batch's decode rows
    plus a prompt chunk: 96-512 tokens), hidden D and ``ffn`` F (Qwen3.5-9B: 12288), every
    config of SMALL_M_CONFIGS beside cuBLAS mm + silu_mul; CUDA-graph replay, do_bench median.
    At these M the grid is a few waves of SMs: the tile shape sets how full the last one is."""
    wg, wu = (torch.randn(ffn, D, device="cuda", dtype=DT) * D**-0.5 for _ in range(2))
    w13, w_cat = interleave_gate_up(wg, wu), torch.cat([wg, wu])
    act, rows = Activation(), []
    for m in ms:
        x = torch.randn(m, D, device="cuda", dtype=DT)
        h = torch.empty(m, ffn, device="cuda", dtype=DT)
        flops = 2 * m * D * 2 * ffn
        cublas = graph_bench(lambda: (lambda gu: silu_mul(gu[:, :ffn], gu[:, ffn:]))(x @ w_cat.T))
        rows.append({"kernel": f"cuBLAS + silu_mul, F={ffn}", "m": m, "config": "-", "ms": cublas, "tflops": flops / cublas / 1e9})
        print(rows[-1], flush=True)
        for cfg in SMALL_M_CONFIGS:
            try:
                ms_ = graph_bench(lambda: gemm_swiglu_kernel(x, w13, act, h, config=cfg))
            except Exception as error:  # out of shared memory / registers: recorded, not fatal
                rows.append({"kernel": f"gemm, F={ffn}", "m": m, "config": str(cfg), "error": str(error)[:80]})
                continue
            rows.append({"kernel": f"gemm, F={ffn}", "m": m, "config": str(cfg), "ms": ms_, "tflops": flops / ms_ / 1e9})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-small-m", type=int, nargs="*", default=None,
                        help="only the gate/up GEMM tile sweep at these M (mixed-step sizes) with F=--ffn; writes mlp_small_m.md")
    parser.add_argument("--ffn", type=int, default=12288, help="F of --sweep-small-m (Qwen3.5-9B: 12288)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/mlp.py needs a CUDA device; nothing timed.")
        return 0
    gpu = torch.cuda.get_device_name()
    out = results_dir(args.out)
    if args.sweep_small_m:
        rows = sweep_small_m(args.sweep_small_m, args.ffn)
        lines = [f"# gate/up GEMM + SwiGLU at mixed-step sizes, D={D}, F={args.ffn}, bf16: {gpu}", "",
                 f"{datetime.date.today().isoformat()}; torch {torch.__version__}, triton {triton.__version__}. "
                 f"Command: `python {' '.join(sys.argv)}`. CUDA-graph replay, do_bench median.", "",
                 "| kernel | M | config | ms | rate |", "|---|---|---|---|---|"]
        lines += [f"| {s['kernel']} | {s['m']} | {s['config']} | {s.get('ms', float('nan')):.4f} | "
                  + (f"{s['tflops']:.0f} TFLOP/s" if "tflops" in s else s.get("error", "")) + " |" for s in rows]
        (out / "mlp_small_m.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    copy_tbps, tflops = copy_bandwidth(), matrix_rate()
    wg, wu, w13, w2, w_cat = make_weights()
    result = {"meta": {"gpu": gpu, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "triton": triton.__version__, "command": "python " + " ".join(sys.argv),
                       "copy_tbps": copy_tbps, "matrix_tflops": tflops}, "gemm": [], "mlp": []}
    if args.sweep:
        result["sweep"] = sweep(w13, w2)
    for m in (1, 16, 128, 1024, 4096, 8192):
        x = torch.randn(m, D, device="cuda", dtype=DT)
        providers = runnable(gemm_providers(x, w13, w_cat))
        ms = interleaved_graph_bench(providers)
        peak = {name: peak_bytes(providers[name]) for name in ("fuselm gemm_swiglu", "cuBLAS + fuselm silu_mul")}
        result["gemm"].append({"m": m, "ms": ms, "peak_bytes": peak})
        print("gemm", m, {k: round(v, 4) for k, v in ms.items()}, flush=True)
    for m in (1, 4, 16, 128, 1024, 4096):
        x = torch.randn(m, D, device="cuda", dtype=DT)
        ms = interleaved_graph_bench(runnable(mlp_providers(x, wg, wu, w13, w2)))
        result["mlp"].append({"m": m, "ms": ms})
        print("mlp", m, {k: round(v, 4) for k, v in ms.items()}, flush=True)
    result["training_m4096"] = training_step(4096, w13, w2, w_cat)
    result["skipped"] = SKIPPED
    (out / "mlp.json").write_text(json.dumps(result, indent=1))
    text = render(result)
    (out / "mlp.md").write_text(text)
    plot(result, out / "mlp.png")
    print(text)
    return 0


def render(r) -> str:
    meta = r["meta"]
    weight_bytes = 3 * FF * D * 2
    lines = [f"# SwiGLU GEMM and MLP, Llama-8B shape (D={D}, F={FF}), bf16: {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`.",
             f"Measured in this run: copy {meta['copy_tbps']:.2f} TB/s, bf16 mm 8192^3 {meta['matrix_tflops']:.0f} TFLOP/s.",
             "GPU time per call (CUDA-graph replay, do_bench median), ms.", "",
             "## gate/up GEMM + SwiGLU: h = silu(x Wg^T) * (x Wu^T)", ""]
    names = sorted({n for row in r["gemm"] for n in row["ms"]})
    lines += ["| M | " + " | ".join(names) + " | fuselm TFLOP/s | % of mm alone | vs cuBLAS+Liger | fuselm peak MB | unfused peak MB |",
              "|---|" + "---|" * (len(names) + 5)]
    for row in r["gemm"]:
        t, m = row["ms"], row["m"]
        fus = t["fuselm gemm_swiglu"]
        liger = t.get("cuBLAS + Liger silu_mul")
        lines.append(f"| {m} | " + " | ".join(f"{t[n]:.4f}" if n in t else "-" for n in names)
                     + f" | {2 * m * D * 2 * FF / fus / 1e9:.0f} | {100 * t['cuBLAS mm alone'] / fus:.0f}% | "
                     + (f"{liger / fus:.2f}" if liger else "-")
                     + f" | {row['peak_bytes']['fuselm gemm_swiglu'] / 1e6:.0f} | {row['peak_bytes']['cuBLAS + fuselm silu_mul'] / 1e6:.0f} |")
    m1 = r["gemm"][0]["ms"]["fuselm gemm_swiglu"]
    lines += ["", f"M=1: weight bytes {2 * FF * D * 2 / 1e6:.0f} MB in {m1:.4f} ms = {2 * FF * D * 2 / m1 / 1e9:.2f} TB/s "
              f"({100 * 2 * FF * D * 2 / m1 / 1e9 / meta['copy_tbps']:.0f}% of copy).", "",
              "## Whole MLP (gate, up, SwiGLU, down)", ""]
    names = sorted({n for row in r["mlp"] for n in row["ms"]})
    floor = weight_bytes / meta["copy_tbps"] / 1e9
    lines += [f"Weight-streaming floor: {weight_bytes / 1e6:.0f} MB / copy = {floor:.4f} ms.", "",
              "| M | " + " | ".join(names) + " | vs eager | vs Liger | % of floor |", "|---|" + "---|" * (len(names) + 3)]
    for row in r["mlp"]:
        t = row["ms"]
        fus = t["fuselm swiglu_mlp"]
        liger = t.get("Liger LigerMLPFunction")
        lines.append(f"| {row['m']} | " + " | ".join(f"{t[n]:.4f}" if n in t else "-" for n in names)
                     + f" | {t['eager cuBLAS MLP'] / fus:.2f} | " + (f"{liger / fus:.2f}" if liger else "-")
                     + f" | {100 * floor / fus:.0f}% |")
    lines += ["", "## Training step (forward + backward) at M=4096", "",
              "Peak: extra memory during one forward + backward. Saved: memory a forward holds until its",
              "backward (the activations kept per layer in a model), output included.", "",
              "| provider | ms | peak GB | saved GB |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['ms']:.3f} | {v['peak_gb']:.2f} | {v['saved_gb']:.3f} |"
              for k, v in r["training_m4096"].items()]
    if r.get("skipped"):
        lines += ["", "Providers that failed their first call (not timed):", ""]
        lines += [f"- {k}: `{v}`" for k, v in r["skipped"].items()]
    if "sweep" in r:
        lines += ["", "## Tile sweep", "", "| kernel | M | config | ms | rate |", "|---|---|---|---|---|"]
        for s in r["sweep"]:
            rate = f"{s['tflops']:.0f} TFLOP/s" if "tflops" in s else (f"{s['tbps']:.2f} TB/s" if "tbps" in s else s.get("error", ""))
            lines.append(f"| {s['kernel']} | {s['m']} | {s['config']} | {s.get('ms', float('nan')):.4f} | {rate} |")
    return "\n".join(lines) + "\n"


def plot(r, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "gemm", "gate/up GEMM + SwiGLU"), (axes[1], "mlp", "whole MLP")):
        for name in sorted({n for row in r[key] for n in row["ms"]}):
            rows = [row for row in r[key] if name in row["ms"]]
            ax.plot([row["m"] for row in rows], [row["ms"][name] for row in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("GPU time, ms")
        ax.set_title(f"{title}, D={D} F={FF}, bf16")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
