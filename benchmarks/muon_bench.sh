#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Muon at ZeRO-2 and ZeRO-3 on one GPU: this package (Muon, and AdamW as the baseline) against upstream 0.19.8's
# Muon, one process per system. Run from the repository root: `bash benchmarks/muon_bench.sh` (about 4-5 minutes
# on one H100; OUT=<dir> keeps the JSON lines in $OUT/muon_bench.jsonl). `bash benchmarks/muon_bench.sh tiny` runs
# the same logic on the CPU in a minute.
set -u
SIZE=${1:-gpu}
T=${SYSTEM_TIMEOUT:-75}
if [ "$SIZE" = gpu ] && [ ! -d /tmp/upstream/deepspeed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream .whl-upstream/*.whl
fi
UPSTREAM=${UPSTREAM_PATH:-/tmp/upstream}
for system in ours_muon_z2 ours_muon_z3 ours_adamw_z2 ours_adamw_z3; do
    PYTHONPATH=$PWD timeout $T python3 benchmarks/muon_bench.py --system $system --size "$SIZE" 2>/dev/null | tail -1 \
        || echo "{\"system\": \"$system\", \"status\": \"failed or timed out ($T s)\"}"
done
for system in upstream_muon_z2 upstream_muon_z3; do
    PYTHONPATH=$UPSTREAM timeout $T python3 benchmarks/muon_bench.py --system $system --size "$SIZE" 2>/dev/null | tail -1 \
        || echo "{\"system\": \"$system\", \"status\": \"failed or timed out ($T s)\"}"
done
