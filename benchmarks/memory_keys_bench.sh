#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Peak GPU memory of the memory keys on one GPU, this package against upstream DeepSpeed 0.19.8 with the same keys:
# a baseline (bf16, ZeRO-1, every block under deepspeed.checkpointing.checkpoint), then
# activation_checkpointing.cpu_checkpointing, then bf16.bf16_master_weights_and_grads + bf16_optimizer_states
# (benchmarks/memory_keys_bench.py; GPT d_model 2048, 24 layers, seq 1024, micro-batch 8, 3 steps).
#
#   bash benchmarks/memory_keys_bench.sh            # from the repository root; about 3 minutes on one H100
#
# First the GPU check of the asynchronous cpu_checkpointing path (tests/gpu/test_checkpoint_offload.py, seconds).
#
# Upstream's wheels come from .whl-upstream/ (installed into /tmp/upstream). Results: $OUT (default
# /tmp/memory_keys_bench): ours.jsonl, upstream.jsonl, memory_keys.md (printed at the end), log.txt.
# BENCH_EXTRA: more options for every run (e.g. "--tiny --cpu" for a dry run of the script on a host without GPU).
set -u
DIR=${OUT:-/tmp/memory_keys_bench}
mkdir -p "$DIR"
rm -f "$DIR/ours.jsonl" "$DIR/upstream.jsonl"
LOG="$DIR/log.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1
# shellcheck disable=SC2206
EXTRA=(${BENCH_EXTRA:-})
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream .whl-upstream/*.whl >>"$LOG" 2>&1
# the asynchronous offload path on the GPU: bitwise gradients, inputs freed (tests/gpu/test_checkpoint_offload.py)
timeout "${T_TESTS:-60}" python3 -m tests.gpu.test_checkpoint_offload 2>&1 | tee -a "$LOG" | tail -n 3
for case in baseline cpu_ckpt bf16_masters; do
    timeout "${T_RUN:-60}" python3 benchmarks/memory_keys_bench.py --case "$case" --out "$DIR/ours.jsonl" "${EXTRA[@]}" \
        >>"$LOG" 2>&1 || echo "ours $case failed (rc $?), see $LOG"
done
for case in baseline cpu_ckpt bf16_masters; do
    DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "${T_RUN:-60}" python3 benchmarks/memory_keys_bench.py \
        --case "$case" --out "$DIR/upstream.jsonl" "${EXTRA[@]}" >>"$LOG" 2>&1 || echo "upstream $case failed (rc $?), see $LOG"
done
grep "\[memory_keys_bench\]" "$LOG"
python3 benchmarks/memory_keys_bench.py --table "$DIR"
