"""A mixed prefill + decode step against the two apart (GPU only; 9B config, random bf16 weights).

    python benchmarks/mixed_step.py [--decode-rows 31] [--chunks 480 224 96 224@256 512 256]
        [--profile [--profile-rows 15]] [--timeline] [--decode-block-v 16 32 64] [--qkv-split]
        [--prologue-tiles 8x512x4 16x512x4 ...] [--blas cublas cublaslt]
        [--set - MODULE.NAME=VALUE[,...] ...]

Cache of 32 slots x 1024 tokens; rows 0 .. decode_rows-1 decode (active, 512 tokens cached; their
state is random-free zeros, which costs the same), the prompt chunks go into the slots after them.
Each call is captured in its own CUDA graph and replayed (median of 20 replays, CUDA events):
``decode_step`` over the 32 rows, ``prefill_step`` of the chunks alone, and ``mixed_step`` of
both; also the time to capture the mixed graph (what a server pays on a bucket's first use).
A chunk spec is [ROWSx]TOKENS[@START]: START > 0 is a continued chunk (its rows already hold START
tokens: the second chunk of a longer prompt).
``--profile``: per kernel, the GPU time of one eager decode step and one eager mixed step
(torch.profiler), ordered by what the mixed step adds. ``--timeline``: one graph replay of the
decode and the mixed step, kernel by kernel (``timing.graph_timeline``): bubbles, and each layer's
token-mixing window with the decode half's and the chunk's kernel time in it and the time only the
chunk's kernels run (``timeline_summary``; ``--timeline-out DIR`` keeps the kernels as JSON).
``--decode-block-v``: the table once per value columns a program of the mixed step's Gated DeltaNet
decode kernel (its decode half runs without the fused norm: ``fused_recurrent.BLOCK_V``; the decode
step alone keeps its whole-head programs), to see whether smaller, shorter-lived programs let the
side stream's chunk kernels in sooner (NOTES.md 83). ``--qkv-split``: the table again with the
attention layers' qkv projection as two products (q/gate rows, k/v rows of the weight) written into
one output, past 64 rows (cuBLAS's pick for the whole product at 320 rows is slow, NOTES.md 84).
``--prologue-tiles``: the table once per tile (rows x columns x warps a program) of the standalone
prologue kernel (``decode_linear``'s ``_prologue_kernel``; it gated all rows after the join until
NOTES.md 92, now the decode rows and attention's chunk rows in each half; NOTES.md 86). ``--blas``:
the table once per BLAS library PyTorch's matmuls prefer
(``torch.backends.cuda.preferred_blas_library``: cuBLAS and cuBLASLt pick different tiles for the
same GEMM at some row counts; the engine captures its mixed steps with cuBLASLt, NOTES.md 87).
``--set``: the table once per group of module constants under ``fuselm.ops`` (a kernel's warps,
stages or tiles read at launch; ``-`` for none), e.g. ``--set -
gated_delta_rule.decode_step.MIN_NUM_WARPS=4`` (the default, then 4 warps). Note that the graphs
here put the 32 cache rows beside the chunk: a chunk of T tokens makes GEMMs of 32 + T rows.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fuselm.models.qwen35.layers import GatedAttention
from fuselm.models.qwen35.presets import config_9b, random_qwen35
from fuselm.ops.decode_linear import kernels as decode_linear_kernels
from fuselm.ops.gated_delta_rule import fused_recurrent
from timing import busy_us, graph_bench, graph_timeline, kernel_breakdown

ROWS, MAX_LEN, CACHED = 32, 1024, 512


def parse_chunks(spec: str) -> tuple[int, int, int]:
    """"512" -> (1, 512, 0); "2x256" -> (2, 256, 0); "256@256" -> (1, 256, 256)."""
    spec, _, start = spec.partition("@")
    rows, _, tokens = spec.rpartition("x")
    return int(rows or 1), int(tokens), int(start or 0)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def capture(fn) -> tuple[torch.cuda.CUDAGraph, float]:
    """Warm ``fn`` on a side stream, capture it; returns (graph, seconds the capture took)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    began = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph, time.perf_counter() - began


