#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# NVMe offload (ZeRO-Infinity) on one GPU and its local disk, this package against upstream DeepSpeed 0.19.8, in one
# command (docs/offload.md, "NVMe offload", "Measured"):
#
#   1. the disk: dd with O_DIRECT (its raw bandwidth) against ds_io (the async_io op) on the folder the runs use, 1 GiB
#      each way, and the mechanism table of docs/ops.md there (thread pool, Python threads, io_uring; 512 MiB);
#   2. the reference GPT (d_model 2048, 24 layers, seq 2048, micro-batch 4, GAS 2, bf16, AdamW, clip 1.0; 1.3e9
#      parameters), ZeRO-3 with parameters and optimizer on NVMe (benchmarks/systems.py, "+nvme": the same keys for
#      both implementations): this package, then upstream's ZeRO-Infinity on the same disk; then this package's CPU
#      offload of the same model (the host memory the disk tier saves). Step time, GPU peak, host RSS (peak resident
#      memory of the process during the timed steps), first and last loss.
#
# Prepare once, in the repository root on the CPU machine (both folders are ignored by git and must be carried):
#
#   bash ../shared/tools/upstream-wheels.sh .whl-upstream                       # upstream 0.19.8 and its deps
#   mkdir -p .nvme-debs && (cd .nvme-debs && apt-get download libaio1 libaio-dev)   # upstream's op needs libaio
#
# Run (one H200, about 7-8 minutes; every section has its own time limit, so the command ends within 9):
#
#   device run, carry [".whl-upstream", ".nvme-debs"]:   bash benchmarks/nvme_bench.sh .whl-upstream .nvme-debs $OUT
#
# Files in OUT: summary.md (everything below, in tables), disk.md, mechanisms.md, ours.jsonl, upstream.jsonl,
# cpu_offload.jsonl, log.txt. The libaio packages are unpacked under /tmp/libaio (never into /) and reach upstream's
# JIT build through CPATH, LIBRARY_PATH, CFLAGS, LDFLAGS and LD_LIBRARY_PATH. NVME_DIR (default
# /var/tmp/nvme_bench: on the disk, where /tmp may be a tmpfs) is the folder the runs swap into; the summary names its
# file system. STEPS (2) timed steps after WARMUP (1); T_* are the sections' time limits (s: 45 + 35 + 150 + 220 +
# 50, plus about 15 s of set-up).
# A larger model, one that fills host memory without NVMe (18 bytes an element with CPU offload: 7e9 parameters for
# 128 GiB), needs about 100 GB of swap files: more than this machine's 64 GiB disk, so it is not run here.
set -u
WHEELS=${1:?upstream wheels folder}
DEBS=${2:?libaio .deb folder}
OUT=${3:?output folder}
NVME_DIR=${NVME_DIR:-/var/tmp/nvme_bench}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
T_DISK=${T_DISK:-45}
T_MECH=${T_MECH:-35}
T_OURS=${T_OURS:-150}
T_UPSTREAM=${T_UPSTREAM:-220}
T_CPU=${T_CPU:-50}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext}
mkdir -p "$OUT" "$NVME_DIR"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.md"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

{
    echo "# NVMe offload benchmark: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores"
    echo
    echo "- kernel $(uname -r); NVME_DIR $NVME_DIR on $(df -hT "$NVME_DIR" | tail -1 | awk '{print $1 " (" $2 ", " $3 ", " $5 " free)"}')"
    if [ "$(df --output=fstype "$NVME_DIR" | tail -1)" = tmpfs ]; then echo "- WARNING: NVME_DIR is a tmpfs (memory)"; fi
    echo "- python3 $(python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)')"
} >"$SUMMARY"

