#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# How long save_checkpoint blocks the training loop, per writer, ours against upstream 0.19.8's and torch's
# async_save, on one GPU in one command (about 4 minutes on one H100):
#   bash benchmarks/checkpoint_bench.sh [.whl-upstream]
# Writes $OUT/checkpoint_bench.jsonl (one line per system) and $OUT/checkpoint_bench.md (the table).
# Checkpoints go to $CKPT_BENCH_DIR (default /tmp/ckpt_bench) and are removed after each system.
set -u
WHEELS=${1:-.whl-upstream}
OUT=${OUT:-/tmp/checkpoint_bench_out}
mkdir -p "$OUT"
RESULT="$OUT/checkpoint_bench.jsonl"
rm -f "$RESULT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext-ckpt-bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
df -h "${CKPT_BENCH_DIR:-/tmp}" | tail -1
T=${SYSTEM_TIMEOUT:-45}
for system in ours_sync ours_fast ours_decoupled; do
    PYTHONPATH=$PWD timeout "$T" python3 benchmarks/checkpoint_bench.py --system $system --out "$RESULT" \
        || echo "{\"system\": \"$system\", \"error\": \"exit $? (timeout ${T}s?)\"}" >> "$RESULT"
done
timeout "$T" python3 benchmarks/checkpoint_bench.py --system torch_dcp_async --out "$RESULT" \
    || echo "{\"system\": \"torch_dcp_async\", \"error\": \"exit $?\"}" >> "$RESULT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/upstream
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl
    for system in upstream_sync upstream_fast upstream_decoupled upstream_python upstream_decoupledpython; do
        DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream timeout "$T" python3 benchmarks/checkpoint_bench.py \
            --system $system --out "$RESULT" \
            || echo "{\"system\": \"$system\", \"error\": \"exit $? (timeout ${T}s?)\"}" >> "$RESULT"
    done
else
    echo "no upstream wheels in $WHEELS: upstream's rows skipped"
fi
python3 - "$RESULT" "$OUT/checkpoint_bench.md" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
out = ["| system | device | checkpoint (GB) | median step (s) | save call (s) | loop blocked (s) | to durable (s) "
       "| on disk (s) |",
       "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
for r in rows:
    if "error" in r:
        out.append(f"| {r['system']} | error: {r['error'][:120]} | | | | | | |")
        continue
    durable = sum(s["durable_s"] for s in r["saves"]) / len(r["saves"])
    on_disk = sum(s.get("on_disk_s", s["durable_s"]) for s in r["saves"]) / len(r["saves"])
    out.append(f"| {r['system']} | {r['device']} | {r['checkpoint_bytes_per_save'] / 1e9:.2f} | {r['median_step_s']:.3f} | "
               f"{r['call_s_mean']:.2f} | {r['blocked_s_mean']:.2f} | {durable:.2f} | {on_disk:.2f} |")
text = "\n".join(out)
print(text)
open(sys.argv[2], "w").write(text + "\n")
PY
