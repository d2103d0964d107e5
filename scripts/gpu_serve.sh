#!/usr/bin/env bash
# `fuselm serve` on the GPU in one call (issue 17): a 9B-shaped random checkpoint with the real
# tokenizer (init-checkpoint; reused from $CHECKPOINT when there), served over HTTP and measured with
# `fuselm bench-serve` (prompt 512, output 256, ignore_eos), beside the static Engine and HF
# transformers on the same directory, all in this run:
#   1. static Engine, batch 1 (prefill time of one 512-token prompt, decode step), greedy and with
#      the served requests' sampling (the checkpoint's generation_config): engine.md
#   2. server with the CLI's prefill budget: 1 client; 32 concurrent clients (96 prompts, 1024 for
#      the steady state, and 1000 with PROMPTS_1000=1); Poisson arrivals at 80% of the 32-client
#      request throughput. Stage
#      serveN: a server with --max-prefill-tokens N, 32 clients and the same Poisson rate (or $RATE)
#   3. static Engine, batch 32, greedy and with the served sampling: engine.md
#   4. HF transformers: static generate at batch 1 and 32, and generate_batch checked: hf_anchor.*
#   5. GPU tests of the serving path; compute-sanitizer memcheck of the sampling kernel
# Writes to $OUT (default ./gpu_out):
#   serve.md (every bench-serve table), serve.json (their JSON), serve_poisson.png, engine.md,
#   metrics_default.txt (stage serve: the server's /metrics after its benches),
#   server_*.log (each server's log tail: graph captures), steps_*.md (benchmarks/step_log.py: step
#   durations by kind, per benchmark run; the slowest steps' host spans and garbage collections),
#   steps_N.jsonl (stage serveN: the raw step log; stage serve: steps_default.jsonl.gz),
#   stalls_*.md (benchmarks/stall_dump.py: every thread's stack when the engine thread's host work
#   between two steps passed 10 ms, or a step's wait for the one before it 14 ms (a mixed step of 256
#   prompt tokens takes ~11.5), grouped; stage serve: the dumps in stalls_default.txt.gz),
#   host_state.txt (stage serve: the cgroup's CPU quota and throttling, CPU / memory / IO pressure, load,
#   huge pages and direct compaction, the VM's steal time, the server's and its engine process's threads'
#   run and run-queue wait times, before and after each bench; before the server, a probe of
#   host-thread stalls from outside the process and the busiest processes: do host stalls come from outside?),
#   hf_anchor.md, hf_anchor.json, serve_tests.log, sanitizer.log; sampling.md (the sampler's cut-off
#   ways: the sort, key counts; benchmarks/sampling.py) and engine_sampling.md (the static
#   engine's step at batch 1 / 32 with top-p alone and with the served top-k + top-p) when that stage is named;
#   stage logprobs: sampling.md and engine_logprobs.md (the static engine's step at batch 1 / 32 without and
#   with SamplingParams.logprobs 5); stage penalties: sampling.md and engine_penalties.md (the step at batch
#   1 / 32, greedy and with Qwen's non-thinking sampling, each without and with presence_penalty 1.5), the
#   penalties' GPU tests (penalties_gpu_tests.log) and their kernels under memcheck (penalties_sanitizer.log);
#   stage structured: token masks' GPU tests (structured_gpu_tests.log), the bitmask kernel under memcheck
#   (structured_sanitizer.log), the 9B step with constrained / allowed-ids / bad-words requests (structured_outputs.md)
# STATE_DTYPE=bfloat16: the engine and the servers keep the Gated DeltaNet states in bf16 (--state-dtype).
# ADMISSION_WAIT_MS=N: the servers' --admission-wait-ms (default: the CLI's).
# PROMPTS_1000=1: stage serve also runs 1000 prompts at 32 clients (vLLM's default count).
# One device call for issue 17's bars with the HF anchor in the same run: `engine serve hf` (~9 min).
# Usage: bash scripts/gpu_serve.sh [STAGE ...]   stages: engine serve serveN hf tests sanitizer sampling logprobs
#   penalties structured
#   (default all: ~10 min on an H100, more than one device call allows: name fewer stages per call;
#   wheels from .whl/ as gpu_env.sh installs them)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
stages=" ${*:-engine serve serve2048 hf tests sanitizer} "
checkpoint=${CHECKPOINT:-/tmp/qwen35-9b-random}
state_dtype=${STATE_DTYPE:-float32}
port=${PORT:-8391}
url=http://127.0.0.1:$port
work=$(mktemp -d)
if [[ $stages =~ " serve"|" hf " ]] && [ ! -f "$checkpoint/config.json" ]; then
  python3 -m fuselm init-checkpoint "$checkpoint" --config 9b > "$work/init.log" 2>&1 || { cat "$work/init.log"; exit 1; }
