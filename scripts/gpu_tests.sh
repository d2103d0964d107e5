#!/usr/bin/env bash
# The GPU test suite in shards: on a fresh machine the whole suite takes more than one call's
# 10 minutes (session 40: a third of it in 520 s, most of it Triton builds). Usage:
#   bash scripts/gpu_tests.sh K N [PYTEST ARGS]    one shard a call (`gpu_tests.sh 0 4`, then 1, 2, 3)
#   bash scripts/gpu_tests.sh all N [PYTEST ARGS]  all N shards at once, shard K on GPU K modulo the
#                                                  GPUs there (one call of a multi-GPU kind)
# (`--large` adds the real model shapes). Shard K runs the test files whose place in the sorted list
# is K modulo N (BY_TEST=1: the tests, below). Each test's result goes to $OUT/gpu_tests_K_of_N.log
# as it ends (-v), so a shard cut short by LIMIT seconds (default 540) still names what failed
# before; a finished one ends with the failures' tracebacks and its 15 slowest tests. Exit 3 when
# a shard was cut short.
set -uo pipefail
usage="usage: gpu_tests.sh K|all N [pytest args] (K = 0 .. N-1)"
shard=${1:-} shards=${2:-}
[[ ($shard =~ ^[0-9]+$ || $shard = all) && $shards =~ ^[1-9][0-9]*$ ]] || { echo "$usage" >&2; exit 2; }
[[ $shard = all ]] || (( shard < shards )) || { echo "$usage" >&2; exit 2; }
shift 2
source "$(dirname "$0")/gpu_env.sh"

run_shard() {  # run_shard K [pytest args]: shard K's files, its log, its exit status
  local k=$1; shift
  local files log status
  mapfile -t files < <(awk -v k="$k" -v n="$shards" '(NR - 1) % n == k' "$OUT/gpu_tests_items.txt")
  (( ${#files[@]} )) || { echo "nothing in shard $k of $shards" >&2; return 2; }
  log="$OUT/gpu_tests_${k}_of_${shards}.log"
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-} ${#files[@]} items: ${files[*]:0:8} ..."; } > "$log"
  timeout "${LIMIT:-540}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --durations=15 "$@" \
    "${files[@]}" >> "$log" 2>&1
  status=$?
  if [ $status = 124 ]; then  # (exit 3, not timeout's 124: the device would read 124 as its own limit)
    printf "\ncut short after %s s\n" "${LIMIT:-540}" >> "$log"
    status=3
  fi
  return $status
}

summary() {  # the lines of a shard's log that say what failed and how it ended
  grep -E "^(FAILED|ERROR) |(FAILED|ERROR) +\[|^=+ .*(passed|failed|error|skipped|no tests ran)|cut short" "$1" \
    | tail -25
}

# What is sharded: the test files (sorted), or with BY_TEST=1 the tests themselves (their node ids, as
# pytest collects them), so that one slow file spreads over the shards; FILES="tests/a.py ..." limits
# either to those files.
mapfile -t test_files < <(if [ -n "${FILES:-}" ]; then printf '%s\n' $FILES; else
                          find tests -maxdepth 1 -name 'test_*.py'; fi | LC_ALL=C sort)
if [ "${BY_TEST:-0}" = 1 ]; then
  python3 -m pytest --collect-only -q -p no:cacheprovider "$@" "${test_files[@]}" 2>/dev/null \
    | grep '::' > "$OUT/gpu_tests_items.txt"
else
  printf '%s\n' "${test_files[@]}" > "$OUT/gpu_tests_items.txt"
fi

if [[ $shard != all ]]; then
  run_shard "$shard" "$@"; status=$?
  summary "$OUT/gpu_tests_${shard}_of_${shards}.log"
  exit $status
fi
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
(( gpus )) || { echo "no GPU" >&2; exit 2; }
pids=()
for ((k = 0; k < shards; k++)); do
  CUDA_VISIBLE_DEVICES=$((k % gpus)) run_shard "$k" "$@" & pids+=($!)
done
status=0
for ((k = 0; k < shards; k++)); do
  wait "${pids[k]}"; s=$?
  (( s > status )) && status=$s
  echo "== shard $k of $shards (exit $s)"
  summary "$OUT/gpu_tests_${k}_of_${shards}.log"
done
exit $status
