#!/usr/bin/env bash
# The GPU suite in one call: tests at real shapes, then the benchmarks. Logs and tables go to
# $OUT (default ./gpu_out). Uses the image's torch/triton; comparison libraries come from .whl/
# when present. Usage: bash scripts/gpu_suite.sh [--sweep]  (--sweep: the MLP tile sweep too;
# the elementwise geometry sweep is `python3 benchmarks/sweep.py --out DIR`). The tests alone now take
# more than one device call on a fresh machine: TESTS=0 runs the benchmarks only, and
# scripts/gpu_tests.sh runs the tests a shard a call.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# Writes tests.log, host_overhead.md, ops.{md,json,png}, mlp.{md,json,png}, swap_ffn.{log,json}.
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/tests.log"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -p no:cacheprovider --large tests 2>&1 | tee -a "$OUT/tests.log" | tail -25 || status=1
fi
python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.md" || status=1
python3 benchmarks/ops.py --out "$OUT" 2>&1 | tail -40 || status=1
python3 benchmarks/mlp.py ${1:+$1} --out "$OUT" 2>&1 | tail -40 || status=1
python3 -m fuselm swapffn --out "$OUT" 2>&1 | tee "$OUT/swap_ffn.log" | tail -30 || status=1
exit $status
