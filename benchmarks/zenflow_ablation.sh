#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ZenFlow against plain offload in optimizer steps to a loss: the same model, data and seed under plain ZeRO-2
# offload and ZenFlow variants (the window update of the unselected rows, overlap_step, re-selection, warm-up), then
# the steps each needs to reach a few losses (docs/offload.md, ZenFlow). Runs on the CPU by default (a small model
# whose loss falls fast in the first 20 steps, like the reference model's on a GPU; set MODEL for another one) with
# the benchmark's ZenFlow config (topk 0.1, update_interval 4, overlap_step) unless a run says otherwise.
#
#   bash benchmarks/zenflow_ablation.sh OUT_DIR [STEPS]        (RUNS="offload zf_scaled ..." for a subset)
set -u
OUT=${1:?output dir}
STEPS=${2:-60}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
# shellcheck disable=SC2206
MODEL=(${MODEL:---device cpu --d-model 128 --layers 4 --heads 4 --vocab 1024 --seq 64 --micro-batch 4 --gas 2 --lr 1e-3})
zf() {  # a ds-extra zenflow section: zf KEY VALUE ... (values as JSON)
    local body="" sep=""
    while [ $# -gt 0 ]; do body="$body$sep\"$1\": $2"; sep=", "; shift 2; done
    echo "{\"zero_optimization\": {\"zenflow\": {$body}}}"
}
declare -A ARGS=(
    [offload]="--systems ds_zero2+offload"
    [zf_once]="--systems ds_zero2+zenflow --ds-extra $(zf window_update '"once"' overlap_apply_after '"window"' | tr -d ' ')"
    [zf_once_apply2]="--systems ds_zero2+zenflow --ds-extra $(zf window_update '"once"' | tr -d ' ')"
    [zf_once_no_overlap]="--systems ds_zero2+zenflow --zenflow-no-overlap --ds-extra $(zf window_update '"once"' | tr -d ' ')"
    [zf_once_interval1]="--systems ds_zero2+zenflow --zenflow-update-interval 1 --zenflow-no-overlap"
    [zf_scaled]="--systems ds_zero2+zenflow"
    [zf_scaled_apply1]="--systems ds_zero2+zenflow --ds-extra $(zf overlap_apply_after 1 | tr -d ' ')"
    [zf_scaled_apply_window]="--systems ds_zero2+zenflow --ds-extra $(zf overlap_apply_after '"window"' | tr -d ' ')"
    [zf_scaled_no_overlap]="--systems ds_zero2+zenflow --zenflow-no-overlap"
    [zf_sqrt]="--systems ds_zero2+zenflow --ds-extra $(zf window_update '"sqrt"' | tr -d ' ')"
    [zf_scaled_warmup2]="--systems ds_zero2+zenflow --ds-extra $(zf full_warm_up_rounds 2 | tr -d ' ')"
    [zf_sqrt_warmup4]="--systems ds_zero2+zenflow --ds-extra $(zf window_update '"sqrt"' full_warm_up_rounds 4 | tr -d ' ')"
    [zf_scaled_topk02]="--systems ds_zero2+zenflow --zenflow-topk 0.2"
    [zf_repeat]="--systems ds_zero2+zenflow --ds-extra $(zf window_update '"repeat"' | tr -d ' ')"
    [zf_scaled_reselect8]="--systems ds_zero2+zenflow --zenflow-select-strategy step --zenflow-select-interval 8"
    [zf_scaled_reselect12]="--systems ds_zero2+zenflow --zenflow-select-strategy step --zenflow-select-interval 12"
    [zf_scaled_apply1_reselect8]="--systems ds_zero2+zenflow --zenflow-select-strategy step --zenflow-select-interval 8 --ds-extra $(zf overlap_apply_after 1 | tr -d ' ')"
    [zf_scaled_reselect16]="--systems ds_zero2+zenflow --zenflow-select-strategy step --zenflow-select-interval 16"
    [zf_scaled_warmup4]="--systems ds_zero2+zenflow --ds-extra $(zf full_warm_up_rounds 4 | tr -d ' ')"
    [zf_scaled_interval2]="--systems ds_zero2+zenflow --zenflow-update-interval 2"
)
ORDER=(offload zf_once zf_once_no_overlap zf_once_interval1 zf_once_apply2 zf_scaled zf_scaled_apply1
    zf_scaled_apply_window zf_scaled_no_overlap zf_repeat zf_sqrt zf_sqrt_warmup4 zf_scaled_warmup2 zf_scaled_topk02
    zf_scaled_reselect8 zf_scaled_reselect12 zf_scaled_reselect16 zf_scaled_apply1_reselect8 zf_scaled_warmup4
    zf_scaled_interval2)
# shellcheck disable=SC2206
RUNS=(${RUNS:-${ORDER[@]}})
for name in "${RUNS[@]}"; do
    # shellcheck disable=SC2086
    timeout "${T_RUN:-600}" "$PY" benchmarks/train_bench.py "${MODEL[@]}" --warmup 0 --steps "$STEPS" ${ARGS[$name]} \
        --out "$OUT/$name.md" >"$OUT/$name.log" 2>&1 || echo "$name failed: see $OUT/$name.log"
done
"$PY" - "$OUT" "${THRESHOLDS:-6.6 6.4 6.2}" "${RUNS[*]}" <<'PY'
import json, os, statistics, sys
out, thresholds, runs = sys.argv[1], [float(t) for t in sys.argv[2].split()], sys.argv[3].split()
print("| run | steps to " + " / ".join(map(str, thresholds)) + " (5-step mean of the loss) | mean of the last 10 "
      "| median step (s) |")
print("| --- | ---: | ---: | ---: |")
for name in runs:
    path = os.path.join(out, name + ".jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    rows = [r for r in rows if "losses" in r]
    if not rows:
        print(f"| {name} | failed | - | - |")
        continue
    losses = rows[0]["losses"]
    means = [sum(losses[i - 4:i + 1]) / 5 for i in range(4, len(losses))]
    steps = [next((i + 5 for i, m in enumerate(means) if m <= t), None) for t in thresholds]
    print(f"| {name} | {' / '.join(str(s) for s in steps)} | {sum(losses[-10:]) / 10:.4f} "
          f"| {statistics.median(rows[0]['step_times_s']):.3f} |")
PY
