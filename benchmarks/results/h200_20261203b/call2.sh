# call B: the 128k throughput (MEASURE_STEPS a side) then the pipeline's medium workload, on HEAD's deepspeed/
set -u
S=$(date +%s)
rm -rf deepspeed csrc && tar xf .head/src.tar && echo "deepspeed/ and csrc/ from commit $(cat .head/commit)"
R=/tmp/res; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf /tmp/upstream && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream .whl-upstream/*.whl
echo "== sp_limit_bench throughput, MEASURE_STEPS=${MEASURE_STEPS:-4}"
MEASURE_STEPS=${MEASURE_STEPS:-4} timeout -k 5 ${T_SP:-380} bash benchmarks/sp_limit_bench.sh throughput $R/sp
echo "sp exit $? at $(($(date +%s) - S)) s"
echo "== pipe_bench medium"
B=$((565 - ($(date +%s) - S))); [ $B -gt 170 ] && B=170
PIPE_BENCH_BUDGET=$B PIPE_WORKLOADS=medium PIPE_CAP_OURS=55 PIPE_CAP_UPSTREAM=110 \
    bash benchmarks/pipe_bench.sh $R/pipe .whl-upstream one
echo "pipe exit $? at $(($(date +%s) - S)) s"
