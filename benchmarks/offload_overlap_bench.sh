#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The pipelined offload step on one GPU, side by side with upstream DeepSpeed, in one run (docs/performance.md,
# "Offload at the limit"): the GPU offload-path tests, a profiled step with its timeline, this package's ZeRO-2 and
# ZeRO-3 offload (pipelined, then the whole-partition step, DS_OFFLOAD_OVERLAP=0), ZeRO-3 partial offload at each
# ratio of RATIOS, then upstream's ZeRO-2 and ZeRO-3 offload. Reference model: GPT d_model 2048, 24 layers, seq 2048,
# micro-batch 4, GAS 2, bf16, AdamW, clip 1.0.
#
#   bash benchmarks/offload_overlap_bench.sh WHEELS_DIR OUT_DIR [STEPS] [RATIOS]
#
# WHEELS_DIR holds upstream's wheels (../shared/tools/upstream-wheels.sh). Every train_bench run prints which
# deepspeed it imported. T_*: time limits (s) of the sections.
set -u
WHEELS=${1:?wheels dir}
OUT=${2:?output dir}
STEPS=${3:-5}
RATIOS=${4:-0.5}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1
# shellcheck disable=SC2206  # BENCH_EXTRA: more train_bench options (a small model for a dry run)
BENCH=(--warmup 2 --steps "$STEPS" ${BENCH_EXTRA:-})
MODEL=(--d-model 2048 --layers 24 --heads 16 --vocab 50304 --seq 2048 --micro-batch 4 --gas 2)

echo "== gpu offload-path and overlap tests"
timeout "${T_TESTS:-150}" python3 -m tests.gpu.test_offload_paths paths overlap >"$OUT/tests.log" 2>&1
grep "^PASS\|^FAIL\|passed" "$OUT/tests.log" | tail -n 20

echo "== profiled step, pipelined ZeRO-2 offload"
timeout "${T_PROFILE:-90}" python3 benchmarks/profile_step.py --systems ds_zero2+offload "${MODEL[@]}" --warmup 3 \
    --timeline --top 12 >"$OUT/profile.txt" 2>&1
grep -v "^| DS::\(reduce_launch\|fold\|host_fold\) " "$OUT/profile.txt" | grep "step .* wall\|^| DS::\|busy\|^  " | head -60

# shellcheck source=benchmarks/bench_run.sh
source benchmarks/bench_run.sh
run "ours: pipelined offload" ours DS_BENCH_UPSTREAM=0 -- --systems ds_zero2+offload,ds_zero3+offload
run "ours: whole-partition step (DS_OFFLOAD_OVERLAP=0)" ours_plain DS_OFFLOAD_OVERLAP=0 -- \
    --systems ds_zero2+offload,ds_zero3+offload
for ratio in $RATIOS; do
    run "ours: ZeRO-3 partial offload, ratio $ratio" "ours_ratio$ratio" DS_BENCH_UPSTREAM=0 -- \
        --systems ds_zero3+offload --ds-extra "{\"zero_optimization\": {\"offload_optimizer\": {\"ratio\": $ratio}}}"
done
echo "== upstream 0.19.8"
DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "${T_UPSTREAM:-200}" python3 benchmarks/train_bench.py \
    --systems ds_zero2+offload,ds_zero3+offload "${BENCH[@]}" --out "$OUT/upstream.md" >"$OUT/upstream.log" 2>&1
grep "deepspeed.*from\|^| " "$OUT/upstream.log" | grep -v "^| ---" | grep -v "^| system" | head -4
