#!/usr/bin/env bash
# One-GPU checks of the gradient pipeline: the native kernels against their references, the contract matrix at
# world 1 on CUDA (world-of-one paths, kernels, offload), and the launch-bound benchmark with and without the
# native kernels. Usage: bash benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
python3 -m pytest tests/gpu/test_native_ops.py -q -x -p no:cacheprovider > "$out/native_ops.log" 2>&1
tail -3 "$out/native_ops.log"
DS_GPU_WORLD=1 DS_GPU_MATRIX_BUDGET_S=${MATRIX_BUDGET_S:-150} python3 -m tests.gpu.test_nccl_contract \
    > "$out/contract_w1.log" 2>&1
grep -v "^PASS" "$out/contract_w1.log" | tail -15
small=(--d-model 512 --layers 48 --heads 8 --vocab 8192 --seq 512 --micro-batch 8 --gas 2)
python3 benchmarks/train_bench.py --systems ds_zero1,ds_zero2,ddp,ds_zero3,ds_zero0 "${small[@]}" --warmup 3 \
    --steps 8 --out "$out/launch_native.md" 2>&1 | grep "^| "
DS_NATIVE_GRAD_OPS=0 python3 benchmarks/train_bench.py --systems ds_zero1,ds_zero2,ds_zero3 "${small[@]}" \
    --warmup 3 --steps 8 --out "$out/launch_torch_ops.md" 2>&1 | grep "^| " | tail -3
python3 benchmarks/profile_step.py --systems ds_zero1,ds_zero2 "${small[@]}" --top 12 > "$out/profile.md" 2>&1
grep -v "^\[20\|USDT\|Warn\|_warn" "$out/profile.md" | head -70
