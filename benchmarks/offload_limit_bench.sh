#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Offload at the limit on one GPU, side by side with upstream DeepSpeed in one invocation (docs/performance.md,
# "Offload at the limit"): the GPU checks of the speculative and overlapped steps, then on the reference model
# (GPT d_model 2048, 24 layers, seq 2048, micro-batch 4, GAS 2, bf16, AdamW) this package's exact offload (ZeRO-2 and
# ZeRO-3, clip 1.0), its speculative offload (super_offload) with clip 1.0 and without clipping (and the exact step
# without clipping beside it), then upstream 0.19.8's ZeRO-2 and ZeRO-3 offload with clip 1.0 and ZeRO-2 without.
#
#   bash benchmarks/offload_limit_bench.sh WHEELS_DIR OUT_DIR [STEPS]
#
# WHEELS_DIR holds upstream's wheels (../shared/tools/upstream-wheels.sh). Every train_bench run prints which
# deepspeed it imported. T_*: time limits (s) of the sections; SPEC_SYSTEMS: the systems run speculatively.
set -u
WHEELS=${1:?wheels dir}
OUT=${2:?output dir}
STEPS=${3:-4}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1
# shellcheck disable=SC2206  # BENCH_EXTRA: more train_bench options (a small model for a dry run)
BENCH=(--warmup 2 --steps "$STEPS" ${BENCH_EXTRA:-})
export T_RUN=${T_RUN:-110}
SPEC='{"zero_optimization": {"offload_optimizer": {"super_offload": true}}}'
SPEC_SYSTEMS=${SPEC_SYSTEMS:-ds_zero2+offload}

if [ "${T_TESTS:-120}" != 0 ]; then
    echo "== gpu checks: speculative and overlapped offloaded steps"
    timeout "${T_TESTS:-120}" python3 -m tests.gpu.test_offload_paths speculative z3ov >"$OUT/tests.log" 2>&1
    grep "^PASS\|^FAIL\|passed" "$OUT/tests.log" | tail -n 20
fi

# shellcheck source=benchmarks/bench_run.sh
source benchmarks/bench_run.sh
run "ours: exact offload, clip 1.0" ours_exact DS_BENCH_UPSTREAM=0 -- --systems ds_zero2+offload,ds_zero3+offload
run "ours: speculative offload, clip 1.0" ours_spec DS_BENCH_UPSTREAM=0 -- --systems "$SPEC_SYSTEMS" --ds-extra "$SPEC"
run "ours: exact offload, no clipping" ours_exact_noclip DS_BENCH_UPSTREAM=0 -- --systems "$SPEC_SYSTEMS" --clip 0
run "ours: speculative offload, no clipping" ours_spec_noclip DS_BENCH_UPSTREAM=0 -- --systems "$SPEC_SYSTEMS" \
    --clip 0 --ds-extra "$SPEC"
if [ "${T_UPSTREAM:-200}" != 0 ]; then
    echo "== upstream 0.19.8, clip 1.0"
    DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "${T_UPSTREAM:-200}" python3 benchmarks/train_bench.py \
        --systems ds_zero2+offload,ds_zero3+offload "${BENCH[@]}" --out "$OUT/upstream.md" >"$OUT/upstream.log" 2>&1
    grep "deepspeed.*from\|^| " "$OUT/upstream.log" | grep -v "^| ---" | grep -v "^| system" | head -4
    echo "== upstream 0.19.8, no clipping"
    DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "${T_RUN:-110}" python3 benchmarks/train_bench.py \
        --systems ds_zero2+offload --clip 0 "${BENCH[@]}" --out "$OUT/upstream_noclip.md" >"$OUT/upstream_noclip.log" 2>&1
    grep "deepspeed.*from\|^| " "$OUT/upstream_noclip.log" | grep -v "^| ---" | grep -v "^| system" | head -4
fi
