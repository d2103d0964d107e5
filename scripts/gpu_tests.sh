#!/usr/bin/env bash
# The GPU test suite in shards, one a device call: on a fresh machine the whole suite takes more than
# one call's 10 minutes (session 40: a third of it in 520 s, most of it Triton builds). Usage:
#   bash scripts/gpu_tests.sh K N [PYTEST ARGS]   (e.g. `gpu_tests.sh 0 4`, then 1, 2, 3; `--large` adds
#   the real model shapes)
# runs the test files whose place in the sorted list is K modulo N. Each test's result goes to
# $OUT/gpu_tests_K_of_N.log as it ends (-v), so a shard cut short by the call's limit (LIMIT seconds,
# default 540) still names what failed before; a finished one ends with the failures' tracebacks and
# its 15 slowest tests.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
shard=${1:?usage: gpu_tests.sh K N [pytest args]} shards=${2:?usage: gpu_tests.sh K N [pytest args]}
shift 2
mapfile -t files < <(find tests -maxdepth 1 -name 'test_*.py' | sort | awk -v k="$shard" -v n="$shards" '(NR - 1) % n == k')
log="$OUT/gpu_tests_${shard}_of_${shards}.log"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "files: ${files[*]}"; } > "$log"
timeout "${LIMIT:-540}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --durations=15 "$@" "${files[@]}" \
  >> "$log" 2>&1
status=$?
[ $status = 124 ] && echo "cut short after ${LIMIT:-540} s" >> "$log"
grep -E "^(FAILED|ERROR) |(PASSED|FAILED|ERROR|SKIPPED) +\[|^=+ .*(passed|failed)|cut short" "$log" \
  | grep -vE " PASSED +\[| SKIPPED +\[" | tail -25
exit $status
