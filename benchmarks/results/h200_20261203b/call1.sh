# call A: nvme_bench (upstream's ZeRO-Infinity) then tp_bench, on HEAD's deepspeed/ and csrc/ (.head/commit)
set -u
S=$(date +%s)
rm -rf deepspeed csrc && tar xf .head/src.tar && echo "deepspeed/ and csrc/ from commit $(cat .head/commit)"
R=/tmp/res; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"
echo "== nvme_bench"
TOTAL=370 T_DISK=12 T_MECH=1 T_BUILD=60 T_OURS=60 T_UPSTREAM=220 T_CPU=0 \
    bash benchmarks/nvme_bench.sh .whl-upstream .nvme-debs $R/nvme
echo "nvme_bench exit $? at $(($(date +%s) - S)) s"
echo "== tp_bench"
BUDGET=$((560 - ($(date +%s) - S))); [ $BUDGET -gt 150 ] && BUDGET=150
BUDGET=$BUDGET bash benchmarks/tp_bench.sh .whl-upstream $R/tp
echo "tp_bench exit $? at $(($(date +%s) - S)) s"
