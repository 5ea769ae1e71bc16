#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Pipeline parallelism on the GPT-style decoder of benchmarks/gpt.py, side by side with plain torch and upstream
# DeepSpeed 0.19.8, in one command:
#
#   bash benchmarks/pipe_bench.sh [OUT=pipe-bench-out] [UPSTREAM=.whl-upstream] [MODE=one]
#
# MODE one (one GPU, within PIPE_BENCH_BUDGET=145 seconds in all): the schedule machinery at pp 1 against plain
#   training: torch, this package's engine, its pipeline with 1F1B and with ZB-H1, and, with UPSTREAM, upstream's
#   engine and pipeline; two workloads (launch-bound small layers; a 0.24B decoder at seq 1024). PIPE_WORKLOADS
#   ("launch medium") picks workloads; PIPE_CAP_OURS (45) and PIPE_CAP_UPSTREAM (30) cap each side's process (s).
# MODE multi (every GPU of the host, NGPU of them): pp 2 and 4 (those that divide NGPU; the rest of the GPUs are
#   data parallel), GAS 8 and 16: this package's 1F1B, interleaved 1F1B and ZB-H1, and upstream's 1F1B with
#   UPSTREAM; one torchrun launch per system (at most 300 s each, all within PIPE_BENCH_BUDGET=580 seconds).
#
# UPSTREAM holds the wheels ../shared/tools/upstream-wheels.sh builds (upstream deepspeed without ops and its
# pure-Python dependencies); without it only this package's systems run. Every process prints which deepspeed it
# imported (IMPORTED lines). Writes OUT/results.jsonl (one RESULT line per system and workload), OUT/results.md
# (the table) and OUT/log.txt. PIPE_BENCH_DEVICE=cpu runs a tiny model on CPU (gloo; NGPU ranks in multi mode,
# default 2) to check the script without a GPU.
set -u
OUT=${1:-pipe-bench-out}
UP=${2:-.whl-upstream}
MODE=${3:-one}
DEVICE=${PIPE_BENCH_DEVICE:-cuda}
BUDGET=${PIPE_BENCH_BUDGET:-145}
[ "$MODE" = multi ] && BUDGET=${PIPE_BENCH_BUDGET:-580}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cpu ]; then
    tiny="--device cpu --d-model 32 --layers 4 --heads 4 --vocab 64 --seq 16 --micro-batch 2 --warmup 1 --steps 2"
    NGPU=${NGPU:-2}
    export OMP_NUM_THREADS=1
else
    tiny=""
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
fi
up_path=""
if [ -d "$UP" ] && ls "$UP"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream-pipe "$UP"/*.whl \
        && up_path=/tmp/upstream-pipe
fi
: > "$OUT/results.jsonl"
: > "$OUT/log.txt"

# run CAP PYTHONPATH ARGS...: one process (or torchrun launch), at most CAP seconds and what is left of the budget
run() {
    local cap=$1 path=$2
    shift 2
    local left=$((BUDGET - SECONDS - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 5 ]; then
        echo "skipped (budget spent): $*" | tee -a "$OUT/log.txt"
        return
    fi
    PYTHONPATH=$path timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$OUT/log.txt" | grep "^RESULT\|^IMPORTED" \
        | tee -a "$OUT/results.jsonl" | grep "^IMPORTED"
}

if [ "$MODE" = one ]; then
    # launch: small layers, many micro-batches (the step is bound by the host: per-instruction costs show);
    # medium: 0.24B parameters at seq 1024 (the GPU is busy: what remains is the machinery's share).
    launch="--workload launch --d-model 512 --layers 8 --heads 8 --vocab 8192 --seq 256 --micro-batch 4 --gas 16"
    medium="--workload medium --d-model 1024 --layers 16 --heads 16 --vocab 32768 --seq 1024 --micro-batch 4 --gas 8"
    for name in ${PIPE_WORKLOADS:-launch medium}; do
        case $name in launch) w=$launch ;; medium) w=$medium ;; *) echo "unknown workload $name" >&2; exit 2 ;; esac
        run "${PIPE_CAP_OURS:-45}" "$PWD" python3 benchmarks/pipe_bench.py $w --warmup 3 --steps 10 $tiny \
            ${tiny:+--gas 2} --systems torch,ds_engine,ds_pipe,ds_pipe_zb
        if [ -n "$up_path" ]; then
            run "${PIPE_CAP_UPSTREAM:-30}" "$up_path" python3 benchmarks/pipe_bench.py $w --warmup 3 --steps 10 $tiny \
                ${tiny:+--gas 2} --systems upstream_engine,upstream_pipe
        fi
    done
else
    port=29700
    for pp in 2 4; do
        if [ $((NGPU % pp)) -ne 0 ] || [ "$NGPU" -lt "$pp" ]; then
            echo "pp $pp skipped: $NGPU GPUs" | tee -a "$OUT/log.txt"
            continue
        fi
        for gas in 8 16; do
            systems="ds_pipe ds_pipe_il ds_pipe_zb"
            [ -n "$up_path" ] && systems="$systems upstream_pipe"
            for system in $systems; do
                path=$PWD
                [ "$system" = upstream_pipe ] && path=$up_path
                port=$((port + 1))
                run 300 "$path" torchrun --nproc_per_node="$NGPU" --master_port=$port benchmarks/pipe_bench.py \
                    --workload gpt-0.24B --pp "$pp" --gas "$gas" --d-model 1024 --layers 16 --heads 16 \
                    --vocab 32768 --seq 1024 --micro-batch 4 --warmup 3 --steps 10 $tiny --systems "$system"
            done
        done
    done
fi
python3 benchmarks/pipe_bench.py --summarize "$OUT/results.jsonl" | tee "$OUT/results.md"
echo "total ${SECONDS}s"
