#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# engine.offload_states() / reload_states() of the reference model's ZeRO-3 engine (GPT d_model 2048, 24 layers,
# bf16, AdamW), this package then upstream DeepSpeed 0.19.8, on one GPU, with the pinned host<->device bandwidth
# of the same machine measured in each run (benchmarks/offload_states_bench.py).
#
#   bash benchmarks/offload_states_bench.sh [WHEELS_DIR] [OUT_DIR]
#
# WHEELS_DIR (default .whl-upstream) holds upstream's wheels; OUT_DIR (default $OUT, else /tmp/offload_states)
# receives offload_states.jsonl (one line per side), offload_states.md (the table) and log.txt. About 4 minutes on
# one H100 (upstream JIT-builds FusedAdam, about a minute). T_OURS, T_UPSTREAM: time limits (s).
set -u
WHEELS=${1:-.whl-upstream}
OUT=${2:-${OUT:-/tmp/offload_states}}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
mkdir -p "$OUT"
LOG="$OUT/log.txt"
RESULTS="$OUT/offload_states.jsonl"
: >"$RESULTS"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl >>"$LOG" 2>&1
echo "== ours" | tee -a "$LOG"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${T_OURS:-150}" python3 benchmarks/offload_states_bench.py --side ours --out "$RESULTS" >>"$LOG" 2>&1
echo "== upstream" | tee -a "$LOG"
(cd /tmp && PYTHONPATH=/tmp/upstream timeout "${T_UPSTREAM:-210}" python3 "$OLDPWD/benchmarks/offload_states_bench.py" \
    --side upstream --out "$RESULTS") >>"$LOG" 2>&1
python3 - "$RESULTS" >"$OUT/offload_states.md" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| side | deepspeed | GPU | state GB | offload s | reload s | offload GB/s (% pinned D2H) | "
      "reload GB/s (% pinned H2D) | left on device GB | first cycle off/re s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    steady = r["cycles"][1:] or r["cycles"]
    off = statistics.median(c["offload_s"] for c in steady)
    re_ = statistics.median(c["reload_s"] for c in steady)
    gb = r["state_bytes"] / 1e9
    d2h, h2d = r["pinned_d2h_gbs"] or float("nan"), r["pinned_h2d_gbs"] or float("nan")
    left = max(c["left_bytes"] for c in steady) / 1e9
    first = r["cycles"][0]
    print(f"| {r['side']} | {r['deepspeed']} | {r['gpu']} | {gb:.2f} | {off:.3f} | {re_:.3f} | "
          f"{gb / off:.1f} ({100 * gb / off / d2h:.0f}%) | {gb / re_:.1f} ({100 * gb / re_ / h2d:.0f}%) | {left:.3f} | "
          f"{first['offload_s']:.2f}/{first['reload_s']:.2f} |")
print()
print("pinned bandwidth measured in each run (GB/s, H2D / D2H): " +
      ", ".join(f"{r['side']} {r['pinned_h2d_gbs']:.1f} / {r['pinned_d2h_gbs']:.1f}" for r in rows
                if r["pinned_h2d_gbs"]))
PY
cat "$OUT/offload_states.md"
