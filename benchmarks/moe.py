"""The Qwen3.5-MoE sparse block: fuselm's ``SwiGLUMoE`` against HF's ``Qwen3_5MoeSparseMoeBlock``
(grouped_mm experts path, as a user calls it) and the floor, at the 35B-A3B layer shape (GPU only).

    python benchmarks/moe.py [--tokens 1 8 64 256 4096 16384] [--skewed] [--profile] [--out DIR]
    python benchmarks/moe.py --sweep [--tokens 1 8 64] [--out DIR]     -> moe_sweep.md / .json
    python benchmarks/moe.py --sweep-route [--out DIR]                 -> moe_route_sweep.md / .json
    python benchmarks/moe.py --sweep-decode [--out DIR]                -> moe_decode_sweep.md / .json

H 2048, E 256, k 8, F 512, F_s 512, bf16, random weights. Per token count: GPU time of one call
replayed from a CUDA graph (fuselm; do_bench median), HF's block as called (eager: its experts
path syncs on the host, so no graph), our unfused path (the same routing and pair list, then a
grouped gate/up GEMM without the activation, ``silu_mul``, the down GEMM: the epilogue's worth),
and the floor: max(weight bytes touched / copy bandwidth, FLOPs / matrix rate), both measured in
this run (a device copy; a bf16 mm of 8192^3). Weight bytes touched: the router, the experts the
routing hits (counted from it; for uniform routing about E (1 - (1 - k/E)^N)), the shared
expert. ``--skewed``: routing biased so half the tokens' picks fall on 16 experts (bytes counted
from the actual routing). Writes moe.md and moe.json under --out. ``--sweep``: each
kernel alone (graph replays) per token count: the routing, and the gate/up and down grouped GEMMs
at every tile config of SWEEP (features per program, K step, warps, stages) on the routing the
block uses at that count. ``--sweep-route``: the decode routing (one program) at 1, 8 and 16
tokens by its sort's variant, step width and warps. ``--sweep-decode``: at 1, 2, 4, 8, 16 tokens
the decode path's kernels (``decode.pair_gate_up``, ``decode.down_combine``) at every tile of
DECODE_SWEEP beside the grouped path's (16-row gate/up, down, combine) and the routing with and
without its sort: where the decode path pays, and its tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch

from fuselm.ops.moe import SwiGLUMoE, routing
from fuselm.ops.moe.decode import PairGemvConfig, down_combine, pair_gate_up, pair_gemv_config
from fuselm.ops.moe.grouped_gemm import GroupedGemmConfig, combine, expert_down, expert_gate_up, grouped_gemm_config
from fuselm.ops.moe.routing import route
from fuselm.ops.silu_mul import silu_mul
from fuselm.runtime import copy_bandwidth, matrix_rate
from timing import bench, graph_bench, kernel_breakdown

H, E, K, F_, F_S = 2048, 256, 8, 512, 512


def hf_block(experts_implementation: str = "grouped_mm", dtype=torch.bfloat16):
    """HF's block with its experts path ``experts_implementation`` ("grouped_mm", or "eager": the
    loop over experts), weights N(0, fan_in^-1/2)."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=H, moe_intermediate_size=F_, shared_expert_intermediate_size=F_S,
                                  num_experts=E, num_experts_per_tok=K)
    config._experts_implementation = experts_implementation
    with torch.device("cuda"):
        block = Qwen3_5MoeSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.eval()


def floor_ms(moe: SwiGLUMoE, experts_hit: float, tokens: int, bandwidth: float, rate: float) -> float:
    """max(weight bytes touched / bandwidth, FLOPs / rate) in ms."""
    elem = moe.w13.element_size()
    expert_bytes = (2 * F_ * H + H * F_) * elem
    bytes_ = (E + 1) * H * elem + (experts_hit + moe.num_shared) * expert_bytes
    flops = 2 * tokens * (E + 1) * H + 2 * tokens * (K + moe.num_shared) * 3 * F_ * H
    return max(bytes_ / bandwidth, flops / rate) * 1e3