fi
# The served requests bring no sampling fields, so the checkpoint's generation_config applies
# (temperature 0.6, top-k 20, top-p 0.95); the static engine runs greedy and with those.
SERVED_SAMPLING="--temperature 0.6 --top-k 20 --top-p 0.95"
engine() {  # batch, then sampling flags; the table goes to $OUT/${ENGINE_MD:-engine.md}
  local batch=$1; shift
  python3 -m fuselm generate --config 9b --batch "$batch" --prompt-len 512 --max-new-tokens 256 --out "$work" \
    --state-dtype "$state_dtype" "$@" \
    > "$work/engine_b$batch.log" 2>&1 || { status=1; tail -20 "$work/engine_b$batch.log"; }
  cat "$work/generate.md" >> "$OUT/${ENGINE_MD:-engine.md}"
}
want engine && { engine 1; engine 1 $SERVED_SAMPLING; }
healthy() { python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=2)" 2>/dev/null; }
host_state() {  # do host stalls come from outside the process? CPU quota and throttling (cgroup v2), CPU /
  # memory / IO pressure, load; transparent huge pages and the kernel's direct compaction and reclaim
  # (stalls a faulting thread: the step log's per-span faults and CPU time tell), memory; the
  # server's context switches
  echo "## $1 ($(date +%T))"; nproc
  for f in /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu.stat /proc/pressure/cpu /proc/pressure/memory \
           /proc/pressure/io /proc/loadavg /sys/kernel/mm/transparent_hugepage/enabled \
           /sys/kernel/mm/transparent_hugepage/defrag; do
    [ -r "$f" ] && { echo "# $f"; cat "$f"; }
  done
  echo "# /proc/vmstat"; grep -E '^(compact_(stall|fail|success)|thp_fault_(alloc|fallback)|pgmajfault|allocstall_[a-z]+|pgscan_direct|pgsteal_direct) ' /proc/vmstat
  echo "# /proc/meminfo"; grep -E '^(MemTotal|MemFree|MemAvailable|Cached|AnonHugePages):' /proc/meminfo
  # steal: time the hypervisor ran something else on this VM's vCPUs (the 8th value of /proc/stat's cpu line)
  echo "# /proc/stat (cpu: user nice system idle iowait irq softirq steal)"; head -1 /proc/stat
  # the HTTP server process and its engine process (its child)
  [ -n "${server:-}" ] && for p in $server $(pgrep -P "$server"); do
    [ -r "/proc/$p/status" ] || continue
    echo "# process $p ($(cat /proc/$p/comm))"; grep -E 'ctxt_switches|VmRSS' "/proc/$p/status"
    # each thread's time on a CPU and waiting for one (runnable, not running), ns, and its timeslices
    echo "# its threads: tid, /proc/.../schedstat (run ns, run-queue wait ns, timeslices)"
    for t in /proc/$p/task/*; do echo "${t##*/} $(cat "$t/schedstat" 2>/dev/null)"; done
  done
}
bench() {  # label, then bench-serve options
  local label=$1; shift
  python3 -m fuselm bench-serve "$url" --random-input-len 512 --random-output-len 256 --disable-tqdm \
    --out "$work" --label "$label" "$@" > "$work/$label.log" 2>&1 || status=1
  cat "$work/$label.md" >> "$OUT/serve.md" 2>/dev/null || tail -20 "$work/$label.log"
  host_state "after $label" >> "$OUT/host_state.txt"
}
serve() {  # prefill token budget ("" for the CLI's default); then the benches run
  setsid python3 -m fuselm serve "$checkpoint" --max-batch 32 --max-len 1024 --port $port --state-dtype "$state_dtype" \
    ${1:+--max-prefill-tokens $1} ${ADMISSION_WAIT_MS:+--admission-wait-ms $ADMISSION_WAIT_MS} \
    --step-log "$work/steps_$1.jsonl" --stall-dump "$work/stalls_$1.txt" --stall-dump-wait-ms 14 > "$work/server_$1.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do healthy && break; sleep 1; done
  healthy || { echo "server did not come up"; tail -40 "$work/server_$1.log"; kill $server; exit 1; }
  echo "server (prefill budget ${1:-default}) up at $SECONDS s"
}
stop() {
  kill -INT $server; wait $server; echo "server exit status: $?"
}
if want serve; then
  host_state "before the server" >> "$OUT/host_state.txt"
  # a host thread stalled from outside (a slow core; a driver call blocked by another GPU client,
  # e.g. a monitoring agent's polls): benchmarks/host_probe.py, and the busiest processes
  { echo "# benchmarks/host_probe.py"; timeout 60 python3 benchmarks/host_probe.py 2>&1
    echo "# busiest processes"; ps -eo pid,pcpu,etime,comm --sort=-pcpu | head -12; } >> "$OUT/host_state.txt"
  serve ""
  bench serve_c1 --num-prompts 8 --max-concurrency 1 --warmup-requests 2 --goodput ttft:500 tpot:10
  bench serve_c32 --num-prompts 96 --max-concurrency 32 --warmup-requests 4
  # Steady state: 96 prompts are three waves, and the first wave's 32 x 512-token prefill has no
  # decode to hide under (nor the last wave's drain): ~10% of the run (NOTES.md 34, 47). 1024 = 32
  # x 32 keeps all 32 clients busy to the last wave; 1000 (vLLM's default count) leaves 8 requests
  # running alone at batch 8 for their whole life at the end (~1.8% of the run, NOTES.md 82)
  bench serve_c32_steady --num-prompts 1024 --max-concurrency 32 --warmup-requests 4
  # vLLM's bench serve default count (its batch-8 tail: above); ~80 s, which `engine serve hf` in one
  # device call (the bar's "anchor in the same run") has no room for
  [ "${PROMPTS_1000:-0}" = 1 ] && bench serve_c32_1000 --num-prompts 1000 --max-concurrency 32 --warmup-requests 4
  rate=$(python3 -c "import json; print(0.8 * json.load(open('$work/serve_c32.json'))['request_throughput'])")
  echo "Poisson rate: $rate req/s (80% of the 32-client throughput)"
  bench serve_poisson --num-prompts 96 --request-rate "$rate" --burstiness 1 --max-concurrency 32 --goodput ttft:500
  cp "$work/serve_poisson.png" "$OUT/" 2>/dev/null
  # the server's own Prometheus metrics over the whole run (its TTFT / inter-token histograms)
  python3 -c "import urllib.request; print(urllib.request.urlopen('$url/metrics').read().decode())" \
    > "$OUT/metrics_default.txt" 2>&1 || status=1
  stop
  host_state "after the server" >> "$OUT/host_state.txt"
  tail -c 20000 "$work/server_.log" > "$OUT/server_default.log"
  python3 benchmarks/step_log.py "$work/steps_.jsonl" > "$OUT/steps_default.md" 2>&1
  gzip -c "$work/steps_.jsonl" > "$OUT/steps_default.jsonl.gz"
  python3 benchmarks/stall_dump.py "$work/stalls_.txt" > "$OUT/stalls_default.md" 2>&1
  gzip -c "$work/stalls_.txt" > "$OUT/stalls_default.txt.gz"
