#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The offload benchmark of docs/performance.md, on one GPU: this package's ZeRO-2 and ZeRO-3 offload and ZenFlow,
# then upstream DeepSpeed's ZeRO-2 and ZeRO-3 offload, on the reference model (GPT d_model 2048, 24 layers,
# seq 2048, micro-batch 4, GAS 2, bf16, AdamW, clip 1.0), plus the GPU offload-path tests.
#
#   bash benchmarks/offload_bench.sh WHEELS_DIR OUT_DIR [STEPS] [WARMUP] [OURS_SYSTEMS] [UPSTREAM_SYSTEMS] [UPSTREAM_STEPS]
#
# WHEELS_DIR holds upstream's wheels (../shared/tools/upstream-wheels.sh); OUT_DIR receives ours.md/.jsonl,
# upstream.md/.jsonl, profiles.txt (top operators of one profiled step per system) and log.txt. Upstream
# JIT-builds its CPU Adam during its first system's set-up. T_TESTS, T_OURS, T_UPSTREAM: time limits (s).
set -u
WHEELS=${1:?wheels dir}
OUT=${2:?output dir}
STEPS=${3:-3}
WARMUP=${4:-2}
OURS=${5:-ds_zero2+offload,ds_zero3+offload,ds_zero2+zenflow}
THEIRS=${6:-ds_zero2+offload,ds_zero3+offload}
THEIR_STEPS=${7:-$STEPS}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
mkdir -p "$OUT" /tmp/prof_ours /tmp/prof_upstream
LOG="$OUT/log.txt"
# shellcheck disable=SC2206  # BENCH_EXTRA: more train_bench options, split on spaces (a small model for a dry run)
BENCH=(--warmup "$WARMUP" --idle-steps 1 ${BENCH_EXTRA:-})
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl >>"$LOG" 2>&1
echo "== gpu offload-path tests" >>"$LOG"
timeout "${T_TESTS:-80}" python3 -m tests.gpu.test_offload_paths >>"$LOG" 2>&1
tail -n 2 "$LOG"
echo "== ours: $OURS" >>"$LOG"
timeout "${T_OURS:-140}" python3 benchmarks/train_bench.py --systems "$OURS" --steps "$STEPS" "${BENCH[@]}" --profile-dir /tmp/prof_ours \
    --out "$OUT/ours.md" >>"$LOG" 2>&1
echo "== upstream: $THEIRS" >>"$LOG"
DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "${T_UPSTREAM:-130}" python3 benchmarks/train_bench.py --systems "$THEIRS" \
    --steps "$THEIR_STEPS" "${BENCH[@]}" --profile-dir /tmp/prof_upstream --out "$OUT/upstream.md" >>"$LOG" 2>&1
for f in /tmp/prof_ours/*.txt /tmp/prof_upstream/*.txt; do echo "==== $f"; cat "$f"; done >"$OUT/profiles.txt" 2>/dev/null
cat "$OUT/ours.md" "$OUT/upstream.md" 2>/dev/null
