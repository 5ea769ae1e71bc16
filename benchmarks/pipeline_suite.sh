#!/usr/bin/env bash
# The gradient-pipeline measurements on one GPU (world 1), side by side in one run:
#   1. the launch-bound model (many small layers: the step is CPU-bound) under DDP, FSDP2 and ZeRO-0..3;
#   2. a torch.profiler summary of one step of ZeRO-2, ZeRO-3 and DDP on it (the DS:: ranges of one step);
#   3. the reference model's throughput and peak memory, ZeRO-1/2/3 and DDP, with fp32 and bf16 accumulation.
# Usage: bash benchmarks/pipeline_suite.sh OUT_DIR [STEPS]
set -euo pipefail
out=${1:-pipeline-out}
steps=${2:-8}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
small=(--d-model 512 --layers 48 --heads 8 --vocab 8192 --seq 512 --micro-batch 8 --gas 2)
python3 benchmarks/train_bench.py --systems ddp,ds_zero0,ds_zero1,ds_zero2,ds_zero3,fsdp2 "${small[@]}" \
    --warmup 3 --steps "$steps" --out "$out/launch_bound.md" 2>&1 | grep -v "^\[20" | tail -12
python3 benchmarks/profile_step.py --systems ds_zero2,ds_zero3,ddp "${small[@]}" --top 15 \
    --out-dir "$out/traces" > "$out/profile.md" 2>&1 || true
grep -v "^\[20\|USDT" "$out/profile.md" | head -120
python3 benchmarks/train_bench.py --systems ds_zero1,ds_zero2,ds_zero3,ddp --warmup 2 --steps 4 \
    --out "$out/reference_fp32acc.md" 2>&1 | grep "^| " | tail -6
python3 benchmarks/train_bench.py --systems ds_zero1,ds_zero2,ds_zero3 --warmup 2 --steps 4 \
    --ds-extra '{"data_types": {"grad_accum_dtype": "bf16"}}' --out "$out/reference_bf16acc.md" 2>&1 \
    | grep "^| " | tail -5
