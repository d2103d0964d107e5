#!/usr/bin/env bash
# Qwen3.5 prefill and batched decode at the roofline (issue 18), by stages, results to $OUT
# (default ./gpu_out):
#   gemv     benchmarks/decode_gemv.py: decode_linear's prologue fused or run on its own, at 1-32
#            rows, beside cuBLAS: decode_gemv.md / decode_gemv.json (--sweep: the tile sweep)
#   decode   `fuselm generate --config 9b` at batch 1, 8 and 32 (prompt 512, 256 new tokens, greedy):
#            prefill and decode tok/s, % of the weight floor: engine.md
#   mixed    benchmarks/mixed_step.py --profile (31 decode rows + a 96 / 224 / 480-token chunk): the
#            mixed step's cost over the decode step, kernel by kernel: mixed_step.md
#   tests    GPU run of the decode_linear / SwiGLU MLP tests, then the engine tests: roofline_tests.log
# Usage: bash scripts/gpu_roofline.sh [STAGE ...]   (default: gemv decode mixed tests, ~9 min on an H100)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stages=" ${*:-gemv decode mixed tests} "
status=0
if want gemv; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 300 python3 benchmarks/decode_gemv.py --out "$OUT" \
    > "$OUT/decode_gemv.log" 2>&1 || { status=1; tail -20 "$OUT/decode_gemv.log"; }
  cat "$OUT/decode_gemv.md" 2>/dev/null
fi
if want decode; then
  work=$(mktemp -d)
  for batch in ${BATCHES:-1 8 32}; do
    timeout 200 python3 -m fuselm generate --config 9b --batch $batch --prompt-len 512 --max-new-tokens 256 \
      --out "$work" > "$work/b$batch.log" 2>&1 || { status=1; tail -20 "$work/b$batch.log"; }
    cat "$work/generate.md" >> "$OUT/engine.md"
  done
  grep -E "^\| (prefill|decode|weight)" "$OUT/engine.md"
fi
if want mixed; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 300 python3 benchmarks/mixed_step.py --chunks 96 224 480 --profile \
    > "$OUT/mixed_step.md" 2> "$OUT/mixed_step.log" || { status=1; tail -20 "$OUT/mixed_step.log"; }
  cat "$OUT/mixed_step.md"
fi
if want tests; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_decode_linear.py tests/test_swiglu_mlp.py \
    tests/test_engine.py tests/test_qwen35.py > "$OUT/roofline_tests.log" 2>&1 || status=1
  tail -3 "$OUT/roofline_tests.log"
fi
exit $status
