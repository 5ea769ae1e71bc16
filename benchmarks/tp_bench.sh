#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Tensor-parallel (AutoTP) training, this package and upstream DeepSpeed 0.19.8 side by side, one command:
#
#   bash benchmarks/tp_bench.sh WHEELS OUT          # one GPU, about 100 s: the cost of the machinery at tp 1
#   bash benchmarks/tp_bench.sh WHEELS OUT N        # N GPUs (torchrun): tp 2 and 4 against upstream's AutoTP
#   SMOKE=1 bash benchmarks/tp_bench.sh WHEELS OUT  # CPU, a tiny model: checks the script, measures nothing
#
# WHEELS: upstream's wheels from ../shared/tools/upstream-wheels.sh (deepspeed 0.19.8 and its pure-Python
# dependencies; upstream is skipped when there are none); OUT: a folder for tp_bench.jsonl, tp_bench.md and the
# log. Every run is its own process and prints the deepspeed it imported.
#
# One GPU: ours plain, ours at tp 1 through the tensor-parallel layers (the collectives are skipped: what remains
# is the cost of the layers and their autograd functions), then upstream the same way while time is left. A
# Llama-3-8B-shaped model, LAYERS (4) of its decoder layers, bf16, AdamW, ZeRO-1, seq 2048, micro-batch 2. The
# whole script stays within BUDGET seconds (110): each run gets what is left (at most SYSTEM_TIMEOUT, 45).
#
# N GPUs: for tp in 2 and 4 (those dividing N): AutoTP + ZeRO-1 and + ZeRO-2, ours and upstream's, through
# deepspeed.initialize alone; and ZeRO-3 alone (no tensor parallelism), both packages; at each micro-batch of MB
# ("1 2 4 8": an out-of-memory run reports its error and the next runs). LAYERS 8, BUDGET 3000 and
# SYSTEM_TIMEOUT 150 by default: ten runs a micro-batch on 4 GPUs, so a device call of 600 s holds about one MB value.
set -u
WHEELS=${1:?usage: tp_bench.sh WHEELS OUT [NGPUS]}
OUT=${2:?usage: tp_bench.sh WHEELS OUT [NGPUS]}
NGPU=${3:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
if [ "$NGPU" -gt 1 ]; then
    BUDGET=${BUDGET:-3000} LAYERS=${LAYERS:-8} T=${SYSTEM_TIMEOUT:-150}
else
    BUDGET=${BUDGET:-110} LAYERS=${LAYERS:-4} T=${SYSTEM_TIMEOUT:-45}
fi
if [ "${SMOKE:-0}" = 1 ]; then
    SIZE="--device cpu --layers 2 --d_model 64 --mlp 96 --heads 4 --kv_heads 2 --vocab 257 --seq 16 --warmup 1 --steps 2"
else
    SIZE="--layers $LAYERS"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
: >"$OUT/tp_bench.jsonl"
: >"$OUT/tp_bench.log"

run() {  # run PYTHONPATH ARGS...: one process (torchrun with NGPU > 1), within the budget
    local path=$1
    shift
    local left=$((BUDGET - ($(date +%s) - START)))
    local limit=$((left < T ? left : T))
    if [ "$limit" -lt 10 ]; then
        echo "budget spent: skipped $*" | tee -a "$OUT/tp_bench.log"
        return
    fi
    local launch=(python3)
    if [ "$NGPU" -gt 1 ]; then launch=(torchrun --standalone --nproc_per_node "$NGPU"); fi
    # shellcheck disable=SC2086
    PYTHONPATH=$path timeout "$limit" "${launch[@]}" benchmarks/tp_bench.py "$@" $SIZE 2>>"$OUT/tp_bench.log" |
        awk -v f="$OUT/tp_bench.jsonl" '{print} /^\{/ {print >>f; fflush(f)}'
}

UPSTREAM=""
if ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1; then
    rm -rf /tmp/upstream
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl \
        >>"$OUT/tp_bench.log" 2>&1 && UPSTREAM=/tmp/upstream
fi
[ -n "$UPSTREAM" ] || echo "no upstream wheels in $WHEELS: upstream skipped" | tee -a "$OUT/tp_bench.log"

if [ "$NGPU" -le 1 ]; then
    run "$PWD" --system plain
    run "$PWD" --system autotp --tp 1
    if [ -n "$UPSTREAM" ]; then
        run "$UPSTREAM" --system autotp --tp 1
        run "$UPSTREAM" --system plain
    fi
else
    for mb in ${MB:-1 2 4 8}; do
        for tp in 2 4; do
            [ $((NGPU % tp)) -eq 0 ] || continue
            for stage in 1 2; do
                run "$PWD" --system autotp --tp "$tp" --stage "$stage" --micro_batch "$mb"
                [ -z "$UPSTREAM" ] || run "$UPSTREAM" --system autotp --tp "$tp" --stage "$stage" --micro_batch "$mb"
            done
        done
        run "$PWD" --system plain --stage 3 --micro_batch "$mb"
        [ -z "$UPSTREAM" ] || run "$UPSTREAM" --system plain --stage 3 --micro_batch "$mb"
    done
fi

python3 - "$OUT/tp_bench.jsonl" <<'PY' | tee "$OUT/tp_bench.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
# against ours plain at the same micro-batch (one GPU: ZeRO-1; N GPUs: ZeRO-3 alone)
ref = {r["micro_batch"]: r for r in rows if r["system"] == "plain" and "error" not in r}
print("| system | tp | ZeRO | micro-batch | median step (s) | tokens/s | vs ours plain | peak mem (GiB) | first loss | "
      "last loss | deepspeed |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
for r in rows:
    head = f"| {r['system']} | {r['tp']} | {r['stage']} | {r['micro_batch']} |"
    if "error" in r:
        print(f"{head} error: {r['error'][:100]} | | | | | | {r['deepspeed_file']} |")
        continue
    base = ref.get(r["micro_batch"])
    ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "-"
    print(f"{head} {r['median_step_s']} | {r['tokens_per_s']:,} | {ratio} | {r['peak_mem_gib']} | "
          f"{r['first_loss']} | {r['last_loss']} | {r['deepspeed_file']} |")
PY
echo "total $(($(date +%s) - START)) s"
