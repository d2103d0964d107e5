"""The Qwen3.5-MoE sparse block: fuselm's ``SwiGLUMoE`` against HF's ``Qwen3_5MoeSparseMoeBlock``
(grouped_mm experts path, as a user calls it) and the floor, at the 35B-A3B layer shape (GPU only).

    python benchmarks/moe.py [--tokens 1 8 64 256 4096 16384] [--skewed] [--profile] [--out DIR]
    python benchmarks/moe.py --sweep [--tokens 1 8 64] [--out DIR]     -> moe_sweep.md / .json
    python benchmarks/moe.py --sweep-route [--out DIR]                 -> moe_route_sweep.md / .json
    python benchmarks/moe.py --sweep-decode [--out DIR]                -> moe_decode_sweep.md / .json

H 2048, E 256, k 8, F 512, F_s 512, bf16, random weights. Per token count: GPU time of one call
replayed from a CUDA graph (fuselm; do_bench median; the graph's own launch included), the same
per block with ``--layers`` blocks of distinct weights in one graph (as a model's decode graph
runs them: the graph's launch spread over them, no block's weights left in L2 by another), both
again with programmatic dependent launch off up to 16 tokens (the decode path), HF's block as
called (eager: its experts path syncs on the host, so no graph), our unfused path (the same
routing and pair list, then a grouped gate/up GEMM without the activation, ``silu_mul``, the down
GEMM: the epilogue's worth), and the floor: max(weight bytes touched / copy bandwidth, FLOPs /
matrix rate), both measured in this run (a device copy; a bf16 mm of 8192^3). Weight bytes
touched: the router, the experts the routing hits (counted from it; for uniform routing about
E (1 - (1 - k/E)^N)), the shared expert. ``--skewed``: routing biased so half the tokens' picks
fall on 16 experts (bytes counted from the actual routing). Writes moe.md and moe.json under
--out. ``--sweep``: each kernel alone (graph replays) per token count: the routing, and the
gate/up and down grouped GEMMs at every tile config of SWEEP (features per program, K step,
warps, stages) on the routing the block uses at that count; from 64-row blocks the pointer kernels'
default tile and the persistent TMA kernels at every tile of TMA_SWEEP. ``--sweep-route``: the routing kernel
and its sort at 1, 8 and 16 tokens by the sort's variant, step width and warps, and past 16
tokens the routing and placement kernels by tokens a step and warps, the whole routing by tokens a
chunk. ``--sweep-decode``: at 1, 2, 8, 16 tokens the decode path's three
kernels (``decode.router_logits``, ``pair_gate_up``, ``down_combine``) alone at every tile of
DECODE_SWEEP, the router beside cuBLAS's F.linear.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fuselm import runtime
from fuselm.ops.moe import SwiGLUMoE, routing
from fuselm.ops.moe.decode import PairGemvConfig, down_combine, pair_gate_up, router_logits
from fuselm.ops.moe.grouped_gemm import (TMA_MIN_BLOCK_M, GroupedGemmConfig, combine, expert_down, expert_gate_up,
                                         grouped_gemm_config)
from fuselm.ops.moe.op import PAIR_PATH_TOKENS
from fuselm.ops.moe.routing import route
from fuselm.ops.silu_mul import silu_mul
from timing import bench, graph_bench, graph_per_call_ms, kernel_breakdown

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


def unfused_inputs(moe: SwiGLUMoE, x: torch.Tensor):
    """(x_list, list_rows) for ``unfused``, made outside its timing: x's rows in the pair list's
    order ([P_max, H]: x[p // S] for entry p, sentinels row 0) and each entry's pair row (the
    routing is deterministic, so ``unfused`` routes x to the same list)."""
    routed = route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 64, num_experts=moe.num_experts)
    list_rows = routed.sorted_pairs.long().clamp(max=x.shape[0] * (moe.top_k + moe.num_shared) - 1)
    return x[list_rows // (moe.top_k + moe.num_shared)], list_rows


def unfused(moe: SwiGLUMoE, x: torch.Tensor, x_list: torch.Tensor, list_rows: torch.Tensor):
    """Routing, down GEMM and combine as fuselm's; gate/up as a grouped GEMM with no epilogue
    writing [N S, 2F] (``expert_down`` on w13, reading ``x_list``), then ``silu_mul``, an index copy
    of h into the list's order (``list_rows``), then the down GEMM."""
    routed = route(x, moe.router_with_gate, moe.top_k, moe.num_shared, 64, num_experts=moe.num_experts)
    pairs = routed.sorted_pairs, routed.block_experts
    num_pairs = routed.weights.numel()
    gu = expert_down(x_list, moe.w13, *pairs, 64, num_pairs)  # [N S, 2F], gate/up interleaved
    h = silu_mul(gu[:, 0::2], gu[:, 1::2])
    return combine(expert_down(h[list_rows], moe.w2, *pairs, 64, num_pairs), routed.weights, x.dtype)


SWEEP = {"block_n": (32, 64, 128, 256), "block_k": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4)}


