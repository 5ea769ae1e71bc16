#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every one-GPU measurement of docs/performance.md in one run (one H200, world 1), each section under its own time
# limit so that one slow section cannot take the others with it:
#   A. the native kernels' rejection of bad input (tests/gpu/test_native_ops.py -k rejects);
#   B. the launch-bound model: DDP, FSDP2 and this package's ZeRO-0..3;
#   C. the reference model, bf16 gradient accumulation: this package's ZeRO-1/2/3, then upstream DeepSpeed's
#      (its default accumulates in bf16; torch_adam avoids its fused-Adam build);
#   D. CPU offload and ZenFlow on the reference model, this package then upstream (offload_bench.sh);
#   E. the cost of one gradient audit on the reference model.
# Usage: bash benchmarks/one_gpu_suite.sh UPSTREAM_WHEELS_DIR OUT_DIR
set -u
WHEELS=${1:?upstream wheels dir}
OUT=${2:?output dir}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1
small=(--d-model 512 --layers 48 --heads 8 --vocab 8192 --seq 512 --micro-batch 8 --gas 2)
bf16acc='{"data_types": {"grad_accum_dtype": "bf16"}}'

echo "== A native kernels: rejection of bad input"
timeout "${T_A:-50}" python3 -m pytest tests/gpu/test_native_ops.py -q -x -p no:cacheprovider -k rejects \
    >"$OUT/native_rejects.log" 2>&1
tail -n 1 "$OUT/native_rejects.log"

echo "== B launch-bound model"
timeout "${T_B:-70}" python3 benchmarks/train_bench.py --systems ddp,ds_zero0,ds_zero1,ds_zero2,ds_zero3,fsdp2 \
    "${small[@]}" --warmup 3 --steps 8 --out "$OUT/launch_bound.md" >"$OUT/launch_bound.log" 2>&1
grep "^| " "$OUT/launch_bound.md"

echo "== C reference model, bf16 accumulation: ours, then upstream"
timeout "${T_C1:-50}" python3 benchmarks/train_bench.py --systems ds_zero1,ds_zero2,ds_zero3 --warmup 1 --steps 3 \
    --ds-extra "$bf16acc" --out "$OUT/reference_ours.md" >"$OUT/reference_ours.log" 2>&1
grep "^| " "$OUT/reference_ours.md"
DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "${T_C2:-70}" python3 benchmarks/train_bench.py \
    --systems ds_zero1,ds_zero2,ds_zero3 --warmup 1 --steps 3 \
    --ds-extra '{"optimizer": {"params": {"torch_adam": true}}}' --out "$OUT/reference_upstream.md" \
    >"$OUT/reference_upstream.log" 2>&1
grep "deepspeed\b.*from\|^| " "$OUT/reference_upstream.log" | grep -v "^| ---" | head -6

echo "== D offload and ZenFlow"
T_TESTS=${T_TESTS:-1} T_OURS=${T_OURS:-80} T_UPSTREAM=${T_UPSTREAM:-130} \
    bash benchmarks/offload_bench.sh "$WHEELS" "$OUT/offload" 3 2 ds_zero2+offload,ds_zero3+offload,ds_zero2+zenflow \
    ds_zero2+offload,ds_zero3+offload 2 | grep "^| "

echo "== E gradient audit cost"
timeout "${T_E:-70}" python3 benchmarks/bench_audit.py --stage 2 --repeats 2 --out "$OUT/audit.md" \
    >"$OUT/audit.log" 2>&1
grep "^| \|^- " "$OUT/audit.md" 2>/dev/null || tail -n 5 "$OUT/audit.log"
