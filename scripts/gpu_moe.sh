#!/usr/bin/env bash
# Qwen3.5-MoE on the GPU (issue 19), by stages, results to $OUT (default ./gpu_out):
#   tests      GPU run of the MoE tests (bf16 cases, CUDA-graph capture of the routing and of the
#              whole block, Qwen35Moe vs HF): moe_tests.log
#   sanitizer  compute-sanitizer memcheck of the routing, grouped-GEMM and combine kernels (skewed and
#              empty-expert cases included; graph-capture tests apart): moe_sanitizer.log
#   bench      benchmarks/moe.py: the 35B-A3B block at 1 .. 16384 tokens (one block a graph, and per
#              block in a graph of 8 layers) vs HF's block, the unfused path and the floor, uniform and
#              skewed routing: moe.md / moe.json, moe_skewed.*;
#              each kernel's GPU time per token count: moe_kernels.md
#   sweep      benchmarks/moe.py --sweep: the routing and each grouped GEMM alone at every tile config
#              (1, 8, 64, 4096 tokens; 16 and 64 rows at 64, 64 and 128 at 4096): moe_sweep.md / moe_sweep.json
#   route      benchmarks/moe.py --sweep-route: the routing alone, decode (1-16 tokens) by sort variant,
#              past 16 tokens the routing and placement kernels by step and warps, then by chunk:
#              moe_route_sweep.md / .json
#   clocks     benchmarks/moe_clocks.py: SM clock, power and clock event reasons while the block replays
#              back to back at 64, 4096, 16384 tokens (is it power-capped?): moe_clocks.log
#   decode     benchmarks/moe.py --sweep-decode: the decode path's kernels alone by tile at 1-16 tokens
#              (the router beside cuBLAS's): moe_decode_sweep.md / .json
#   model      the 35B-A3B model whole beside HF transformers (benchmarks/qwen35.py --config 35b-a3b:
#              random bf16 weights drawn on the device, ~69 GB each, one after the other: use the
#              nvidia-h200 kind), decode batch 1, 8, 32: qwen35_moe.md / .json
# Usage: bash scripts/gpu_moe.sh [STAGE ...]   (default: tests sanitizer bench)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stages=" ${*:-tests sanitizer bench} "
status=0
MOE_TESTS="tests/test_moe.py tests/test_moe_routing.py tests/test_moe_grouped_gemm.py tests/test_moe_decode.py
  tests/test_qwen35_moe.py"
if want tests; then
  timeout 300 python3 -m pytest -v -p no:cacheprovider --durations=10 $MOE_TESTS > "$OUT/moe_tests.log" 2>&1 || status=1
  tail -4 "$OUT/moe_tests.log"
fi
if want sanitizer; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_moe_routing.py tests/test_moe_grouped_gemm.py tests/test_moe_decode.py \
    -k "not graph" > "$OUT/moe_sanitizer.log" 2>&1 || status=1
  tail -4 "$OUT/moe_sanitizer.log"
fi
if want bench; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 400 python3 benchmarks/moe.py --profile --out "$OUT" || status=1
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 300 python3 benchmarks/moe.py --skewed --tokens 64 4096 \
    --out "$OUT" || status=1
fi
if want decode; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 400 python3 benchmarks/moe.py --sweep-decode --out "$OUT" \
    > "$OUT/moe_decode_sweep.log" 2>&1 || { status=1; tail -20 "$OUT/moe_decode_sweep.log"; }
  head -12 "$OUT/moe_decode_sweep.md"
fi
if want route; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 500 python3 benchmarks/moe.py --sweep-route --out "$OUT" \
    > "$OUT/moe_route_sweep.log" 2>&1 || { status=1; tail -20 "$OUT/moe_route_sweep.log"; }
fi
if want clocks; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 120 python3 benchmarks/moe_clocks.py > "$OUT/moe_clocks.log" 2>&1 \
    || status=1
  cat "$OUT/moe_clocks.log"
fi
if want sweep; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 500 python3 benchmarks/moe.py --sweep --tokens 1 8 64 4096 --out "$OUT" \
    > "$OUT/moe_sweep.log" 2>&1 || status=1
  tail -3 "$OUT/moe_sweep.log"
fi
if want model; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 500 python3 benchmarks/qwen35.py --config 35b-a3b --new-tokens 128 \
    --hf-new-tokens 32 --out "$OUT" > "$OUT/qwen35_moe.log" 2>&1 || { status=1; tail -20 "$OUT/qwen35_moe.log"; }
  cat "$OUT/qwen35_moe.md" 2>/dev/null
fi
exit $status