def unfused(moe: SwiGLUMoE, x: torch.Tensor, x_per_pair: torch.Tensor):
    """Routing, down GEMM and combine as fuselm's; gate/up as a grouped GEMM with no epilogue
    writing [P, 2F] (``expert_down`` on w13, reading ``x_per_pair`` [N S, H], x repeated per slot,
    made outside the timing), then ``silu_mul``, then the down GEMM."""
    routed = route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 64, num_experts=moe.num_experts)
    pairs = routed.sorted_pairs, routed.block_experts
    gu = expert_down(x_per_pair, moe.w13, *pairs, 64)  # [P, 2F], gate/up interleaved
    h = silu_mul(gu[:, 0::2], gu[:, 1::2])
    return combine(expert_down(h, moe.w2, *pairs, 64), routed.weights, x.dtype)


SWEEP = {"block_n": (32, 64, 128, 256), "block_k": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4)}


def sweep_configs(block_m: int):
    """The SWEEP tiles worth timing at block_m rows: 32 features only at decode's 16 rows (more
    programs over the few experts' weights), 256 only past it."""
    for values in itertools.product(*SWEEP.values()):
        if (values[0] == 32 and block_m > 16) or (values[0] == 256 and block_m <= 16):
            continue
        yield GroupedGemmConfig(*values)


def sweep_route(moe: SwiGLUMoE, out: Path) -> None:
    """The decode routing (one program routes and sorts) at 1, 8 and 16 tokens: the pairwise sort
    at each step width and warp count, and the one-hot sort (FEW_PAIRS 0) at its warps; then the
    routing at 64 and 4096 tokens by tokens per routing program and warps."""
    defaults = routing.FEW_PAIRS, routing.FEW_PAIRS_STEP, routing.FEW_PAIRS_WARPS
    lines = [f"## decode routing alone, 35B-A3B layer, bf16, {torch.cuda.get_device_name()} (us, graph replays; "
             f"default: pairwise, step {defaults[1]}, {defaults[2]} warps)", "",
             "| tokens | sort | step | warps | us |", "|---|---|---|---|---|"]
    results = []
    for tokens in (1, 8, 16):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        pairs_pad = 1 << (tokens * (moe.top_k + moe.num_shared) - 1).bit_length()
        variants = [("pairwise", step, warps) for step in (16, 32, 64, 128) if step <= pairs_pad
                    for warps in (1, 2, 4, 8)]
        for sort, step, warps in variants + [("one-hot", "-", "-")]:
            routing.FEW_PAIRS, routing.FEW_PAIRS_STEP, routing.FEW_PAIRS_WARPS = (
                (defaults[0], step, warps) if sort == "pairwise" else (0, *defaults[1:]))
            us = 1e3 * graph_bench(lambda: route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 16,
                                                 num_experts=moe.num_experts))
            results.append({"tokens": tokens, "sort": sort, "step": step, "warps": warps, "us": us})
            lines.append(f"| {tokens} | {sort} | {step} | {warps} | {us:.1f} |")
    routing.FEW_PAIRS, routing.FEW_PAIRS_STEP, routing.FEW_PAIRS_WARPS = defaults
    defaults = routing.ROUTE_BLOCK_T, routing.ROUTE_WARPS
    lines += ["", f"Past {routing.DECODE_TOKENS} tokens (the routing kernel, then the three sort launches) by "
              f"tokens per routing program and warps (default {defaults[0]}, {defaults[1]}):", "",
              "| tokens | tokens a program | warps | us |", "|---|---|---|---|"]
    for tokens in (64, 4096):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        for block_t in (2, 4, 8, 16):
            for warps in (1, 2, 4, 8):
                routing.ROUTE_BLOCK_T, routing.ROUTE_WARPS = block_t, warps
                us = 1e3 * graph_bench(lambda: route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 64,
                                                     num_experts=moe.num_experts))
                results.append({"tokens": tokens, "block_t": block_t, "warps": warps, "us": us})
                lines.append(f"| {tokens} | {block_t} | {warps} | {us:.1f} |")
    routing.ROUTE_BLOCK_T, routing.ROUTE_WARPS = defaults
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_route_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "moe_route_sweep.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


