"""Launch-geometry sweep behind the tuning constants in the silu_mul and rms_norm kernels.

    python benchmarks/sweep.py [--out DIR]

Times each kernel directly (no op dispatch) at the benchmark shapes, bf16, for a grid of
(rows per program, columns per program, warps), and writes ``sweep.md``/``sweep.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

from fuselm.ops.rms_norm.kernels import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel
from fuselm.ops.silu_mul.kernels import _silu_mul_bwd_kernel, _silu_mul_fwd_kernel
from timing import bench


def silu_mul_configs(n_cols):
    row = triton.next_power_of_2(n_cols)
    for warps in (4, 8, 16, 32):
        yield 1, row, warps
    for block_n in (512, 1024, 2048, 4096):
        for block_m in (1, 2, 4, 8):
            if block_m * block_n > 8192:
                continue
            for warps in (2, 4, 8):
                yield block_m, block_n, warps


def sweep_silu_mul(shapes):
    rows = []
    for m, n in shapes:
        gate, up, grad = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, dg, du = (torch.empty_like(gate) for _ in range(3))
        for bm, bn, warps in silu_mul_configs(n):
            grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
            fwd = bench(lambda: _silu_mul_fwd_kernel[grid](
                gate, up, out, m, n, n, n, n, 3.0e38, 1.0, ACT=0, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps))
            bwd = bench(lambda: _silu_mul_bwd_kernel[grid](
                grad, gate, up, dg, du, m, n, n, n, n, n, n, 3.0e38, 1.0, ACT=0, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps))
            elem = m * n * 2
            rows.append({"kernel": "silu_mul", "shape": f"{m}x{n}", "block_m": bm, "block_n": bn, "warps": warps,
                         "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tbps": 3 * elem / fwd / 1e9, "bwd_tbps": 5 * elem / bwd / 1e9})
            print(rows[-1], flush=True)
    return rows


def sweep_rms_norm(shapes):
    rows = []
    for m, n in shapes:
        x, res = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y, s = torch.empty_like(x), torch.empty_like(x)
        for bm in (1, 2, 4, 8):
            for warps in (2, 4, 8, 16, 32):
                grid = (triton.cdiv(m, bm),)
                plain = bench(lambda: _rms_norm_fwd_kernel[grid](
                    x, x, w, y, y, m, n, n, n, n, n, 1e-6, 0.0,
                    HAS_RESIDUAL=False, ZERO_CENTERED=False, BLOCK_M=bm, BLOCK_N=n, num_warps=warps))
                fused = bench(lambda: _rms_norm_fwd_kernel[grid](
                    x, res, w, y, s, m, n, n, n, n, n, 1e-6, 0.0,
                    HAS_RESIDUAL=True, ZERO_CENTERED=False, BLOCK_M=bm, BLOCK_N=n, num_warps=warps))
                elem = m * n * 2
                rows.append({"kernel": "rms_norm", "shape": f"{m}x{n}", "block_m": bm, "warps": warps,
                             "plain_ms": plain, "fused_add_ms": fused,
                             "plain_tbps": 2 * elem / plain / 1e9, "fused_add_tbps": 4 * elem / fused / 1e9})
                print(rows[-1], flush=True)
        dy = torch.randn_like(x)
        for per_sm in (1, 2, 4, 8):
            programs = per_sm * torch.cuda.get_device_properties().multi_processor_count
            rows_per_program = triton.cdiv(m, programs)
            programs = triton.cdiv(m, rows_per_program)
            partial = torch.empty(programs, n, device="cuda", dtype=torch.float32)
            for warps in (4, 8, 16):
                ms = bench(lambda: _rms_norm_bwd_kernel[(programs,)](
                    dy, x, w, dy, y, partial, m, n, rows_per_program, n, n, n, n, 1e-6, 0.0,
                    HAS_DRES=False, ZERO_CENTERED=False, BLOCK_N=n, num_warps=warps))
                rows.append({"kernel": "rms_norm_bwd", "shape": f"{m}x{n}", "programs_per_sm": per_sm, "warps": warps,
                             "bwd_ms": ms, "bwd_tbps": (3 * m * n * 2 + programs * n * 4) / ms / 1e9})
                print(rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    silu = sweep_silu_mul([(8192, 14336), (8192, 18944), (4096, 4096)])
    norm = sweep_rms_norm([(8192, 4096)])
    lines = [f"# Launch-geometry sweep, {torch.cuda.get_device_name()}, bf16, {datetime.date.today()}", "",
             f"Command: `python {' '.join(sys.argv)}`, torch {torch.__version__}, triton {triton.__version__}. Kernels "
             "launched directly (no op dispatch); do_bench medians. silu_mul forward moves 3 x M x N x 2 bytes, "
             "backward 5 x; rms_norm plain 2 x, fused add 4 x; rms_norm bwd 3 x plus its fp32 dweight partials.", "",
             "| shape | block_m | block_n | warps | fwd ms | fwd TB/s | bwd ms | bwd TB/s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['block_m']} | {r['block_n']} | {r['warps']} | {r['fwd_ms']:.4f} | {r['fwd_tbps']:.2f} | "
              f"{r['bwd_ms']:.4f} | {r['bwd_tbps']:.2f} |" for r in silu]
    lines += ["", "| rms_norm shape | block_m | warps | plain ms | plain TB/s | fused add ms | fused add TB/s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['block_m']} | {r['warps']} | {r['plain_ms']:.4f} | {r['plain_tbps']:.2f} | "
              f"{r['fused_add_ms']:.4f} | {r['fused_add_tbps']:.2f} |" for r in norm if r["kernel"] == "rms_norm"]
    lines += ["", "| rms_norm bwd shape | programs/SM | warps | ms | TB/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['programs_per_sm']} | {r['warps']} | {r['bwd_ms']:.4f} | {r['bwd_tbps']:.2f} |"
              for r in norm if r["kernel"] == "rms_norm_bwd"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    (args.out / "sweep.json").write_text(json.dumps({"silu_mul": silu, "rms_norm": norm}, indent=1))
    # Best per shape, printed last so it lands in the reply's tail.
    for shape in sorted({r["shape"] for r in silu}):
        rs = [r for r in silu if r["shape"] == shape]
        f, b = min(rs, key=lambda r: r["fwd_ms"]), min(rs, key=lambda r: r["bwd_ms"])
        print(f"best silu_mul {shape}: fwd {f['block_m']}x{f['block_n']}/w{f['warps']} {f['fwd_ms']:.4f} ms; "
              f"bwd {b['block_m']}x{b['block_n']}/w{b['warps']} {b['bwd_ms']:.4f} ms")
    fwd = [r for r in norm if r["kernel"] == "rms_norm"]
    p, fa = min(fwd, key=lambda r: r["plain_ms"]), min(fwd, key=lambda r: r["fused_add_ms"])
    print(f"best rms_norm: plain bm{p['block_m']}/w{p['warps']} {p['plain_ms']:.4f}; fused bm{fa['block_m']}/w{fa['warps']} {fa['fused_add_ms']:.4f}")
    b = min((r for r in norm if r["kernel"] == "rms_norm_bwd"), key=lambda r: r["bwd_ms"])
    print(f"best rms_norm bwd: {b['programs_per_sm']}/SM w{b['warps']} {b['bwd_ms']:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