fi
for stage in $stages; do  # serveN: 32 clients, then Poisson at 80% of their throughput (or $RATE), budget N
  [[ $stage =~ ^serve([0-9]+)$ ]] || continue
  budget=${BASH_REMATCH[1]}
  serve "$budget"
  bench serve_c32_budget$budget --num-prompts 96 --max-concurrency 32 --warmup-requests 4
  budget_rate=${RATE:-$(python3 -c "import json; print(0.8 * json.load(open('$work/serve_c32_budget$budget.json'))['request_throughput'])")}
  echo "Poisson rate at budget $budget: $budget_rate req/s"
  bench serve_poisson_budget$budget --num-prompts 96 --request-rate "$budget_rate" --burstiness 1 \
    --max-concurrency 32 --goodput ttft:500
  stop
  cp "$work/serve_poisson_budget$budget.png" "$OUT/" 2>/dev/null
  python3 benchmarks/step_log.py "$work/steps_$budget.jsonl" > "$OUT/steps_$budget.md" 2>&1
  cp "$work/steps_$budget.jsonl" "$OUT/"
  python3 benchmarks/stall_dump.py "$work/stalls_$budget.txt" > "$OUT/stalls_$budget.md" 2>&1
  grep -c "graph (" "$work/server_$budget.log" | sed "s/^/graph captures at budget $budget: /"
  tail -c 20000 "$work/server_$budget.log" > "$OUT/server_$budget.log"
done
python3 - "$work" "$OUT/serve.json" <<'EOF2'
import json, sys
from pathlib import Path
def rounded(value):  # times to the microsecond: the per-request ITL lists of 1000 prompts stay ~3 MB
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value
work = Path(sys.argv[1])
json.dump({path.stem: rounded(json.loads(path.read_text())) for path in sorted(work.glob("serve_*.json"))},
          open(sys.argv[2], "w"), separators=(",", ":"))
EOF2
want engine && { engine 32; engine 32 $SERVED_SAMPLING; }
grep -E "^(##|Successful|Failed|Request throughput|Output token|Mean TTFT|Median TTFT|P99 TTFT|Mean TPOT|Median TPOT|Median ITL|P99 ITL|Request goodput|\| decode|\| prefill)" \
  "$OUT/serve.md" "$OUT/engine.md" 2>/dev/null