# The persistent TMA kernels' tiles (from 64-row blocks): features, K step, warps, stages, blocks
# walking the features together (gate/up: at most 128 features, 256 weight rows a TMA box).
TMA_SWEEP = {
    "gate_up": [GroupedGemmConfig(128, 64, 8, stages, group) for stages in (3, 4) for group in (1, 2, 4, 8, 16)],
    "down": [GroupedGemmConfig(256, 64, 8, stages, group) for stages in (3, 4) for group in (1, 2, 4, 8, 16)],
}


def sweep_configs(block_m: int):
    """The SWEEP tiles worth timing at block_m rows: 32 features only at decode's 16 rows (more
    programs over the few experts' weights), 256 only past it."""
    for values in itertools.product(*SWEEP.values()):
        if (values[0] == 32 and block_m > 16) or (values[0] == 256 and block_m <= 16):
            continue
        yield GroupedGemmConfig(*values)


def sweep_route(moe: SwiGLUMoE, out: Path) -> None:
    """The decode routing (one program routes and sorts) at 1, 8 and 16 tokens: the pairwise sort
    at each step width and warp count, and the one-hot sort (FEW_PAIRS 0) at its warps; then past
    16 tokens the routing and placement kernels alone by step and warps, and the whole routing by
    tokens a chunk."""
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
    lines += ["", f"Past {routing.DECODE_TOKENS} tokens: the routing kernel (with counts) and the placement "
              f"kernel alone (us a call, 20 calls a graph), by tokens a step and warps, at {routing.ROUTE_CHUNK}-token "
              f"chunks (or more: at most {routing.ROUTE_MAX_CHUNKS} chunks; a step is at most a chunk); then the "
              "whole routing (router GEMM included, graph replays) by chunks at the fastest steps and warps:", "",
              "| tokens | kernel | step | warps | us |", "|---|---|---|---|---|"]
    E, k, ns, block_m = moe.num_experts, moe.top_k, moe.num_shared, 64
    names = {"route": ("ROUTE_STEP", "ROUTE_WARPS"), "place": ("PLACE_STEP", "PLACE_WARPS")}
    defaults = {name: tuple(getattr(routing, a) for a in attrs) for name, attrs in names.items()}
    relative = {name: {} for name in names}  # (step, warps) -> sum over token counts of us / fastest us
    for tokens in (64, 4096, 16384):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        logits = F.linear(x, moe.router_with_gate)
        r = route(x, moe.router_with_gate, k, ns, block_m, num_experts=E)
        counts = torch.empty(routing.counts_shape(tokens, E), dtype=torch.int32, device="cuda")
        launches = {
            "route": lambda: routing.route_kernel(logits, E, k, ns, r.weights, r.experts, r.sorted_pairs,
                                                  r.block_experts, block_m, counts),
            "place": lambda: routing.place_kernel(r.experts, counts, E, k, ns, block_m, r.sorted_pairs,
                                                  r.block_experts)}
        for name, attrs in names.items():
            times = {}
            for step, warps in itertools.product((4, 8, 16, 32), (1, 2, 4, 8)):
                setattr(routing, attrs[0], step)
                setattr(routing, attrs[1], warps)
                times[step, warps] = us = 1e3 * graph_per_call_ms(launches[name])
                results.append({"tokens": tokens, "kernel": name, "step": step, "warps": warps, "us": us})
                lines.append(f"| {tokens} | {name} | {step} | {warps} | {us:.1f} |")
            for (attr, value) in zip(attrs, defaults[name]):
                setattr(routing, attr, value)
            for key, us in times.items():
                relative[name][key] = relative[name].get(key, 0.0) + us / min(times.values())
    best = {name: min(relative[name], key=relative[name].get) for name in names}
    for name, attrs in names.items():
        for attr, value in zip(attrs, best[name]):
            setattr(routing, attr, value)
    chunk_default = routing.ROUTE_CHUNK, routing.ROUTE_MAX_CHUNKS
    lines += ["", f"Fastest over the three counts (sum of time / the count's fastest): route step {best['route'][0]}, "
              f"{best['route'][1]} warps; place step {best['place'][0]}, {best['place'][1]} warps. The whole routing "
              f"by tokens a chunk (ROUTE_CHUNK, at {chunk_default[1]} chunks at most) and by the most chunks "
              f"(ROUTE_MAX_CHUNKS, from {chunk_default[0]}-token chunks):", "",
              "| tokens | chunk | most chunks | us |", "|---|---|---|---|"]
    variants = [(tokens, chunk, chunk_default[1]) for tokens in (64, 256) for chunk in (2, 4, 8, 16)]
    variants += [(tokens, chunk_default[0], most) for tokens in (4096, 16384) for most in (128, 256, 512, 1024)]
    for tokens, chunk, most in variants:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        routing.ROUTE_CHUNK, routing.ROUTE_MAX_CHUNKS = chunk, most
        us = 1e3 * graph_bench(lambda: route(x, moe.router_with_gate, k, ns, block_m, num_experts=E))
        results.append({"tokens": tokens, "chunk": chunk, "most_chunks": most, "us": us})
        lines.append(f"| {tokens} | {chunk} | {most} | {us:.1f} |")
    routing.ROUTE_CHUNK, routing.ROUTE_MAX_CHUNKS = chunk_default
    for name, attrs in names.items():
        for attr, value in zip(attrs, defaults[name]):
            setattr(routing, attr, value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_route_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "moe_route_sweep.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


# The decode kernels' tiles (``PairGemvConfig``): rows / features a program, K step, warps.
# (Stages are left at 1: Triton does not pipeline these plain loads, 1 and 3 timed the same.)
DECODE_SWEEP = {
    "router": [PairGemvConfig(rows, block_k, warps, 1) for rows in (1, 2, 4) for block_k in (512, 2048)
               for warps in (2, 4)],
    "gate_up": [PairGemvConfig(block, block_k, warps, 1) for block in (4, 8, 16) for block_k in (256, 512)
                for warps in (4, 8)],
    "down": [PairGemvConfig(block, block_k, warps, 1) for block in (4, 8, 16) for block_k in (256, 512)
             for warps in (4, 8)],
    "down_routing": [PairGemvConfig(block, 0, warps, 1) for block in (1, 2, 4, 8) for warps in (2, 4, 8)
                     if K * F_ * block <= 64 * 32 * warps],
}


def sweep_decode(moe: SwiGLUMoE, out: Path) -> None:
    """The decode path's kernels alone at every DECODE_SWEEP tile, the router beside cuBLAS's
    F.linear, gate/up writing the routing, down reading it and down routing itself, at 1 to 16
    tokens (graph replays of one kernel, us)."""
    E_, slots = moe.num_experts, moe.top_k + moe.num_shared
    us = lambda fn: 1e3 * graph_bench(fn)  # noqa: E731
    results = []
    lines = [f"## MoE decode kernels alone, 35B-A3B layer, bf16, {torch.cuda.get_device_name()} "
             f"(us, graph replays of one kernel)", "",
             "| tokens | router: cuBLAS | router (default / best) | pair_gate_up (default / best) | "
             "down_combine (default / best) | down_combine routing itself (default / best) |",
             "|---|---|---|---|---|---|"]
    for tokens in (1, 2, 8, 16):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        logits = router_logits(x, moe.router_with_gate)
        routing = (torch.empty(tokens, slots, dtype=torch.int32, device="cuda"),
                   torch.empty(tokens, slots, device="cuda"))
        h = pair_gate_up(x, moe.w13, logits, moe.top_k, moe.activation, num_experts=E_, routing_out=routing)
        calls = {
            "router": lambda cfg: router_logits(x, moe.router_with_gate, out=logits, config=cfg),
            "gate_up": lambda cfg: pair_gate_up(x, moe.w13, logits, moe.top_k, moe.activation, num_experts=E_,
                                                routing_out=routing, out=h, config=cfg),
            "down": lambda cfg: down_combine(h, moe.w2, logits, moe.top_k, x.dtype, num_experts=E_, routing=routing,
                                             config=cfg),
            "down_routing": lambda cfg: down_combine(h, moe.w2, logits, moe.top_k, x.dtype, num_experts=E_,
                                                     config=cfg),
        }
        row = {"tokens": tokens, "router_cublas": us(lambda: F.linear(x, moe.router_with_gate))}
        for kind, call in calls.items():
            row[f"{kind}_default"] = us(lambda: call(None))
            row[kind] = {}
            for cfg in DECODE_SWEEP[kind]:
                name = "b{} k{} w{}".format(cfg.block, cfg.block_k, cfg.num_warps)
                try:
                    row[kind][name] = us(lambda: call(cfg))
                except Exception as exc:  # registers or shared memory exceeded at some tiles
                    row[kind][name] = type(exc).__name__
        best = {kind: min(v for v in row[kind].values() if isinstance(v, float)) for kind in calls}
        lines.append(f"| {tokens} | {row['router_cublas']:.1f} | " + " | ".join(
            f"{row[f'{kind}_default']:.1f} / {best[kind]:.1f}" for kind in calls) + " |")
        results.append(row)
        print(lines[-1], flush=True)
    for row in results:
        for kind in DECODE_SWEEP:
            timed = sorted((v, k) for k, v in row[kind].items() if isinstance(v, float))
            lines += ["", f"{row['tokens']} tokens, {kind}: the 6 fastest of {len(row[kind])}:", "",
                      "| tile | us |", "|---|---|"] + [f"| {k} | {v:.1f} |" for v, k in timed[:6]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_decode_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "moe_decode_sweep.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


def random_block(seed: int) -> SwiGLUMoE:
    """A SwiGLUMoE of the 35B-A3B layer shape with random weights N(0, fan_in^-1/2), built on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape):
        return torch.empty(*shape, device="cuda", dtype=torch.bfloat16).normal_(0.0, shape[-1] ** -0.5, generator=gen)

    return SwiGLUMoE(draw(E, H), K, draw(E, 2 * F_, H), draw(E, H, F_), draw(F_S, H), draw(F_S, H), draw(H, F_S),
                     draw(1, H))


def layers_per_block_ms(blocks: list[SwiGLUMoE], x: torch.Tensor) -> float:
    """GPU time per block of ``blocks`` (distinct weights, as a model's layers) called in a row on x,
    captured in one CUDA graph: the block as a model's decode graph runs it (the graph's own
    launch, ~4-6 us, spread over the layers; no layer's weights left in L2 by another)."""
    return graph_bench(lambda: [moe(x) for moe in blocks]) / len(blocks)


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
            tma_default = block_m >= TMA_MIN_BLOCK_M[kind]
            row[f"{kind}_default"] = ("tma " if tma_default else "") + str(
                grouped_gemm_config(kind, x.dtype, block_m, tma=tma_default))
            # From 64-row blocks: the pointer kernel's default tile, then the TMA kernel's sweep.
            tiles = ([(cfg, False) for cfg in sweep_configs(block_m)] if block_m < min(TMA_MIN_BLOCK_M.values()) else
                     [(grouped_gemm_config(kind, x.dtype, block_m), False)] + [(cfg, True) for cfg in TMA_SWEEP[kind]])
            for cfg, tma in tiles:
                fn = ((lambda: expert_gate_up(x, moe.w13, *pairs, slots, moe.activation, block_m, out=h, config=cfg,
                                              tma=tma))
                      if kind == "gate_up" else
                      (lambda: expert_down(h, moe.w2, *pairs, block_m, tokens * slots, config=cfg, tma=tma)))
                name = ("tma " if tma else "") + "n{} k{} w{} s{} g{}".format(*dataclasses.astuple(cfg))
                try:
                    row[kind][name] = graph_bench(fn)
                except Exception as exc:  # shared memory or registers exceeded at some tiles
                    row[kind][name] = type(exc).__name__
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
    parser.add_argument("--layers", type=int, default=8,
                        help="blocks of distinct weights timed in one graph for the per-block column (default 8)")
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
    bandwidth, rate = runtime.copy_bandwidth() * 1e12, runtime.matrix_rate() * 1e12  # bytes/s, FLOP/s
    blocks = [moe] + [random_block(seed) for seed in range(1, args.layers)]
    rows, profiles = [], []
    for tokens in args.tokens:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        if args.skewed:  # half the tokens lean towards experts 0..15
            lean = moe.router_with_gate[:16].float().mean(0)
            x[: tokens // 2] += (4 * lean / lean.norm()).to(x.dtype)

        def hit(block):  # routed experts the tokens pick in ``block``
            routed = route(x, block.router_with_gate, K, block.num_shared, 64, num_experts=E)
            return int(routed.experts[:, :K].unique().numel())

        hits = [hit(b) for b in blocks]  # blocks[0] is moe
        experts_hit = hits[0]
        floors = [floor_ms(b, h, tokens, bandwidth, rate) for b, h in zip(blocks, hits)]
        floor, layers_floor = floors[0], sum(floors) / len(floors)
        timed = {}
        for pdl in ((True, False) if tokens <= PAIR_PATH_TOKENS else (True,)):  # PDL: the decode path only
            runtime.PDL = pdl
            timed[pdl] = graph_bench(lambda: moe(x)), layers_per_block_ms(blocks, x)
        runtime.PDL = True
        ours, in_layers = timed[True]
        with torch.no_grad():
            hf = bench(lambda: block(x[None]))
        x_list, list_rows = unfused_inputs(moe, x)
        plain = graph_bench(lambda: unfused(moe, x, x_list, list_rows))
        if args.profile:
            kernels = kernel_breakdown(lambda: moe(x))
            profiles.append(f"### {tokens} tokens: GPU us per call\n\n| kernel | us |\n|---|---|\n" + "\n".join(
                f"| {name} | {us} |" for name, us in sorted(kernels.items(), key=lambda item: -item[1])))
        rows.append({"tokens": tokens, "experts_hit": experts_hit, "fuselm_ms": ours, "hf_ms": hf, "unfused_ms": plain,
                     "floor_ms": floor, "pct_of_floor": 100 * floor / ours, "vs_hf": hf / ours,
                     "layers_ms_per_block": in_layers, "layers_floor_ms": layers_floor,
                     "layers_pct_of_floor": 100 * layers_floor / in_layers,
                     "no_pdl_ms": timed[False][0] if False in timed else None,
                     "no_pdl_layers_ms_per_block": timed[False][1] if False in timed else None,
                     "vs_unfused": plain / ours, "tflops": 2 * tokens * (K + moe.num_shared) * 3 * F_ * H / ours / 1e9})
    name = torch.cuda.get_device_name()
    lines = [f"## SwiGLUMoE vs HF Qwen3_5MoeSparseMoeBlock, 35B-A3B layer (H {H}, E {E}, k {K}, F {F_}, F_s {F_S}), "
             f"bf16, {name}{', skewed routing' if args.skewed else ''}",
             f"copy {bandwidth / 1e12:.2f} TB/s, bf16 mm {rate / 1e12:.0f} TFLOP/s (this run). fuselm (graph): one "
             f"block a CUDA graph, the graph's launch included; in {len(blocks)} layers: {len(blocks)} blocks of "
             f"distinct weights on x in one graph, per block (as in a model's decode graph); PDL off: the same two "
             f"with programmatic dependent launch off (the decode path, <= {PAIR_PATH_TOKENS} tokens).", "",
             "| tokens | experts hit | fuselm (graph) ms | % of floor | in layers, ms a block | % of floor | "
             "PDL off: graph / in layers ms | HF ms | vs HF | unfused ms | vs unfused | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        no_pdl = "-" if r["no_pdl_ms"] is None else f"{r['no_pdl_ms']:.4f} / {r['no_pdl_layers_ms_per_block']:.4f}"
        lines.append(f"| {r['tokens']} | {r['experts_hit']} | {r['fuselm_ms']:.4f} | {r['pct_of_floor']:.0f}% | "
                     f"{r['layers_ms_per_block']:.4f} | {r['layers_pct_of_floor']:.0f}% | {no_pdl} | "
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