def kernel_difference(decode: dict, mixed: dict, count: int = 15) -> str:
    """Markdown: the kernels that the mixed step spends more time in than the decode step, by difference."""
    names = sorted(set(decode) | set(mixed), key=lambda n: decode.get(n, (0, 0))[0] - mixed.get(n, (0, 0))[0])
    lines = ["| kernel | decode us (launches) | mixed us (launches) | mixed - decode us |", "|---|---|---|---|"]
    for name in names[:count]:
        (d, dn), (m, mn) = decode.get(name, (0.0, 0)), mixed.get(name, (0.0, 0))
        lines.append(f"| {name} | {d:.0f} ({dn}) | {m:.0f} ({mn}) | {m - d:+.0f} |")
    total_d, total_m = sum(v[0] for v in decode.values()), sum(v[0] for v in mixed.values())
    launches_d, launches_m = sum(v[1] for v in decode.values()), sum(v[1] for v in mixed.values())
    lines.append(f"| all kernels | {total_d:.0f} ({launches_d}) | {total_m:.0f} ({launches_m}) | {total_m - total_d:+.0f} |")
    return "\n".join(lines)


GEMM_NAMES = ("nvjet", "gemm", "cutlass", "splitKreduce", "_decode_gemv_kernel", "_decode_linear_kernel")
# the prompt chunk's token mixing (the side stream's kernels; names no decode-half kernel has)
CHUNK_NAMES = ("_chunk_prepare_kernel", "_chunk_recurrence_kernel", "_chunk_output_kernel", "_conv_kernel",
               "_gates_kernel", "_state_kernel", "sdpa", "_prefill_attention_kernel")
# the decode rows' token mixing
DECODE_NAMES = ("_decode_step_kernel", "_split_kernel", "_combine_kernel")