if want hf; then
  timeout 240 python3 benchmarks/hf_anchor.py "$checkpoint" --out "$OUT" > "$work/hf.log" 2>&1 || { status=1; tail -30 "$work/hf.log"; }
  tail -12 "$OUT/hf_anchor.md" 2>/dev/null
fi
if want tests; then
  timeout 330 python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_engine.py tests/test_serve.py \
    tests/test_attention_decode.py tests/test_attention_prefill.py > "$OUT/serve_tests.log" 2>&1 || status=1
  tail -3 "$OUT/serve_tests.log"
fi
if want sanitizer; then  # the kernels new in issue 17: sampling (and its log-probabilities), split-KV decode attention,
  # paged prefill attention, the decode step's inputs and Gated DeltaNet state through the row -> slot table
  # (graph-capture tests apart)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py tests/test_attention_decode.py \
    tests/test_attention_prefill.py tests/test_decode_inputs.py tests/test_gated_delta_rule.py \
    -k "full_vocabulary or key_counts or documented_order or decode_attention_matches or paged_decode or prefill \
        or decode_inputs or decode_step_matches or token_logprobs" \
    > "$OUT/sanitizer.log" 2>&1 || status=1
  tail -4 "$OUT/sanitizer.log"
fi
if want sampling; then
  python3 benchmarks/sampling.py > "$OUT/sampling.md" 2>&1 || status=1
  cat "$OUT/sampling.md"
  # the static engine's step with top-p alone and with the served top-k 20 + top-p (each table's
  # header names its batch and sampling), into engine_sampling.md
  for batch in 1 32; do
    ENGINE_MD=engine_sampling.md engine $batch --temperature 0.7 --top-p 0.9
    ENGINE_MD=engine_sampling.md engine $batch $SERVED_SAMPLING
  done
fi
if want logprobs; then  # what SamplingParams.logprobs costs: token_logprobs alone (sampling.md's last rows), and
  # the static engine's step at batch 1 / 32 without and with logprobs 5 in one call, into engine_logprobs.md
  python3 benchmarks/sampling.py --batch-sizes 1 32 > "$OUT/sampling.md" 2>&1 || status=1
  grep -E "^ *B |token_logprobs" "$OUT/sampling.md"
  for batch in 1 32; do
    ENGINE_MD=engine_logprobs.md engine $batch
    ENGINE_MD=engine_logprobs.md engine $batch --logprobs 5
  done
  grep -E "^(##|\| decode)|logprobs" "$OUT/engine_logprobs.md"
fi
if want penalties; then  # what repetition / frequency / presence penalties and min-p cost, and their GPU checks
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py tests/test_engine.py \
    -k "gpu or penalties or min_p or min_tokens or banned or nan_or_inf or advance or variants or graph" \
    > "$OUT/penalties_gpu_tests.log" 2>&1 \
    || status=1
  tail -3 "$OUT/penalties_gpu_tests.log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py \
    -k "(penalties or banned or advance or nan_or_inf or min_p or full_vocabulary) and not graph" \
    > "$OUT/penalties_sanitizer.log" 2>&1 || status=1
  tail -4 "$OUT/penalties_sanitizer.log"
  python3 benchmarks/sampling.py --batch-sizes 1 32 > "$OUT/sampling.md" 2>&1 || status=1
  grep -E "^ *B |penalis|T=0.7 top_k=20" "$OUT/sampling.md"
  for batch in 1 32; do
    for sampling in "" "--temperature 0.7 --top-k 20 --top-p 0.8"; do
      ENGINE_MD=engine_penalties.md engine $batch $sampling
      ENGINE_MD=engine_penalties.md engine $batch $sampling --presence-penalty 1.5
    done
  done
  grep -E "^(##|\| decode)|penalty" "$OUT/engine_penalties.md"
fi
if want structured; then  # token masks: the GPU tests (engine steps with grammars, allowed ids and bad words
  # through the graphs, the bitmask kernel at the full vocabulary and in a graph; test_engine whole: the decode
  # path they split), the bitmask kernel under memcheck, and what masked requests cost a 9B decode step
  # (structured_outputs.md)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_structured_outputs.py tests/test_token_masks.py \
    tests/test_engine.py tests/test_sampling.py::test_apply_token_bitmask_at_the_full_vocabulary_on_gpu \
    > "$OUT/structured_gpu_tests.log" 2>&1 || status=1
  tail -3 "$OUT/structured_gpu_tests.log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py -k "bitmask and not graph" \
    > "$OUT/structured_sanitizer.log" 2>&1 || status=1
  tail -4 "$OUT/structured_sanitizer.log"
  timeout 240 python3 benchmarks/structured_outputs.py --out "$OUT" > "$OUT/structured_outputs.log" 2>&1 || status=1
  tail -12 "$OUT/structured_outputs.log"
fi
exit $status
