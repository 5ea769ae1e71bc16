#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The long-sequence comparison of docs/performance.md on one GPU (benchmarks/sp_bench.py), in pieces that each fit
# one 10-minute call:
#   bash benchmarks/sp_limit_bench.sh throughput OUT   # 16 layers: tokens/s at 128k, both (upstream first);
#                                                      # MEASURE_STEPS=N: median of N measured steps a side (1)
#   bash benchmarks/sp_limit_bench.sh slope OUT        # 1 layer + the other 15 layers' state held: peaks at 256k, 512k
#   bash benchmarks/sp_limit_bench.sh limit-upstream OUT   # 1 layer + the other layers' device state and pinned
#   bash benchmarks/sp_limit_bench.sh limit-ours OUT       #   host inputs held: steps at LENGTHS (comma-separated)
# UPSTREAM (default /tmp/upstream) holds upstream's installed package (benchmarks/README or docs/performance.md).
set -euo pipefail
mode=$1
out=${2:-sp_results}
up=${UPSTREAM:-/tmp/upstream}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
export MASTER_PORT=${MASTER_PORT:-29511}
bench="python3 $here/benchmarks/sp_bench.py --upstream-path $up"
case $mode in
throughput)
  $bench --impl both --start 65536 --cap 65536 --compare-at 131072 --measure-steps "${MEASURE_STEPS:-1}" \
    --out "$out/sp_throughput_128k.json" ;;
slope)
  $bench --impl both --layers 1 --start 262144 --cap 524288 --no-throughput --out "$out/sp_slope_1layer.json" ;;
limit-upstream)
  PYTHONPATH=$up $bench --impl upstream --layers 1 --lengths "${LENGTHS:-1048576,1179648,1572864}" \
    --no-throughput --out "$out/sp_limit_1layer_upstream.json" ;;
limit-ours)
  PYTHONPATH=$here $bench --impl ours --layers 1 --lengths "${LENGTHS:-1048576,1835008,2097152}" \
    --no-throughput --out "$out/sp_limit_1layer_ours.json" ;;
*)
  echo "unknown mode $mode (throughput, slope, limit-upstream, limit-ours)" >&2; exit 2 ;;
esac