def timeline_summary(timelines: dict, count: int = 15) -> str:
    """Markdown: per graph replay, the wall time, the time no kernel runs (bubbles: launch and
    cross-stream waits), and the token-mixing windows: a layer's span between the end of its input
    projection and the start of its output projection (consecutive GEMMs around a decode-half
    kernel), with the decode half's and the chunk's token-mixing kernel time in it (each the union
    of its kernels' intervals; the prologue kernel, wherever it runs, in neither) and the time only
    the chunk's kernels run (the chunk half's share of the critical path). Then the kernels by GPU
    time (a graph's streams are the replay's, not the capture's, so the table does not split them)."""
    lines = ["| graph | wall us | bubbles us | kernel time us (sum) | overlapped us | windows (kind x n) | "
             "window us, mean | decode half us, mean | chunk half us, mean | chunk alone us, mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    per_kernel = {}
    for label, events in timelines.items():
        if not events:
            lines.append(f"| {label} | (no kernels in the trace) | | | | | | | | |")
            continue
        wall = max(e for _, _, _, e in events)
        busy = busy_us([(b, e) for _, _, b, e in events])
        total = sum(e - b for _, _, b, e in events)
        first = f"| {label} | {wall:.0f} | {wall - busy:.0f} | {total:.0f} | {total - busy:.0f} |"
        gemms = sorted((b, e) for n, _, b, e in events if any(g in n for g in GEMM_NAMES))
        windows = {"GDN": [], "attention": []}
        for (_, open_), (close, _) in zip(gemms, gemms[1:]):
            # kernels overlapping the window, clipped to it (a programmatic dependent launch, the
            # Gated DeltaNet decode kernel's, starts while the input projection still runs)
            inside = [(n, max(b, open_), min(e, close)) for n, _, b, e in events
                      if e > open_ and b < close and not any(g in n for g in GEMM_NAMES)]
            names = {n for n, _, _ in inside}
            kind = "GDN" if "_decode_step_kernel" in names else "attention" if "_split_kernel" in names else None
            if kind is None:
                continue
            decode = busy_us([(b, e) for n, b, e in inside if any(d in n for d in DECODE_NAMES)])
            chunk_iv = [(b, e) for n, b, e in inside if any(c in n for c in CHUNK_NAMES)]
            rest = [(b, e) for n, b, e in inside if not any(c in n for c in CHUNK_NAMES)]
            chunk = busy_us(chunk_iv)
            alone = busy_us(chunk_iv + rest) - busy_us(rest)
            windows[kind].append((close - open_, decode, chunk, alone))
        for kind, rows in windows.items():
            if rows:
                means = [sum(r[i] for r in rows) / len(rows) for i in range(4)]
                lines.append(first + f" {kind} x {len(rows)} | " + " | ".join(f"{m:.1f}" for m in means) + " |")
                first = "| | | | | |"
        if first.startswith(f"| {label}"):
            lines.append(first + " | | | | |")
        for name, _, b, e in events:
            us, n = per_kernel.get((label, name[:60]), (0.0, 0))
            per_kernel[(label, name[:60])] = (us + e - b, n + 1)
    lines += ["", "| graph | kernel | us (launches) |", "|---|---|---|"]
    for label in timelines:
        keys = sorted((k for k in per_kernel if k[0] == label), key=lambda k: -per_kernel[k][0])
        for key in keys[:count]:
            us, n = per_kernel[key]
            lines.append(f"| {label} | {key[1]} | {us:.0f} ({n}) |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-rows", type=int, default=31)
    parser.add_argument("--chunks", nargs="+", default=["480", "224", "96", "224@256", "512", "256"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=15, help="kernels listed per profile table")
    parser.add_argument("--timeline", action="store_true",
                        help="where a graph replay's time goes: bubbles, each layer's token-mixing window")
    parser.add_argument("--timeline-out", help="a directory for each replay's kernels as JSON (with --timeline)")
    parser.add_argument("--decode-block-v", type=int, nargs="+", default=[None],
                        help="value columns a program of the mixed step's GDN decode kernel (default: its choice)")
    parser.add_argument("--qkv-split", action="store_true",
                        help="also with the attention qkv projection as two products past 64 rows")
    parser.add_argument("--prologue-tiles", nargs="+", default=[None], metavar="MxKxW",
                        help="the standalone prologue kernel's rows x columns x warps a program")
    parser.add_argument("--blas", nargs="+", default=[None], choices=["cublas", "cublaslt"],
                        help="the table once per BLAS library PyTorch's matmuls prefer (default: as the process has it)")
    parser.add_argument("--set", nargs="+", default=[None], metavar="MODULE.NAME=VALUE[,...]",
                        help="the table once per group of module constants under fuselm.ops set for it (e.g. "
                             "gated_delta_rule.chunk.PREPARE_WARPS=8,causal_conv1d.kernels.CONV_WARPS=4; - : none)")
    args = parser.parse_args()
    model = random_qwen35(config_9b(), dtype=torch.bfloat16, device="cuda", seed=0)
    cache = model.new_cache(ROWS, MAX_LEN)
    decoding = args.decode_rows
    whole_project = GatedAttention.project
    k = decode_linear_kernels
    default_tile = (k.PROLOGUE_BLOCK_M, k.PROLOGUE_BLOCK_K, k.PROLOGUE_NUM_WARPS)
    default_blas = torch.backends.cuda.preferred_blas_library()
    for blas, tile, block_v, split, constants in itertools.product(
            args.blas, args.prologue_tiles, args.decode_block_v, (False, True) if args.qkv_split else (False,),
            args.set):
        restore = set_constants(constants)
        torch.backends.cuda.preferred_blas_library(blas or default_blas)
        k.PROLOGUE_BLOCK_M, k.PROLOGUE_BLOCK_K, k.PROLOGUE_NUM_WARPS = (
            tuple(int(n) for n in tile.split("x")) if tile else default_tile)
        fused_recurrent.BLOCK_V = block_v
        GatedAttention.project = split_qkv_project if split else whole_project
        print(f"## mixed step: {decoding} decode rows (of {ROWS}) + prompt chunks, 9B bf16, "
              f"{torch.cuda.get_device_name()}" + (f", decode kernel BLOCK_V {block_v}" if block_v else "")
              + (", qkv as two products" if split else "") + (f", prologue tile {tile}" if tile else "")
              + (f", {blas} preferred" if blas else "")
              + (f", set {constants}" if constants and constants != "-" else ""))
        if tile:
            print(prologue_alone())
        run_chunks(model, cache, decoding, args)
        restore()
    torch.backends.cuda.preferred_blas_library(default_blas)
    GatedAttention.project = whole_project
    k.PROLOGUE_BLOCK_M, k.PROLOGUE_BLOCK_K, k.PROLOGUE_NUM_WARPS = default_tile


def set_constants(group: str | None):
    """Set ``module.NAME=VALUE`` (comma-separated; modules under fuselm.ops, values Python
    literals; "-": nothing) for one table, e.g. a kernel's warps or stages read at launch; returns
    the undo."""
    before = []
    for item in (group.split(",") if group and group != "-" else []):
        target, _, value = item.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        module = importlib.import_module(f"fuselm.ops.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"--set: fuselm.ops.{module_name} has no {name}")
        before.append((module, name, getattr(module, name)))
        setattr(module, name, ast.literal_eval(value.strip()))

    def restore():
        for module, name, value in reversed(before):
            setattr(module, name, value)
    return restore


def prologue_alone(rows: int = 320, K: int = 4096, head_dim: int = 128) -> str:
    """The standalone prologue kernel at the current tile, alone (graph replays, do_bench median):
    both gates of the mixed step's output projections over ``rows`` rows, as strided as there (x
    and gate every other K-wide column block of one buffer)."""
    buffer = torch.randn(rows, 2 * K, device="cuda", dtype=torch.bfloat16)
    x, gate = buffer[:, :K], buffer[:, K:]
    norm_weight = torch.randn(head_dim, device="cuda", dtype=torch.bfloat16)
    times = {name: 1e3 * graph_bench(lambda a=args: decode_linear_kernels.prologue_kernel(x, *a))
             for name, args in (("gated_rms_norm", ("gated_rms_norm", gate, norm_weight, 1e-6, head_dim)),
                                ("sigmoid_gate", ("sigmoid_gate", gate)))}
    return "prologue kernel alone at {} rows: ".format(rows) + ", ".join(f"{n} {t:.1f} us" for n, t in times.items())


def split_qkv_project(self: GatedAttention, x: torch.Tensor) -> torch.Tensor:
    """``GatedAttention.project`` as two products (q/gate rows, k/v rows) into one output, past 64 rows."""
    rows = x.numel() // x.shape[-1]
    if rows <= 64 or self.qkv_bias is not None:
        return F.linear(x, self.qkv_proj, self.qkv_bias)
    out = x.new_empty(*x.shape[:-1], self.qkv_proj.shape[0])
    flat_x, flat_out = x.reshape(rows, -1), out.view(rows, -1)
    torch.mm(flat_x, self.qkv_proj[:self.q_size].t(), out=flat_out[:, :self.q_size])
    torch.mm(flat_x, self.qkv_proj[self.q_size:].t(), out=flat_out[:, self.q_size:])
    return out


def run_chunks(model, cache, decoding: int, args) -> None:
    """The table of the module docstring (and the profiles) for ``args.chunks``."""
    print("| chunks | decode alone | prefill alone | sum | mixed | mixed - decode | per prompt token | capture of mixed (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.chunks:
        rows, tokens, start = parse_chunks(spec)
        cache.lengths.fill_(CACHED)
        cache.active.zero_()
        cache.active[:decoding] = True
        slots = torch.arange(decoding, decoding + rows, device="cuda") % ROWS
        starts = torch.full((rows,), start, dtype=torch.int64, device="cuda")
        lengths = torch.full((rows,), tokens, dtype=torch.int64, device="cuda")
        ids = torch.randint(0, 1000, (rows, tokens), device="cuda")
        token_ids = torch.zeros(ROWS, dtype=torch.int64, device="cuda")
        fresh = start == 0

        def decode():
            cache.lengths[:decoding].fill_(CACHED)  # keep the rows' positions fixed across replays
            model.decode_step(token_ids, cache)

        def prefill():
            model.prefill_step(ids, cache, slots, starts, lengths, fresh)
            cache.active.index_fill_(0, slots, False)

        def mixed():
            cache.lengths[:decoding].fill_(CACHED)
            model.mixed_step(token_ids, cache, ids, slots, starts, lengths, fresh)

        results = {}
        for name, fn in (("decode", decode), ("prefill", prefill), ("mixed", mixed)):
            graph, seconds = capture(fn)
            results[name] = replay_ms(graph)
            results[name + "_capture"] = seconds
            if args.timeline and name != "prefill":
                results[name + "_timeline"] = graph_timeline(graph)
            del graph
        d, p, m = results["decode"], results["prefill"], results["mixed"]
        print(f"| {rows} x {tokens}{f' after {start}' if start else ''} | {d:.2f} ms | {p:.2f} ms | {d + p:.2f} ms | {m:.2f} ms | {m - d:.2f} ms | "
              f"{1e3 * (m - d) / (rows * tokens):.1f} us | {results['mixed_capture']:.2f} |")
        if args.profile:
            print(f"\n### where the mixed step's extra time goes, {rows} x {tokens}: kernel GPU time of one eager "
                  "call (torch.profiler)\n")
            print(kernel_difference(kernel_breakdown(decode, 1, launches=True), kernel_breakdown(mixed, 1, launches=True),
                                    args.profile_rows))
        if args.timeline:
            print(f"\n### one graph replay's timeline, {rows} x {tokens}{f' after {start}' if start else ''}\n")
            timelines = {"decode": results["decode_timeline"], "mixed": results["mixed_timeline"]}
            print(timeline_summary(timelines, args.profile_rows))
            if args.timeline_out:
                name = f"timeline_{rows}x{tokens}{f'@{start}' if start else ''}.json"
                (Path(args.timeline_out) / name).write_text(json.dumps(timelines))
            print()


if __name__ == "__main__":
    main()
