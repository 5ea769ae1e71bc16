#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Muon at ZeRO-2 and ZeRO-3 on one GPU: this package (Muon, and AdamW as the baseline) against upstream 0.19.8's
# Muon, one process per system (benchmarks/muon_bench.py). Run from the repository root:
#     OUT=<dir> bash benchmarks/muon_bench.sh          # one H100: 4-5 minutes, never more than 330 s
# It installs .whl-upstream/*.whl into /tmp/upstream (once), prints one JSON line per system and, with OUT set,
# appends them to $OUT/muon_bench.jsonl. `bash benchmarks/muon_bench.sh tiny` runs the same logic on the CPU.
set -u
SIZE=${1:-gpu}
BUDGET=${BUDGET:-330}
UPSTREAM=${UPSTREAM_PATH:-/tmp/upstream}
if [ "$SIZE" = gpu ] && [ ! -d "$UPSTREAM/deepspeed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$UPSTREAM" .whl-upstream/*.whl
fi
START=$SECONDS
run() {  # system, python path, its own limit in seconds
    local left=$((BUDGET - (SECONDS - START)))
    local limit=$(($3 < left ? $3 : left))
    if [ "$limit" -le 5 ]; then
        echo "{\"system\": \"$1\", \"status\": \"not run: the ${BUDGET} s budget is spent\"}"
        return
    fi
    PYTHONPATH=$2 timeout "$limit" python3 benchmarks/muon_bench.py --system "$1" --size "$SIZE" 2>/dev/null | tail -1 \
        | grep . || echo "{\"system\": \"$1\", \"status\": \"failed or timed out ($limit s)\"}"
}
# upstream compiles its Newton-Schulz with torch.compile in the warm-up steps: a longer limit
run ours_muon_z2 "$PWD" 60
run upstream_muon_z2 "$UPSTREAM" 140
run ours_muon_z3 "$PWD" 60
run upstream_muon_z3 "$UPSTREAM" 45
run ours_adamw_z2 "$PWD" 50
run ours_adamw_z3 "$PWD" 50
