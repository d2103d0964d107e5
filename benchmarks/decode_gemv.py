"""The decode GEMV kernels at 1 .. 32 rows (Qwen3.5-9B shapes, bf16). GPU only.

    python benchmarks/decode_gemv.py [--rows 1 2 4 8 16 24 32] [--out DIR]          # decode_gemv.md
    python benchmarks/decode_gemv.py --sweep [--rows 16 24 32] [--out DIR]          # decode_gemv_sweep.md
    python benchmarks/decode_gemv.py --vector [--out DIR]                            # decode_vector_sweep.md

Default: ``decode_linear``'s two ways with a prologue (fused into the GEMV; the prologue kernel,
then the plain GEMV) and the op as it dispatches, beside the prologue kernel + cuBLAS, per row
count: the data behind ``FUSED_PROLOGUE_MAX_M``. ``--sweep``: the tile sweep behind
``swiglu_mlp.kernels.gemv_config`` and ``decode_linear.kernels.decode_linear_config``, beside
cuBLAS (``F.linear``, the GEMM alone: no SwiGLU, no prologue) at the same shapes. ``--vector``:
``decode_linear`` at one row, the CUDA-core vector kernel's configs against the tensor-core tile
(as it ran at one row before: gated_rms_norm fused, sigmoid_gate its prologue kernel first) and
cuBLAS, at the out projections of Qwen3.5-9B (N 4096) and 35B-A3B (N 2048), K 4096.

Each timing is one CUDA graph holding one call on each of several weight copies (more bytes than
the L2 cache holds, as in a model step where every layer brings new weights), replayed by
do_bench; per call = graph time / copies. Bandwidth = weight bytes per call / time, also as % of
the measured device copy bandwidth (``fuselm.runtime.copy_bandwidth``). Writes decode_gemv.md and
decode_gemv.json (or decode_gemv_sweep.*); configs a kernel cannot launch (shared memory) are listed as errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fuselm.ops.common.activation import Activation
from fuselm.ops.decode_linear import decode_linear
from fuselm.ops.decode_linear.kernels import (
    DecodeLinearConfig, DecodeVectorConfig, decode_linear_config, decode_linear_kernel, decode_vector_config,
    prologue_kernel,
)
from fuselm.ops.swiglu_mlp.kernels import GemvConfig, decode_gemv_kernel, gemv_config
from fuselm.runtime import copy_bandwidth
from timing import bench, capture

D, FF, HEAD_DIM = 4096, 12288, 128  # 9B: hidden, MLP intermediate, GDN value head dim
DT = torch.bfloat16
L2_MULTIPLE = 300e6  # bytes of weight copies per graph: several times the H100's 50 MB L2

GATE_UP = [GemvConfig(64, 128, 4, 4), GemvConfig(64, 128, 4, 3), GemvConfig(32, 128, 4, 4), GemvConfig(32, 256, 4, 3),
           GemvConfig(64, 64, 4, 6), GemvConfig(128, 64, 8, 4), GemvConfig(64, 128, 8, 4), GemvConfig(32, 128, 4, 6)]
DOWN = [GemvConfig(32, 512, 4, 3), GemvConfig(32, 256, 4, 4), GemvConfig(16, 512, 4, 4), GemvConfig(32, 128, 4, 6),
        GemvConfig(64, 256, 8, 3), GemvConfig(64, 128, 4, 4), GemvConfig(16, 256, 4, 6)]
LINEAR = [DecodeLinearConfig(32, 256, 4, 4), DecodeLinearConfig(32, 128, 4, 4), DecodeLinearConfig(64, 128, 4, 4),
          DecodeLinearConfig(16, 256, 4, 4), DecodeLinearConfig(32, 128, 4, 6), DecodeLinearConfig(64, 256, 8, 3),
          DecodeLinearConfig(64, 128, 8, 4), DecodeLinearConfig(16, 128, 4, 6)]


def per_call_ms(calls) -> float:
    """ms per call of a graph holding ``calls`` (one per weight copy)."""
    graph = capture(lambda: [call() for call in calls])
    return bench(graph.replay) / len(calls)


def copies_of(shape) -> list[torch.Tensor]:
    count = max(2, int(L2_MULTIPLE // (shape[0] * shape[1] * 2)) + 1)
    return [torch.randn(shape, device="cuda", dtype=DT) * shape[1] ** -0.5 for _ in range(count)]


def cases(m: int):
    """(kernel, default config, configs, weight bytes, fn(config or None -> callables)): None = cuBLAS."""
    act = Activation()
    x, h = torch.randn(m, D, device="cuda", dtype=DT), torch.randn(m, FF, device="cuda", dtype=DT)
    z = torch.randn(m, D, device="cuda", dtype=DT)
    norm = torch.rand(HEAD_DIM, device="cuda", dtype=DT) + 0.5
    h_out, y_out = torch.empty(m, FF, device="cuda", dtype=DT), torch.empty(m, D, device="cuda", dtype=DT)
    w13s, w2s, wos = copies_of((2 * FF, D)), copies_of((D, FF)), copies_of((D, D))

    def gate_up(cfg):
        if cfg is None:
            return [lambda w=w: F.linear(x, w) for w in w13s]
        return [lambda w=w: decode_gemv_kernel(x, w, h_out, act, config=cfg) for w in w13s]

    def down(cfg):
        if cfg is None:
            return [lambda w=w: F.linear(h, w) for w in w2s]
        return [lambda w=w: decode_gemv_kernel(h, w, y_out, config=cfg) for w in w2s]

    def linear(prologue):
        def fn(cfg):
            if cfg is None:
                return [lambda w=w: F.linear(x, w) for w in wos]
            gate = None if prologue is None else z
            return [lambda w=w: decode_linear_kernel(x, w, y_out, prologue, gate, norm, 1e-6,
                                                     HEAD_DIM if prologue == "gated_rms_norm" else None, config=cfg)
                    for w in wos]
        return fn

    yield "gate/up + SwiGLU", gemv_config(9, DT, True), GATE_UP, 2 * FF * D * 2, gate_up
    yield "down", gemv_config(9, DT, False), DOWN, FF * D * 2, down
    for prologue in (None, "sigmoid_gate", "gated_rms_norm"):
        configs = [c for c in LINEAR if prologue != "gated_rms_norm" or c.block_k % HEAD_DIM == 0]
        yield (f"decode_linear {prologue or 'plain'}", decode_linear_config(9, DT, prologue, HEAD_DIM),
               configs, D * D * 2, linear(prologue))


def prologue_paths(m: int):
    """(prologue, {way: callables}) for the two prologues at m rows."""
    x, z = torch.randn(m, D, device="cuda", dtype=DT), torch.randn(m, D, device="cuda", dtype=DT)
    norm = torch.rand(HEAD_DIM, device="cuda", dtype=DT) + 0.5
    y_out = torch.empty(m, D, device="cuda", dtype=DT)
    wos = copies_of((D, D))
    plain = decode_linear_config(9, DT)
    for prologue in ("sigmoid_gate", "gated_rms_norm"):
        head = HEAD_DIM if prologue == "gated_rms_norm" else None
        fused = decode_linear_config(9, DT, prologue, head)
        kw = dict(prologue=prologue, gate=z, norm_weight=norm if head else None, eps=1e-6, head_dim=head)
        yield prologue, {
            "fused into the GEMV": [lambda w=w: decode_linear_kernel(x, w, y_out, prologue, z, norm, 1e-6, head, config=fused)
                                    for w in wos],
            "prologue kernel + GEMV": [lambda w=w: decode_linear_kernel(prologue_kernel(x, prologue, z, norm, 1e-6, head), w,
                                                                        y_out, config=plain) for w in wos],
            "prologue kernel + cuBLAS": [lambda w=w: F.linear(prologue_kernel(x, prologue, z, norm, 1e-6, head), w)
                                         for w in wos],
            "decode_linear (dispatch)": [lambda w=w: decode_linear(x, w, out=y_out, **kw) for w in wos],
        }


def compare_paths(rows, copy_tbps):
    lines = [f"## decode_linear with a prologue: fused or not, {torch.cuda.get_device_name()}, bf16, N = K = {D} "
             f"(copy bandwidth {copy_tbps:.2f} TB/s)", "",
             "Per call, weight copies beyond the L2 in one graph; % = weight bytes / time / copy bandwidth.", "",
             "| rows | prologue | way | us | % of copy |", "|---|---|---|---|---|"]
    records = []
    for m in rows:
        for prologue, ways in prologue_paths(m):
            for way, calls in ways.items():
                try:
                    us = 1e3 * per_call_ms(calls)
                except Exception as error:  # e.g. a fused tile past the shared memory at 32 rows
                    records.append({"rows": m, "prologue": prologue, "way": way, "error": str(error)[:120]})
                    lines.append(f"| {m} | {prologue} | {way} | cannot launch: {str(error)[:60]} | |")
                    continue
                pct = 100 * D * D * 2 / (us * 1e-6) / 1e12 / copy_tbps
                records.append({"rows": m, "prologue": prologue, "way": way, "us": us, "pct_copy": pct})
                lines.append(f"| {m} | {prologue} | {way} | {us:.1f} | {pct:.0f}% |")
                print(lines[-1], flush=True)
    return lines, records


VECTOR = [DecodeVectorConfig(rows, block_k, warps) for rows in (1, 2, 4, 8) for block_k in (512, 1024, 2048, 4096)
          for warps in (4, 8)]


def vector_sweep(copy_tbps):
    """decode_linear at one row: (lines, records)."""
    lines = [f"## decode_linear at one row, {torch.cuda.get_device_name()}, bf16, K = {D} (copy bandwidth "
             f"{copy_tbps:.2f} TB/s)", "",
             "Per call, weight copies beyond the L2 in one graph; % = weight bytes / time / copy bandwidth. tile = the "
             "tensor-core kernel with its default config (sigmoid_gate: its prologue kernel first, as the op ran it "
             "at one row); vector = the CUDA-core kernel (rows a program, K step, warps), prologue fused.", "",
             "| N | prologue | way | us | % of copy | default | best |", "|---|---|---|---|---|---|---|"]
    records = []
    x, z = torch.randn(1, D, device="cuda", dtype=DT), torch.randn(1, D, device="cuda", dtype=DT)
    norm = torch.rand(HEAD_DIM, device="cuda", dtype=DT) + 0.5
    for n in (2048, 4096):
        y_out = torch.empty(1, n, device="cuda", dtype=DT)
        ws = copies_of((n, D))
        for prologue in (None, "sigmoid_gate", "gated_rms_norm"):
            head = HEAD_DIM if prologue == "gated_rms_norm" else None
            kw = dict(prologue=prologue, gate=None if prologue is None else z, norm_weight=norm if head else None,
                      head_dim=head)
            tile = decode_linear_config(9, DT, prologue, head)
            default = decode_vector_config(9, DT, prologue, head)
            ways = {"cuBLAS (no prologue)": ([lambda w=w: F.linear(x, w) for w in ws], False),
                    "tile": ([lambda w=w: decode_linear(x, w, out=y_out, config=tile, **kw) for w in ws], False)}
            for cfg in [default] + [c for c in VECTOR if c != default and (head is None or c.block_k % head == 0)]:
                ways[f"vector {cfg.rows} x {cfg.block_k}, {cfg.num_warps} warps"] = (
                    [lambda w=w, cfg=cfg: decode_linear(x, w, out=y_out, config=cfg, **kw) for w in ws], cfg == default)
            timed = []
            for way, (calls, is_default) in ways.items():
                try:
                    us = 1e3 * per_call_ms(calls)
                except Exception as error:  # registers or shared memory: recorded, not fatal
                    records.append({"n": n, "prologue": prologue, "way": way, "error": str(error)[:120]})
                    continue
                timed.append((way, us, is_default))
            best = min((t for t in timed if t[0].startswith("vector")), key=lambda t: t[1])[0]
            for way, us, is_default in timed:
                pct = 100 * n * D * 2 / (us * 1e-6) / 1e12 / copy_tbps
                records.append({"n": n, "prologue": prologue, "way": way, "us": us, "pct_copy": pct,
                                "default": is_default})
                lines.append(f"| {n} | {prologue or 'plain'} | {way} | {us:.1f} | {pct:.0f}% | "
                             f"{'yes' if is_default else ''} | {'yes' if way == best else ''} |")
            print("\n".join(lines[-len(timed):]), flush=True)
    return lines, records


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--sweep", action="store_true", help="the tile sweep (default: the prologue paths)")
    parser.add_argument("--vector", action="store_true", help="one row: the vector kernel's configs against the tile")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    copy_tbps = copy_bandwidth()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.vector:
        lines, records = vector_sweep(copy_tbps)
        (args.out / "decode_vector_sweep.md").write_text("\n".join(lines) + "\n")
        (args.out / "decode_vector_sweep.json").write_text(json.dumps({"copy_tbps": copy_tbps, "records": records},
                                                                      indent=1))
        return
    if not args.sweep:
        lines, records = compare_paths(args.rows or [1, 2, 4, 8, 16, 24, 32], copy_tbps)
        (args.out / "decode_gemv.md").write_text("\n".join(lines) + "\n")
        (args.out / "decode_gemv.json").write_text(json.dumps({"copy_tbps": copy_tbps, "records": records}, indent=1))
        return
    args.rows = args.rows or [16, 24, 32]
    records, lines = [], [f"## decode GEMV kernels, {torch.cuda.get_device_name()}, bf16 (copy bandwidth {copy_tbps:.2f} TB/s)", "",
                          "| rows | kernel | config | us | TB/s | % of copy | default | best |", "|---|---|---|---|---|---|---|---|"]
    for m in args.rows:
        for kernel, default, configs, nbytes, fn in cases(m):
            results = []
            for cfg in [None, default] + [c for c in configs if c != default]:
                try:
                    ms = per_call_ms(fn(cfg))
                except Exception as error:  # out of shared memory or registers: recorded, not fatal
                    records.append({"rows": m, "kernel": kernel, "config": str(cfg), "error": str(error)[:120]})
                    continue
                results.append((cfg, ms))
                records.append({"rows": m, "kernel": kernel, "config": "cuBLAS" if cfg is None else str(cfg),
                                "us": 1e3 * ms, "tbps": nbytes / ms / 1e9, "default": cfg == default})
            best = min((r for r in results if r[0] is not None), key=lambda r: r[1], default=None)
            for cfg, ms in results:
                tbps = nbytes / ms / 1e9
                name = "cuBLAS" if cfg is None else str(cfg).split("(", 1)[1].rstrip(")")
                lines.append(f"| {m} | {kernel} | {name} | {1e3 * ms:.1f} | {tbps:.2f} | {100 * tbps / copy_tbps:.0f}% | "
                             f"{'yes' if cfg == default and cfg is not None else ''} | {'yes' if best and cfg == best[0] else ''} |")
            print("\n".join(lines[-len(results):]), flush=True)
    (args.out / "decode_gemv_sweep.md").write_text("\n".join(lines) + "\n")
    (args.out / "decode_gemv_sweep.json").write_text(json.dumps({"copy_tbps": copy_tbps, "records": records}, indent=1))


if __name__ == "__main__":
    main()
