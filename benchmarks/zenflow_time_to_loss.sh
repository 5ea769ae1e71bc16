#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Time to loss: plain ZeRO-2 optimizer offload against ZenFlow (topk_ratio 0.1, update_interval 4, overlap_step, the
# other keys at their defaults) on the same model, data and initialisation, for STEPS benchmark steps each (each
# step: the GAS micro-batches, one engine.step() after each; no untimed warm-up: every step's time counts), then the
# table of benchmarks/time_to_loss.py (first step at or below each loss, its cumulative step time, the loss after
# the last step) and a plot of loss against time.
# Upstream DeepSpeed's ZenFlow in the same run, same settings (its own package, DS_BENCH_UPSTREAM=1):
#   UPSTREAM_WHEELS=DIR    upstream's wheels (../shared/tools/upstream-wheels.sh), installed into /tmp/upstream
#   UPSTREAM_PYTHON=PATH   or a python whose `import deepspeed` is upstream's (a venv with deepspeed==0.19.8)
# VARIANTS="name:JSON ..." adds ZenFlow runs with a zenflow section merged over that config (one train_bench run
# each), e.g. VARIANTS='once:{"window_update":"once","overlap_apply_after":"window"}'.
# REUSE_BASE=1 keeps OUT/base.jsonl of an earlier call (only the variants and upstream run).
# T_BASE, T_UPSTREAM, T_RUN: time limits (s) of the base run, the upstream run and each variant.
# BASE_SYSTEMS: this package's systems of the base run (default ds_zero2+offload,ds_zero2+zenflow; add ds_zero2 for
# no offload). WARMUP: untimed steps before the STEPS timed ones (default 0); their times and losses still count in
# the time to a loss. The table gives each system's median and mean timed step.
# The reference model on one GPU by default; MODEL="--device cpu --d-model 128 ..." for a small one.
#
#   bash benchmarks/zenflow_time_to_loss.sh OUT_DIR [STEPS]
set -u
OUT=${1:?output dir}
STEPS=${2:-40}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PY=${PYTHON:-python3}
# shellcheck disable=SC2206
MODEL=(${MODEL:-})
THRESHOLDS=${THRESHOLDS:-9.0 8.8}
COMMON=("${MODEL[@]}" --warmup "${WARMUP:-0}" --steps "$STEPS" --zenflow-topk 0.1 --zenflow-update-interval 4)
BASE_SYSTEMS=${BASE_SYSTEMS:-ds_zero2+offload,ds_zero2+zenflow}

label() {  # label the rows of a JSON-lines file: label FILE PREFIX
    "$PY" - "$1" "$2" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in open(path) if line.strip()]
with open(path, "w") as handle:
    for row in rows:
        row["label"] = f"{name} {row['system']}" if name == "upstream" else f"{row['system']} {name}"
        handle.write(json.dumps(row) + "\n")
PY
}

files=("$OUT/base.jsonl")
if [ "${REUSE_BASE:-0}" != 1 ] || [ ! -f "$OUT/base.jsonl" ]; then
    timeout "${T_BASE:-600}" "$PY" benchmarks/train_bench.py "${COMMON[@]}" --systems "$BASE_SYSTEMS" \
        --out "$OUT/base.md" >"$OUT/base.log" 2>&1 || echo "base run failed: see $OUT/base.log"
fi
UP_PY=${UPSTREAM_PYTHON:-}
UP_PATH=${PYTHONPATH:-}
if [ -n "${UPSTREAM_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$UPSTREAM_WHEELS"/*.whl \
        >/tmp/zenflow_ttl_pip.log 2>&1
    UP_PY=python3
    UP_PATH=/tmp/upstream${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "$UP_PY" ]; then
    DS_BENCH_UPSTREAM=1 PYTHONPATH=$UP_PATH timeout "${T_UPSTREAM:-600}" "$UP_PY" benchmarks/train_bench.py "${COMMON[@]}" \
        --systems ds_zero2+zenflow --out "$OUT/upstream.md" >"$OUT/upstream.log" 2>&1 ||
        echo "upstream run failed: see $OUT/upstream.log"
    grep -m1 "deepspeed: " "$OUT/upstream.md" 2>/dev/null
    if [ -f "$OUT/upstream.jsonl" ]; then
        label "$OUT/upstream.jsonl" upstream
        files+=("$OUT/upstream.jsonl")
    fi
fi
for variant in ${VARIANTS:-}; do
    name=${variant%%:*}
    section=${variant#*:}
    timeout "${T_RUN:-600}" "$PY" benchmarks/train_bench.py "${COMMON[@]}" --systems ds_zero2+zenflow \
        --ds-extra "{\"zero_optimization\": {\"zenflow\": $section}}" --out "$OUT/$name.md" >"$OUT/$name.log" 2>&1 ||
        echo "variant $name failed: see $OUT/$name.log"
    label "$OUT/$name.jsonl" "$name"
    files+=("$OUT/$name.jsonl")
done
# shellcheck disable=SC2086
"$PY" benchmarks/time_to_loss.py --thresholds $THRESHOLDS --out "$OUT/time_to_loss.md" --plot "$OUT/time_to_loss.png" \
    --title "time to loss, $STEPS steps" "${files[@]}"