# The decode kernels' tiles: features a program, K step, warps, stages.
# (Stages are left at 1: Triton does not pipeline these plain loads, 1 and 3 timed the same.)
DECODE_SWEEP = {"block": (4, 8, 16, 32), "block_k": (128, 256, 512), "num_warps": (2, 4, 8), "num_stages": (1,)}


def decode_configs(kind: str):
    """DECODE_SWEEP's tiles for ``kind`` whose fp32 accumulator (2 block x block_k for gate/up)
    stays within 64 registers a thread."""
    for block, block_k, warps, stages in itertools.product(*DECODE_SWEEP.values()):
        if (2 * block if kind == "gate_up" else block) * block_k <= 64 * 32 * warps:
            yield PairGemvConfig(block, block_k, warps, stages)


def sweep_decode(moe: SwiGLUMoE, out: Path) -> None:
    """The decode path's two kernels at every tile, beside the grouped path's three kernels and
    the routing with / without its sort, at 1 to 16 tokens (graph replays, us)."""
    slots = moe.top_k + moe.num_shared
    results = []
    lines = [f"## MoE decode kernels alone, 35B-A3B layer, bf16, {torch.cuda.get_device_name()} "
             f"(us, graph replays)", "",
             "| tokens | route + sort | route, no sort | grouped gate/up | grouped down | combine | grouped sum | "
             "pair_gate_up (default / best) | down_combine (default / best) | decode sum (best) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    bests = []
    for tokens in (1, 2, 4, 8, 16):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        routed = route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 16, num_experts=moe.num_experts)
        pairs = routed.sorted_pairs, routed.block_experts
        h = expert_gate_up(x, moe.w13, *pairs, slots, moe.activation, 16)
        y = expert_down(h, moe.w2, *pairs, 16)
        us = lambda fn: 1e3 * graph_bench(fn)  # noqa: E731
        row = {"tokens": tokens,
               "route_sort": us(lambda: route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 16,
                                              num_experts=moe.num_experts)),
               "route_no_sort": us(lambda: route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 16,
                                                 num_experts=moe.num_experts, sort=False)),
               "grouped_gate_up": us(lambda: expert_gate_up(x, moe.w13, *pairs, slots, moe.activation, 16, out=h)),
               "grouped_down": us(lambda: expert_down(h, moe.w2, *pairs, 16, out=y)),
               "combine": us(lambda: combine(y, routed.weights, x.dtype)),
               "gate_up": {}, "down": {}}
        for kind in ("gate_up", "down"):
            row[f"{kind}_default"] = str(pair_gemv_config(kind, x.dtype, x.device, tokens))
            for cfg in decode_configs(kind):
                fn = ((lambda: pair_gate_up(x, moe.w13, routed.experts, moe.activation, out=h, config=cfg))
                      if kind == "gate_up" else
                      (lambda: down_combine(h, moe.w2, routed.experts, routed.weights, x.dtype, config=cfg)))
                name = "f{} k{} w{} s{}".format(*dataclasses.astuple(cfg))
                try:
                    row[kind][name] = us(fn)
                except Exception as exc:  # shared memory or registers exceeded at some tiles
                    row[kind][name] = type(exc).__name__
            row[f"{kind}_default_us"] = us(
                (lambda: pair_gate_up(x, moe.w13, routed.experts, moe.activation, out=h)) if kind == "gate_up" else
                (lambda: down_combine(h, moe.w2, routed.experts, routed.weights, x.dtype)))
        best = {kind: min((v, k) for k, v in row[kind].items() if isinstance(v, float)) for kind in ("gate_up", "down")}
        grouped = row["grouped_gate_up"] + row["grouped_down"] + row["combine"]
        lines.append(f"| {tokens} | {row['route_sort']:.1f} | {row['route_no_sort']:.1f} | {row['grouped_gate_up']:.1f} | "
                     f"{row['grouped_down']:.1f} | {row['combine']:.1f} | {grouped:.1f} | "
                     f"{row['gate_up_default_us']:.1f} / {best['gate_up'][0]:.1f} | "
                     f"{row['down_default_us']:.1f} / {best['down'][0]:.1f} | "
                     f"{best['gate_up'][0] + best['down'][0]:.1f} |")
        bests.append((tokens, row))
        results.append(row)
        print(lines[-1], flush=True)
    for tokens, row in bests:
        for kind in ("gate_up", "down"):
            timed = sorted((v, k) for k, v in row[kind].items() if isinstance(v, float))
            lines += ["", f"{tokens} tokens, {kind}, default {row[f'{kind}_default']}; the 6 fastest of "
                      f"{len(row[kind])}:", "", "| tile | us |", "|---|---|"] + [f"| {k} | {v:.1f} |" for v, k in timed[:6]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_decode_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "moe_decode_sweep.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


def sweep(moe: SwiGLUMoE, token_counts, out: Path) -> None:
    """Each grouped GEMM alone at every SWEEP tile config, and the routing, per token count and
    row tile (16 rows below 64 tokens, 16 and 64 to 1023, 64 and 128 from 1024)."""
    slots = moe.top_k + moe.num_shared
    results = []
    cases = [(tokens, block_m) for tokens in token_counts
             for block_m in ((16,) if tokens < 64 else (16, 64) if tokens < 1024 else (64, 128))]
    for tokens, block_m in cases:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        routed = route(x, moe.router_with_gate, moe.top_k, moe.num_shared, block_m, num_experts=moe.num_experts)
        pairs = routed.sorted_pairs, routed.block_experts
        h = expert_gate_up(x, moe.w13, *pairs, slots, moe.activation, block_m)
        route_ms = graph_bench(
            lambda: route(x, moe.router_with_gate, moe.top_k, moe.num_shared, block_m, num_experts=moe.num_experts))
        row = {"tokens": tokens, "block_m": block_m, "route_ms": route_ms, "gate_up": {}, "down": {}}
        for kind in ("gate_up", "down"):
            row[f"{kind}_default"] = str(grouped_gemm_config(kind, x.dtype, block_m))
            for cfg in sweep_configs(block_m):
                values = dataclasses.astuple(cfg)
                fn = ((lambda: expert_gate_up(x, moe.w13, *pairs, slots, moe.activation, block_m, out=h, config=cfg))
                      if kind == "gate_up" else
                      (lambda: expert_down(h, moe.w2, *pairs, block_m, config=cfg)))
                try:
                    row[kind]["n{} k{} w{} s{}".format(*values)] = graph_bench(fn)
                except Exception as exc:  # shared memory or registers exceeded at some tiles
                    row[kind]["n{} k{} w{} s{}".format(*values)] = type(exc).__name__
        results.append(row)
        print(tokens, "route", row["route_ms"], flush=True)
    lines = [f"## SwiGLUMoE kernels alone, 35B-A3B layer, bf16, {torch.cuda.get_device_name()} (ms, graph replays)", ""]
    for row in results:
        lines.append(f"### {row['tokens']} tokens (block_m {row['block_m']}): routing {row['route_ms']:.4f} ms")
        for kind in ("gate_up", "down"):
            timed = sorted((v, k) for k, v in row[kind].items() if isinstance(v, float))
            lines += ["", f"{kind}, default {row[f'{kind}_default']}; the 8 fastest of {len(row[kind])}:", "",
                      "| tile | ms |", "|---|---|"] + [f"| {k} | {v:.4f} |" for v, k in timed[:8]]
        lines.append("")
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "moe_sweep.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 4096, 16384])
    parser.add_argument("--skewed", action="store_true")
    parser.add_argument("--out", default=".")
    parser.add_argument("--profile", action="store_true",
                        help="also each kernel's GPU time per call (torch.profiler, eager calls): moe_kernels.md")
    parser.add_argument("--sweep", action="store_true", help="the kernels' tile configs alone: moe_sweep.md")
    parser.add_argument("--sweep-route", action="store_true",
                        help="the decode routing's sort variants at 1, 8, 16 tokens: moe_route_sweep.md")
    parser.add_argument("--sweep-decode", action="store_true",
                        help="the decode path's kernels by tile at 1-16 tokens beside the grouped path's: "
                             "moe_decode_sweep.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    block = hf_block()
    moe = SwiGLUMoE.from_hf(block)
    if args.sweep_decode:
        return sweep_decode(moe, Path(args.out))
    if args.sweep_route:
        return sweep_route(moe, Path(args.out))
    if args.sweep:
        return sweep(moe, args.tokens, Path(args.out))
    bandwidth, rate = copy_bandwidth() * 1e12, matrix_rate() * 1e12  # bytes/s, FLOP/s
    rows, profiles = [], []
    for tokens in args.tokens:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        if args.skewed:  # half the tokens lean towards experts 0..15
            lean = moe.router_with_gate[:16].float().mean(0)
            x[: tokens // 2] += (4 * lean / lean.norm()).to(x.dtype)
        routed = route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 64, num_experts=moe.num_experts)
        hit = int(routed.experts[:, : moe.top_k].unique().numel())
        ours = graph_bench(lambda: moe(x))
        with torch.no_grad():
            hf = bench(lambda: block(x[None]))
        x_per_pair = x.repeat_interleave(moe.top_k + moe.num_shared, 0)
        plain = graph_bench(lambda: unfused(moe, x, x_per_pair))
        floor = floor_ms(moe, hit, tokens, bandwidth, rate)
        if args.profile:
            kernels = kernel_breakdown(lambda: moe(x))
            profiles.append(f"### {tokens} tokens: GPU us per call\n\n| kernel | us |\n|---|---|\n" + "\n".join(
                f"| {name} | {us} |" for name, us in sorted(kernels.items(), key=lambda item: -item[1])))
        rows.append({"tokens": tokens, "experts_hit": hit, "fuselm_ms": ours, "hf_ms": hf, "unfused_ms": plain,
                     "floor_ms": floor, "pct_of_floor": 100 * floor / ours, "vs_hf": hf / ours,
                     "vs_unfused": plain / ours, "tflops": 2 * tokens * (K + moe.num_shared) * 3 * F_ * H / ours / 1e9})
    name = torch.cuda.get_device_name()
    lines = [f"## SwiGLUMoE vs HF Qwen3_5MoeSparseMoeBlock, 35B-A3B layer (H {H}, E {E}, k {K}, F {F_}, F_s {F_S}), "
             f"bf16, {name}{', skewed routing' if args.skewed else ''}",
             f"copy {bandwidth / 1e12:.2f} TB/s, bf16 mm {rate / 1e12:.0f} TFLOP/s (this run)", "",
             "| tokens | experts hit | fuselm (graph) ms | % of floor | HF ms | vs HF | unfused ms | vs unfused | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['experts_hit']} | {r['fuselm_ms']:.4f} | {r['pct_of_floor']:.0f}% | "
                     f"{r['hf_ms']:.4f} | {r['vs_hf']:.2f}x | {r['unfused_ms']:.4f} | {r['vs_unfused']:.2f}x | "
                     f"{r['tflops']:.0f} |")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_skewed" if args.skewed else ""
    (out / f"moe{suffix}.md").write_text(text + "\n")
    if profiles:
        (out / f"moe_kernels{suffix}.md").write_text("\n\n".join(profiles) + "\n")
        print("\n\n".join(profiles))
    (out / f"moe{suffix}.json").write_text(json.dumps({"device": name, "bandwidth": bandwidth, "rate": rate,
                                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
