#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ZenFlow's CPU probe (benchmarks/zenflow_probe.py): plain AdamW, the plain-torch ZenFlow this package implements,
# the plain-torch model of upstream 0.19.8's ZenFlow, and this package's engine on 2 ranks, with and without
# overlap_step; with UPSTREAM_PYTHON (a python whose deepspeed is upstream's) upstream's engine too, and a check
# that the model of upstream reproduces upstream's parameters step by step (one rank, 20 steps).
# Writes OUT/probe.jsonl (one line per run: losses per step) and OUT/probe.md (the table).
#
#   bash benchmarks/zenflow_probe.sh OUT_DIR [STEPS]
set -u
OUT=${1:?output dir}
STEPS=${2:-60}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
LR=${LR:-1e-3}
export DS_ACCELERATOR=cpu
BASE='"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 2, "update_interval": 2, "full_warm_up_rounds": 1'
: >"$OUT/probe.jsonl"
for overlap in false true; do
    zf="{$BASE, \"overlap_step\": $overlap}"
    for system in adamw reference upstream-model; do
        "$PY" benchmarks/zenflow_probe.py --system "$system" --world 2 --steps "$STEPS" --lr "$LR" --zenflow "$zf" \
            --label "$system, overlap_step $overlap" >>"$OUT/probe.jsonl" 2>>"$OUT/probe.log"
    done
    "$PY" -m torch.distributed.run --nproc_per_node 2 benchmarks/zenflow_probe.py --system engine --steps "$STEPS" \
        --lr "$LR" --zenflow "$zf" --label "this package, overlap_step $overlap" 2>>"$OUT/probe.log" |
        grep '^{' >>"$OUT/probe.jsonl"
    if [ -n "${UPSTREAM_PYTHON:-}" ]; then
        DS_BENCH_UPSTREAM=1 "$UPSTREAM_PYTHON" -m torch.distributed.run --nproc_per_node 2 benchmarks/zenflow_probe.py \
            --system engine --steps "$STEPS" --lr "$LR" --zenflow "$zf" --label "upstream, overlap_step $overlap" \
            2>>"$OUT/probe.log" | grep '^{' >>"$OUT/probe.jsonl"
        # one rank, 20 steps: upstream's parameters after every step against the model of upstream
        DS_BENCH_UPSTREAM=1 "$UPSTREAM_PYTHON" -m torch.distributed.run --nproc_per_node 1 benchmarks/zenflow_probe.py \
            --system engine --steps 20 --lr "$LR" --zenflow "$zf" --dump "$OUT/upstream_$overlap.pt" \
            >/dev/null 2>>"$OUT/probe.log"
        "$PY" benchmarks/zenflow_probe.py --system upstream-model --world 1 --steps 20 --lr "$LR" --zenflow "$zf" \
            --compare "$OUT/upstream_$overlap.pt" 2>>"$OUT/probe.log" | grep "^step" >"$OUT/model_vs_upstream_$overlap.txt"
        tail -n 1 "$OUT/model_vs_upstream_$overlap.txt"
    fi
done
"$PY" - "$OUT/probe.jsonl" "$OUT/probe.md" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
lines = ["| run | first loss | loss after 10 / 30 steps | mean of the last 10 |", "| --- | ---: | ---: | ---: |"]
for r in rows:
    l = r["losses"]
    lines.append(f"| {r['system']} | {l[0]:.4f} | {l[min(9, len(l) - 1)]:.4f} / {l[min(29, len(l) - 1)]:.4f} | "
                 f"{r['mean_last10']:.4f} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
