#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ZenFlow's steps to loss in one command: this package's ZenFlow, upstream DeepSpeed's ZenFlow and plain AdamW
# (torch's, under DDP) on the same model, data, seed and config (ZeRO-2, CPU optimizer offload, topk_ratio 0.1,
# update_interval 4, overlap_step, the other ZenFlow keys at their defaults; GAS micro-batches per benchmark step,
# one engine.step() after each). Two of the runs share the GPU, so their step times are not comparable (this
# measures loss per step; benchmarks/zenflow_time_to_loss.sh measures time); each prints which deepspeed it
# imported, and each stops at a deadline instead of hanging: a run stopped early keeps the steps it finished (its
# per-step lines in OUT/*.log), marked "partial".
#
#   bash benchmarks/zenflow_steps_to_loss.sh OUT_DIR [STEPS=50]
#
# Upstream's package: UPSTREAM_WHEELS=DIR (../shared/tools/upstream-wheels.sh; default .whl-upstream when it
# exists), installed into /tmp/upstream, or UPSTREAM_PYTHON=PATH, a python whose `import deepspeed` is upstream's.
# MODEL="--device cpu --d-model 64 ..." replaces the reference model (a CPU smoke run); THRESHOLDS="9.0 8.8".
# UPSTREAM_EXT: the folder of upstream's JIT-built ops (default OUT/torch_extensions; reuse one to skip the build).
# Limits (s): DEADLINE 225 for every run (from the start), T_FIRST 130 for the first phase, T_SETUP 40 for installing
# and importing each package.
# Writes OUT/steps_to_loss.md (the table), OUT/steps_to_loss.png (with matplotlib) and each run's .md/.jsonl/.log
# (OUT/ours.*, OUT/upstream.*, OUT/adamw.*).
set -u
OUT=${1:?output dir}
STEPS=${2:-50}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-9.0}
# upstream's JIT builds go to a folder of their own (UPSTREAM_EXT), so that a stale lock can be cleared safely
UPSTREAM_EXT=${UPSTREAM_EXT:-$OUT/torch_extensions}
mkdir -p "$UPSTREAM_EXT"
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-225}
T_FIRST=${T_FIRST:-130}
T_SETUP=${T_SETUP:-40}
THRESHOLDS=${THRESHOLDS:-9.0 8.8}
# shellcheck disable=SC2206
MODEL=(${MODEL:-})
COMMON=("${MODEL[@]}" --warmup 0 --steps "$STEPS" --zenflow-topk 0.1 --zenflow-update-interval 4 --log-steps)
begin=$(date +%s)

