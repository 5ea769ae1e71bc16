#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Why ZenFlow needs more optimizer steps than plain offload to reach a loss: the same model, data and seed under
# plain ZeRO-2 offload and ZenFlow variants that each remove one cause (staleness of the overlapped host step, the
# update interval of the unselected rows, the share selected, the warm-up, a selection made once), then the steps
# each needs to reach a few losses (docs/offload.md, ZenFlow). Runs on the CPU by default (a small model; set MODEL
# for another one, e.g. the reference model on a GPU).
#
#   bash benchmarks/zenflow_ablation.sh OUT_DIR [STEPS]
set -u
OUT=${1:?output dir}
STEPS=${2:-100}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC2206
MODEL=(${MODEL:---device cpu --d-model 128 --layers 4 --heads 4 --vocab 1024 --seq 64 --micro-batch 4 --gas 2 --lr 1e-3})
run() {
    local name=$1
    shift
    timeout "${T_RUN:-600}" python3 benchmarks/train_bench.py "${MODEL[@]}" --warmup 0 --steps "$STEPS" "$@" \
        --out "$OUT/$name.md" >"$OUT/$name.log" 2>&1
    grep "^| ds" "$OUT/$name.md" | sed "s/^/$name /"
}
run offload --systems ds_zero2+offload
run zf_default --systems ds_zero2+zenflow
run zf_no_overlap --systems ds_zero2+zenflow --zenflow-no-overlap
run zf_interval2 --systems ds_zero2+zenflow --zenflow-update-interval 2
run zf_interval1 --systems ds_zero2+zenflow --zenflow-update-interval 1 --zenflow-no-overlap
run zf_topk05 --systems ds_zero2+zenflow --zenflow-topk 0.5
run zf_warmup10 --systems ds_zero2+zenflow --ds-extra '{"zero_optimization": {"zenflow": {"full_warm_up_rounds": 10}}}'
run zf_reselect8 --systems ds_zero2+zenflow --zenflow-select-strategy step --zenflow-select-interval 8
python3 - "$OUT" "${THRESHOLDS:-6.6 6.4 6.2}" <<'PY'
import glob, json, os, sys
out, thresholds = sys.argv[1], [float(t) for t in sys.argv[2].split()]
print("| run | steps to " + " / ".join(map(str, thresholds)) + " (5-step mean of the loss) | mean of the last 10 |")
print("| --- | ---: | ---: |")
for path in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
    for line in open(path):
        row = json.loads(line)
        if "losses" not in row:
            continue
        losses = row["losses"]
        means = [sum(losses[i - 4:i + 1]) / 5 for i in range(4, len(losses))]
        steps = [next((i + 5 for i, m in enumerate(means) if m <= t), None) for t in thresholds]
        print(f"| {os.path.basename(path)[:-6]} | {' / '.join(str(s) for s in steps)} | {sum(losses[-10:]) / 10:.4f} |")
PY
