#!/usr/bin/env bash
# Qwen3.5-MoE on the GPU (issue 19), by stages, results to $OUT (default ./gpu_out):
#   tests      GPU run of the MoE tests (bf16 cases, CUDA-graph capture of the routing and of the
#              whole block, Qwen35Moe vs HF): moe_tests.log
#   sanitizer  compute-sanitizer memcheck of the routing, grouped-GEMM and combine kernels (skewed and
#              empty-expert cases included; graph-capture tests apart): moe_sanitizer.log
#   bench      benchmarks/moe.py: the 35B-A3B block at 1 .. 16384 tokens vs HF's block, the unfused
#              path and the floor, uniform and skewed routing: moe.md / moe.json, moe_skewed.*;
#              each kernel's GPU time per token count: moe_kernels.md
#   sweep      benchmarks/moe.py --sweep: the routing and each grouped GEMM alone at every tile config
#              (1, 8, 64, 4096 tokens; 16 and 64 rows at 64, 64 and 128 at 4096): moe_sweep.md / moe_sweep.json
#   generate   `fuselm generate --config 35b-a3b` (random bf16 weights drawn on the device, ~69 GB:
#              use the nvidia-h200 kind), batch 1 and 8: moe_generate.md
# Usage: bash scripts/gpu_moe.sh [STAGE ...]   (default: tests sanitizer bench)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stages=" ${*:-tests sanitizer bench} "
status=0
MOE_TESTS="tests/test_moe.py tests/test_moe_routing.py tests/test_moe_grouped_gemm.py tests/test_qwen35_moe.py"
if want tests; then
  timeout 300 python3 -m pytest -v -p no:cacheprovider --durations=10 $MOE_TESTS > "$OUT/moe_tests.log" 2>&1 || status=1
  tail -4 "$OUT/moe_tests.log"
fi
if want sanitizer; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_moe_routing.py tests/test_moe_grouped_gemm.py \
    -k "not graph" > "$OUT/moe_sanitizer.log" 2>&1 || status=1
  tail -4 "$OUT/moe_sanitizer.log"
fi
if want bench; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 400 python3 benchmarks/moe.py --profile --out "$OUT" || status=1
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 300 python3 benchmarks/moe.py --skewed --tokens 64 4096 \
    --out "$OUT" || status=1
fi
if want sweep; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 500 python3 benchmarks/moe.py --sweep --tokens 1 8 64 4096 --out "$OUT" \
    > "$OUT/moe_sweep.log" 2>&1 || status=1
  tail -3 "$OUT/moe_sweep.log"
fi
if want generate; then
  work=$(mktemp -d)
  for batch in 1 8; do
    timeout 400 python3 -m fuselm generate --config 35b-a3b --batch $batch --prompt-len 512 --max-new-tokens 128 \
      --out "$work" > "$work/b$batch.log" 2>&1 || { status=1; tail -20 "$work/b$batch.log"; }
    cat "$work/generate.md" >> "$OUT/moe_generate.md" 2>/dev/null
  done
  cat "$OUT/moe_generate.md" 2>/dev/null
fi
exit $status
