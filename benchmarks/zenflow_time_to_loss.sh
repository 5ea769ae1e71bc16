#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Time to loss: plain ZeRO-2 optimizer offload against ZenFlow (topk_ratio 0.1, update_interval 4, overlap_step, the
# other keys at their defaults) on the same model, data and initialisation, for STEPS optimizer steps each (no
# untimed warm-up: every step's time counts), then the table of benchmarks/time_to_loss.py (first step at or below
# each loss, its cumulative step time, the loss after the last step) and a plot of loss against time.
# VARIANTS="name:JSON ..." adds ZenFlow runs with a zenflow section merged over that config (one train_bench run
# each), e.g. VARIANTS='once:{"window_update":"once","overlap_apply_after":"window"}'.
# REUSE_BASE=1 keeps OUT/base.jsonl of an earlier call (only the variants run).
# The reference model on one GPU by default; MODEL="--device cpu --d-model 128 ..." for a small one.
#
#   bash benchmarks/zenflow_time_to_loss.sh OUT_DIR [STEPS]
set -u
OUT=${1:?output dir}
STEPS=${2:-40}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
# shellcheck disable=SC2206
MODEL=(${MODEL:-})
THRESHOLDS=${THRESHOLDS:-9.0 8.8}
COMMON=("${MODEL[@]}" --warmup 0 --steps "$STEPS" --zenflow-topk 0.1 --zenflow-update-interval 4)
files=("$OUT/base.jsonl")
if [ "${REUSE_BASE:-0}" != 1 ] || [ ! -f "$OUT/base.jsonl" ]; then
    timeout "${T_RUN:-600}" "$PY" benchmarks/train_bench.py "${COMMON[@]}" --systems ds_zero2+offload,ds_zero2+zenflow \
        --out "$OUT/base.md" >"$OUT/base.log" 2>&1 || echo "base run failed: see $OUT/base.log"
fi
for variant in ${VARIANTS:-}; do
    name=${variant%%:*}
    section=${variant#*:}
    timeout "${T_RUN:-600}" "$PY" benchmarks/train_bench.py "${COMMON[@]}" --systems ds_zero2+zenflow \
        --ds-extra "{\"zero_optimization\": {\"zenflow\": $section}}" --out "$OUT/$name.md" >"$OUT/$name.log" 2>&1 ||
        echo "variant $name failed: see $OUT/$name.log"
    # label the row by the variant's name
    "$PY" - "$OUT/$name.jsonl" "$name" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in open(path) if line.strip()]
with open(path, "w") as handle:
    for row in rows:
        row["label"] = f"{row['system']} {name}"
        handle.write(json.dumps(row) + "\n")
PY
    files+=("$OUT/$name.jsonl")
done
# shellcheck disable=SC2086
"$PY" benchmarks/time_to_loss.py --thresholds $THRESHOLDS --out "$OUT/time_to_loss.md" --plot "$OUT/time_to_loss.png" \
    --title "time to loss, $STEPS steps" "${files[@]}"