# -- setup: upstream's wheels, libaio for upstream's op
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl >>"$LOG" 2>&1
mkdir -p /tmp/libaio
for deb in "$DEBS"/*.deb; do dpkg -x "$deb" /tmp/libaio; done
AIO_LIB=$(dirname "$(find /tmp/libaio -name 'libaio.so*' | head -1)")
export CPATH=/tmp/libaio/usr/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$AIO_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=$AIO_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CFLAGS="-I/tmp/libaio/usr/include ${CFLAGS:-}" LDFLAGS="-L$AIO_LIB ${LDFLAGS:-}"
echo "- libaio from $DEBS unpacked: $(ls "$AIO_LIB" | tr '\n' ' ')" >>"$SUMMARY"

# -- 1. the disk
echo "== disk ($(elapsed) s)" | tee -a "$LOG"
timeout "$T_DISK" bash -c '
    d=$1
    f=$d/dd_probe.bin
    echo "| tool (1 GiB, O_DIRECT) | write GB/s | read GB/s |"
    echo "| --- | ---: | ---: |"
    w=$(dd if=/dev/zero of=$f bs=64M count=16 oflag=direct conv=fsync 2>&1 | tail -1 | awk "{for(i=1;i<=NF;i++) if(\$i==\"s,\") print 1073741824/\$(i-1)/1e9}")
    r=$(dd if=$f of=/dev/null bs=64M iflag=direct 2>&1 | tail -1 | awk "{for(i=1;i<=NF;i++) if(\$i==\"s,\") print 1073741824/\$(i-1)/1e9}")
    rm -f $f
    printf "| dd, 64 MiB requests | %.2f | %.2f |\n" "$w" "$r"
    for lanes in "8 1" "32 2"; do
        set -- $d $lanes
        python3 -c "
import sys
from deepspeed.nvme.ds_io import measure
qd, lanes = int(sys.argv[2]), int(sys.argv[3])
r = measure(sys.argv[1], 1 << 30, queue_depth=qd, io_parallel=lanes, loops=2)
print(\"| ds_io (async_io op), 1 MiB blocks, queue depth %d x %d lanes | %.2f | %.2f |\" % (qd, lanes, r[\"write\"], r[\"read\"]))
" "$@"
        d=$1
    done
' _ "$NVME_DIR" >"$OUT/disk.md" 2>>"$LOG"
timeout "$T_MECH" bash benchmarks/aio_mechanisms.sh "$NVME_DIR" 512 1 32 >"$OUT/mechanisms.md" 2>>"$LOG"
{ echo; echo "## The disk"; echo; cat "$OUT/disk.md"; echo; cat "$OUT/mechanisms.md"; } >>"$SUMMARY"

# -- 2. the reference model, ZeRO-3 with parameters and optimizer on NVMe: ours, upstream's; ours with CPU offload
BENCH=(--warmup "$WARMUP" --steps "$STEPS" --nvme-path "$NVME_DIR" ${BENCH_EXTRA:-})
run() {  # run LABEL LIMIT [env...] -- train_bench args
    local label=$1 limit=$2
    shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    echo "== $label ($(elapsed) s)" | tee -a "$LOG"
    rm -rf "$NVME_DIR"/zero_stage_3
    env "${envs[@]}" timeout "$limit" python3 benchmarks/train_bench.py "${BENCH[@]}" "$@" --out "$TMP/$label.md" \
        >>"$LOG" 2>&1 || echo "   $label ended with status $? (time limit $limit s?)" | tee -a "$LOG"
    grep -h "deepspeed:" "$TMP/$label.md" 2>/dev/null | head -1 | tee -a "$LOG"
    cp "$TMP/$label.jsonl" "$OUT/" 2>/dev/null
}
TMP=$(mktemp -d)
run ours "$T_OURS" DS_BENCH_UPSTREAM=0 -- --systems ds_zero3+nvme
run upstream "$T_UPSTREAM" DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream -- --systems ds_zero3+nvme
run cpu_offload "$T_CPU" DS_BENCH_UPSTREAM=0 -- --systems ds_zero3+offload
rm -rf "$NVME_DIR"/zero_stage_3

python3 - "$OUT" >>"$SUMMARY" <<'EOF'
import json, os, sys
out = sys.argv[1]
print("\n## ZeRO-3, reference GPT (1.3e9 parameters), one GPU\n")
print("| run | status | median step (s) | GPU peak (GiB) | host RSS in steps (GiB) | host RSS at set-up (GiB) | "
      "first loss | last loss |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for label, what in (("ours", "this package, parameters and optimizer on NVMe"),
                    ("upstream", "upstream 0.19.8 ZeRO-Infinity, the same config"),
                    ("cpu_offload", "this package, CPU offload (no disk tier)")):
    path = os.path.join(out, f"{label}.jsonl")
    if not os.path.exists(path):
        print(f"| {what} | no result (see log.txt) | | | | | | |")
        continue
    for line in open(path):
        r = json.loads(line)
        f = lambda k, s=".2f": "-" if r.get(k) is None else format(r[k], s)
        status = r["status"] if r["status"] == "ok" else (r["status"] + ": " + r.get("error", ""))[:120]
        print(f"| {what} | {status} | {f('median_step_s', '.3f')} | {f('peak_mem_gib')} | {f('host_rss_gib')} | "
              f"{f('host_setup_rss_gib')} | {f('first_loss', '.4f')} | {f('final_loss', '.4f')} |")
EOF
echo "- total $(elapsed) s" >>"$SUMMARY"
cat "$SUMMARY"
