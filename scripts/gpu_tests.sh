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
usage="usage: gpu_tests.sh K N [pytest args] (K = 0 .. N-1)"
shard=${1:-} shards=${2:-}
[[ $shard =~ ^[0-9]+$ && $shards =~ ^[1-9][0-9]*$ ]] && (( shard < shards )) || { echo "$usage" >&2; exit 2; }
shift 2
source "$(dirname "$0")/gpu_env.sh"
mapfile -t files < <(find tests -maxdepth 1 -name 'test_*.py' | LC_ALL=C sort \
                     | awk -v k="$shard" -v n="$shards" '(NR - 1) % n == k')
(( ${#files[@]} )) || { echo "no test files in shard $shard of $shards" >&2; exit 2; }
log="$OUT/gpu_tests_${shard}_of_${shards}.log"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "files: ${files[*]}"; } > "$log"
timeout "${LIMIT:-540}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --durations=15 "$@" "${files[@]}" \
  >> "$log" 2>&1
status=$?
if [ $status = 124 ]; then  # (exit 3, not timeout's 124: the device would read 124 as its own limit)
  printf "\ncut short after %s s\n" "${LIMIT:-540}" >> "$log"
  status=3
fi
grep -E "^(FAILED|ERROR) |(FAILED|ERROR) +\[|^=+ .*(passed|failed|error|skipped|no tests ran)|cut short" "$log" \
  | tail -25
exit $status