UP_PY=${UPSTREAM_PYTHON:-}
UP_PATH=${PYTHONPATH:-}
WHEELS=${UPSTREAM_WHEELS:-}
[ -z "$UP_PY" ] && [ -z "$WHEELS" ] && [ -d .whl-upstream ] && WHEELS=.whl-upstream
if [ -n "$WHEELS" ]; then
    rm -rf /tmp/upstream
    timeout "$T_SETUP" python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream \
        "$WHEELS"/*.whl >"$OUT/upstream_pip.log" 2>&1 || { echo "installing upstream failed: $OUT/upstream_pip.log"; }
    UP_PY=python3
    UP_PATH=/tmp/upstream${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "$UP_PY" ]; then
    echo "no upstream package: set UPSTREAM_WHEELS or UPSTREAM_PYTHON" >&2
    exit 2
fi
# Which deepspeed each side imports, before any run (from /tmp, so that the working directory adds nothing).
WHICH='import deepspeed; print(deepspeed.__version__, deepspeed.__file__)'
ours=$(cd /tmp && PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout "$T_SETUP" "$PY" -c "$WHICH" \
    2>"$OUT/ours_import.log" | tail -n 1)
up=$(cd /tmp && PYTHONPATH=$UP_PATH timeout "$T_SETUP" "$UP_PY" -c "$WHICH" 2>"$OUT/upstream_import.log" | tail -n 1)
echo "ours imports deepspeed ${ours:-(failed: $OUT/ours_import.log)}"
echo "upstream imports deepspeed ${up:-(failed: $OUT/upstream_import.log)}"
case "$ours" in *"$ROOT/deepspeed/"*) ;; *) echo "ours is not this repository's package" >&2; exit 2 ;; esac
case "$up" in "" | *"$ROOT/"*) echo "upstream's package did not import (or imported this one)" >&2; exit 2 ;; esac

# Phase 1, together: ours, plain AdamW (GPU work only), and the build of upstream's CPU Adam (JIT, about a minute);
# phase 2: upstream's run, alone, with the time left before the deadline. Two ZenFlow runs at once would share the
# host cores their host steps are pinned to.
timeout "$T_FIRST" "$PY" benchmarks/train_bench.py "${COMMON[@]}" --systems ds_zero2+zenflow \
    --out "$OUT/ours.md" >"$OUT/ours.log" 2>&1 &
timeout "$T_FIRST" "$PY" benchmarks/train_bench.py "${COMMON[@]}" --systems ddp \
    --out "$OUT/adamw.md" >"$OUT/adamw.log" 2>&1 &
BUILD='from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder("CPUAdamBuilder").load()'
(cd /tmp && TORCH_EXTENSIONS_DIR=$UPSTREAM_EXT PYTHONPATH=$UP_PATH timeout "$T_FIRST" "$UP_PY" -c "$BUILD" \
    >"$OUT/upstream_build.log" 2>&1 ||
    echo "building upstream's CPU Adam failed (the run builds it): $OUT/upstream_build.log") &
wait
# A JIT build stopped by its deadline leaves its lock file, and the next load would wait on it for ever.
find "$UPSTREAM_EXT" -name lock -delete 2>/dev/null
left=$((DEADLINE - ($(date +%s) - begin)))
[ "$left" -lt 10 ] && left=10  # (timeout 0 would mean no limit)
echo "phase 1 ended after $(($(date +%s) - begin)) s; upstream's run gets $left s"
DS_BENCH_UPSTREAM=1 TORCH_EXTENSIONS_DIR=$UPSTREAM_EXT PYTHONPATH=$UP_PATH timeout "$left" "$UP_PY" \
    benchmarks/train_bench.py "${COMMON[@]}" --systems ds_zero2+zenflow --out "$OUT/upstream.md" \
    >"$OUT/upstream.log" 2>&1
echo "runs ended after $(($(date +%s) - begin)) s"
for name in ours upstream; do  # (plain AdamW uses torch only)
    grep -h -m1 "deepspeed: " "$OUT/$name.md" 2>/dev/null | sed "s/^- /$name: /"
done

# One row per run: its JSON line when it finished, else the steps its log recorded (partial).
"$PY" - "$OUT" "$STEPS" <<'PY'
import json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
labels = {"ours": "this package, ZenFlow", "upstream": "upstream 0.19.8, ZenFlow", "adamw": "plain AdamW (DDP)"}
for name, label in labels.items():
    rows, partial = [], []
    path = os.path.join(out, name + ".jsonl")
    if os.path.exists(path):
        rows = [json.loads(line) for line in open(path) if line.strip()]
    log = os.path.join(out, name + ".log")
    for line in open(log) if os.path.exists(log) else []:
        if line.startswith('{"step_of"'):
            partial.append(json.loads(line))
    if rows and rows[0].get("status") == "ok":
        row = rows[0]
    elif partial:
        row = dict(system=partial[0]["step_of"], status="ok", losses=[p["loss"] for p in partial],
                   step_times_s=[p["time_s"] for p in partial], warmup_times_s=[])
        label += f" (partial: {len(partial)} of {steps} steps)"
    else:
        err = rows[0].get("error") if rows else f"no step finished, see {log}"
        row = dict(system=name, status="error", error=err)
    row["label"] = label
    with open(os.path.join(out, name + "_row.jsonl"), "w") as handle:
        handle.write(json.dumps(row) + "\n")
PY
"$PY" benchmarks/time_to_loss.py --thresholds $THRESHOLDS --out "$OUT/steps_to_loss.md" \
    --title "ZenFlow steps to loss, $STEPS steps (runs in parallel: step times not comparable)" \
    "$OUT/ours_row.jsonl" "$OUT/upstream_row.jsonl" "$OUT/adamw_row.jsonl" \
    $("$PY" -c "import matplotlib" 2>/dev/null && echo --plot "$OUT/steps_to_loss.png")
# The losses side by side every 5 steps.
"$PY" - "$OUT" <<'PY' | tee -a "$OUT/steps_to_loss.md"
import json, sys
rows = [json.loads(open(f"{sys.argv[1]}/{n}_row.jsonl").readline()) for n in ("ours", "upstream", "adamw")]
n = max((len(r.get("losses", [])) for r in rows), default=0)
print("\n| step | " + " | ".join(r["label"] for r in rows) + " |\n| ---: |" + " ---: |" * len(rows))
for i in sorted(set(range(0, n, 5)) | {n - 1}) if n else []:
    cells = [f"{r['losses'][i]:.4f}" if i < len(r.get("losses", [])) else "" for r in rows]
    print(f"| {i + 1} | " + " | ".join(cells) + " |")
PY
echo "total $(($(date +%s) - begin)) s"
