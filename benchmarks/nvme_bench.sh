#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# NVMe offload (ZeRO-Infinity) on one GPU and its local disk, this package against upstream DeepSpeed 0.19.8, in one
# command that ends within TOTAL seconds (default 235; docs/offload.md, "NVMe offload", "Measured"):
#
#   0. preflight (fails at once, naming the cause): the GPU, upstream's wheels, a writable NVME_DIR; which deepspeed
#      each side imports (version and folder, printed and checked: ours from this tree, upstream's from its wheels);
#      whether upstream's async_io op can be built (libaio); a side that cannot run is reported, not waited for;
#   1. the disk: dd with O_DIRECT (its raw bandwidth) against ds_io (the async_io op) on NVME_DIR, and the mechanism
#      table of docs/ops.md (thread pool, Python threads, io_uring);
#   1b. this package's ops (host Adam, async_io) built, so that its runs time training, not a first compilation;
#   2. a GPT of the reference shape (d_model 2048, seq 2048, micro-batch 4, GAS 2, bf16, AdamW, clip 1.0) with
#      LAYERS layers (default 8: 0.5e9 parameters, so that both sides, upstream's JIT builds included, fit the time
#      limit; LAYERS=24 is the 1.3e9 reference model, which needs TOTAL=600), ZeRO-3 with parameters and optimizer
#      on NVMe (benchmarks/systems.py, "+nvme": the same keys for both): this package, then upstream's ZeRO-Infinity
#      on the same disk; then this package's CPU offload of the same model. Step time, GPU peak, host RSS (peak
#      resident memory during the timed steps), first and last loss;
#   3. the ledger of this package's host buffers under NVMe offload (benchmarks/nvme_host_memory.py, a small model).
#
# Prepare once, in the repository root on the CPU machine (both folders are ignored by git and must be carried):
#
#   bash ../shared/tools/upstream-wheels.sh .whl-upstream                       # upstream 0.19.8 and its deps
#   mkdir -p .nvme-debs && (cd .nvme-debs && apt-get download libaio1 libaio-dev)   # upstream's op needs libaio
#
# Run (one H200; TOTAL=235 s for everything, the device command's limit 270 s):
#
#   device run, carry [".whl-upstream", ".nvme-debs"], timeout_s 270:
#       bash benchmarks/nvme_bench.sh .whl-upstream .nvme-debs $OUT
#
# DEBS may be "-" (or a missing folder) where libaio is installed; without it upstream's side is reported as not run.
# CPU smoke test of the script itself (a tiny model, gloo; upstream's side runs only if its ops build in time):
#
#   DEVICE=cpu TOTAL=120 MODEL="--d-model 64 --layers 2 --heads 2 --vocab 512 --seq 32 --micro-batch 2" \
#       DISK_MB=64 bash benchmarks/nvme_bench.sh .whl-upstream .nvme-debs /tmp/nvme_smoke
#
# Files in OUT: summary.md (everything, in tables), disk.md, mechanisms.md, ours.jsonl, upstream.jsonl,
# cpu_offload.jsonl, host_memory.json, log.txt. libaio is unpacked under /tmp/libaio (never into /) and reaches upstream's JIT build
# through CPATH, LIBRARY_PATH, CFLAGS, LDFLAGS and LD_LIBRARY_PATH. NVME_DIR (default /var/tmp/nvme_bench: on the
# disk, where /tmp may be a tmpfs) is the folder the runs swap into; the summary names its file system. STEPS (2)
# timed steps after WARMUP (1). T_* cap the sections (s); each also gets no more than the time left before TOTAL.
# Exit status: 2 when a precondition fails (nothing measured), 1 when a run did not finish, else 0.
set -u -o pipefail
WHEELS=${1:?usage: nvme_bench.sh WHEELS DEBS OUT}
DEBS=${2:?usage: nvme_bench.sh WHEELS DEBS OUT}
OUT=${3:?usage: nvme_bench.sh WHEELS DEBS OUT}
DEVICE=${DEVICE:-cuda}
TOTAL=${TOTAL:-235}
NVME_DIR=${NVME_DIR:-/var/tmp/nvme_bench}
LAYERS=${LAYERS:-8}
MODEL=${MODEL:---d-model 2048 --layers $LAYERS --seq 2048 --micro-batch 4 --gas 2}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
DISK_MB=${DISK_MB:-1024}
T_DISK=${T_DISK:-20}
T_MECH=${T_MECH:-20}
T_BUILD=${T_BUILD:-70}
T_OURS=${T_OURS:-60}
T_UPSTREAM=${T_UPSTREAM:-110}
T_CPU=${T_CPU:-30}
T_LEDGER=${T_LEDGER:-25}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext}
start=$(date +%s)
deadline=$((start + TOTAL))
elapsed() { echo $(($(date +%s) - start)); }
# limit WANT: WANT seconds, or what is left before the deadline (less a margin for the summary)
limit() {
    local left=$((deadline - $(date +%s) - 5))
    echo $(($1 < left ? $1 : left))
}
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac
case "$WHEELS" in /*) ;; *) WHEELS=$PWD/$WHEELS ;; esac
case "$DEBS" in /* | -) ;; *) DEBS=$PWD/$DEBS ;; esac
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.md"
: >"$LOG"
die() {  # a precondition failed: say which, keep what was written, exit 2
    echo "nvme_bench: $*" | tee -a "$LOG" "$SUMMARY" >&2
    exit 2
}
say() { echo "$*" | tee -a "$LOG"; }

# -- 0. preflight
{
    echo "# NVMe offload benchmark ($DEVICE): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores"
    echo
} >"$SUMMARY"
ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1 || die "no deepspeed-*.whl in '$WHEELS' (upstream's wheels; see the header)"
mkdir -p "$NVME_DIR" && touch "$NVME_DIR/.probe" && rm -f "$NVME_DIR/.probe" || die "NVME_DIR '$NVME_DIR' is not writable"
{
    echo "- kernel $(uname -r); NVME_DIR $NVME_DIR on $(df -hT "$NVME_DIR" | tail -1 | awk '{print $1 " (" $2 ", " $3 ", " $5 " free)"}')"
    if [ "$(df --output=fstype "$NVME_DIR" | tail -1)" = tmpfs ]; then echo "- WARNING: NVME_DIR is a tmpfs (memory)"; fi
    echo "- model: $MODEL; $WARMUP warm-up and $STEPS timed steps; time limit $TOTAL s"
} >>"$SUMMARY"
say "== preflight ($(elapsed) s)"
if [ "$DEVICE" = cuda ]; then
    timeout -k 5 60 python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU visible to torch'" >>"$LOG" 2>&1 ||
        die "torch sees no GPU (DEVICE=cpu runs the CPU smoke test)"
fi
rm -rf /tmp/upstream
timeout -k 5 60 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$WHEELS"/*.whl \
    >>"$LOG" 2>&1 || die "installing upstream's wheels from '$WHEELS' failed (log.txt)"
if [ "$DEBS" != - ] && ls "$DEBS"/*.deb >/dev/null 2>&1 && command -v dpkg >/dev/null; then
    mkdir -p /tmp/libaio
    for deb in "$DEBS"/*.deb; do dpkg -x "$deb" /tmp/libaio >>"$LOG" 2>&1 || say "cannot unpack $deb"; done
    AIO_LIB=$(dirname "$(find /tmp/libaio -name 'libaio.so*' | head -1)")
    export CPATH=/tmp/libaio/usr/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$AIO_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$AIO_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export CFLAGS="-I/tmp/libaio/usr/include ${CFLAGS:-}" LDFLAGS="-L$AIO_LIB ${LDFLAGS:-}"
    echo "- libaio unpacked from $DEBS: $(ls "$AIO_LIB" | tr '\n' ' ')" >>"$SUMMARY"
else
    echo "- libaio: no packages unpacked (none given, or no dpkg); the system's, if any" >>"$SUMMARY"
fi
# which deepspeed each side imports, from a neutral folder (a '' entry on sys.path must not pick this tree up)
WHICH='import os, deepspeed; print("=>", deepspeed.__version__, os.path.dirname(os.path.abspath(deepspeed.__file__)))'
ours_ds=$(cd /tmp && PYTHONPATH=$REPO timeout -k 5 60 python3 -c "$WHICH" 2>>"$LOG" | sed -n "s/^=> //p") ||
    die "this package does not import from $REPO (log.txt)"
case "$ours_ds" in *" $REPO/deepspeed") ;; *) die "this side imported deepspeed $ours_ds, not $REPO/deepspeed" ;; esac
upstream_ds=$(cd /tmp && PYTHONPATH=/tmp/upstream timeout -k 5 60 python3 -c "$WHICH" 2>"$OUT/upstream_import.txt" |
    sed -n "s/^=> //p")
cat "$OUT/upstream_import.txt" >>"$LOG"
upstream_skip=""
case "$upstream_ds" in
    "0.19.8 /tmp/upstream/deepspeed") ;;
    "") upstream_skip="its import failed: $(grep -v '^ ' "$OUT/upstream_import.txt" | tail -1)" ;;
    *) upstream_skip="upstream imported '$upstream_ds', not 0.19.8 from /tmp/upstream/deepspeed" ;;
esac
rm -f "$OUT/upstream_import.txt"
if [ -z "$upstream_skip" ]; then
    # upstream's AsyncIOBuilder checks for libaio without building; its JIT build would fail later and slower
    aio_ok=$(cd /tmp && PYTHONPATH=/tmp/upstream timeout -k 5 60 python3 -c \
        "from deepspeed.ops.op_builder import AsyncIOBuilder; print('=>', AsyncIOBuilder().is_compatible(verbose=False))" \
        2>>"$LOG" | sed -n "s/^=> //p")
    [ "$aio_ok" = True ] || upstream_skip="upstream's async_io op cannot be built here (libaio missing? '$aio_ok'; log.txt)"
fi
{
    echo "- this package imported: deepspeed $ours_ds"
    echo "- upstream imported: deepspeed ${upstream_ds:-(import failed)}${upstream_skip:+; NOT RUN: $upstream_skip}"
    echo "- python3 $(python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)')"
} | tee -a "$LOG" >>"$SUMMARY"

# -- 1. the disk
say "== disk ($(elapsed) s)"
timeout -k 5 "$(limit "$T_DISK")" bash -c '
    d=$1 mb=$2
    f=$d/dd_probe.bin
    n=$((mb / 64 * 64 * 1048576))
    echo "| tool ($mb MiB, O_DIRECT) | write GB/s | read GB/s |"
    echo "| --- | ---: | ---: |"
    w=$(dd if=/dev/zero of=$f bs=64M count=$((mb / 64)) oflag=direct conv=fsync 2>&1 | tail -1 | awk -v n=$n "{for(i=1;i<=NF;i++) if(\$i==\"s,\") print n/\$(i-1)/1e9}")
    r=$(dd if=$f of=/dev/null bs=64M iflag=direct 2>&1 | tail -1 | awk -v n=$n "{for(i=1;i<=NF;i++) if(\$i==\"s,\") print n/\$(i-1)/1e9}")
    rm -f $f
    printf "| dd, 64 MiB requests | %.2f | %.2f |\n" "$w" "$r"
    PYTHONPATH=$3 python3 -c "
import sys
from deepspeed.nvme.ds_io import measure
r = measure(sys.argv[1], int(sys.argv[2]) << 20, queue_depth=32, io_parallel=2, loops=2)
print(\"| ds_io (async_io op), 1 MiB blocks, queue depth 32 x 2 lanes | %.2f | %.2f |\" % (r[\"write\"], r[\"read\"]))
" "$d" "$mb"
' _ "$NVME_DIR" "$DISK_MB" "$REPO" >"$OUT/disk.md" 2>>"$LOG" || say "   disk ended with status $? (time limit?)"
PYTHONPATH=$REPO timeout -k 5 "$(limit "$T_MECH")" bash benchmarks/aio_mechanisms.sh "$NVME_DIR" $((DISK_MB > 128 ? DISK_MB / 2 : 64)) 1 32 \
    >"$OUT/mechanisms.md" 2>>"$LOG" || say "   mechanisms ended with status $? (time limit?)"
{ echo; echo "## The disk"; echo; cat "$OUT/disk.md"; echo; cat "$OUT/mechanisms.md"; } >>"$SUMMARY"

# -- 1b. this package's ops (the host Adam and async_io), built before its runs so that their limits time training,
# not compilation (a first build takes most of a minute; upstream's builds stay inside its run, as its users see)
say "== build this package's ops ($(elapsed) s; TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST})"
(cd /tmp && PYTHONPATH=$REPO timeout -k 5 "$(limit "$T_BUILD")" python3 -c "
import time
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    t = time.time()
    builder.load()
    print('   built', builder.NAME, 'in %.1f s' % (time.time() - t))
") 2>>"$LOG" | tee -a "$LOG" || say "   the build ended with status $? (time limit?)"

# -- 2. the model, ZeRO-3 with parameters and optimizer on NVMe: ours, upstream's; ours with CPU offload
failed=0
run() {  # run LABEL LIMIT [env...] -- train_bench args
    local label=$1 want=$2 lim status
    shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    lim=$(limit "$want")
    if [ "$lim" -lt 10 ]; then
        say "== $label: not run, $lim s left of the time limit"
        failed=1
        return
    fi
    say "== $label ($(elapsed) s, limit $lim s)"
    rm -rf "$NVME_DIR"/zero_stage_3 "$NVME_DIR"/zero_stage_[12]
    # $MODEL is split into words on purpose
    env "${envs[@]}" timeout -k 10 "$lim" python3 benchmarks/train_bench.py --device "$DEVICE" --warmup "$WARMUP" \
        --steps "$STEPS" --nvme-path "$NVME_DIR" $MODEL ${BENCH_EXTRA:-} "$@" --out "$TMP/$label.md" >>"$LOG" 2>&1
    status=$?
    [ $status -eq 0 ] || { say "   $label ended with status $status$([ $status -ge 124 ] && echo ": time limit $lim s")"; failed=1; }
    grep -h "deepspeed:" "$TMP/$label.md" 2>/dev/null | head -1 | sed "s/^- /   $label imported /" | tee -a "$LOG"
    cp "$TMP/$label.jsonl" "$OUT/" 2>/dev/null
}
TMP=$(mktemp -d)
run ours "$T_OURS" DS_BENCH_UPSTREAM=0 -- --systems ds_zero3+nvme
if [ -z "$upstream_skip" ]; then
    # upstream's op builder parses each arch as major.minor integers: an arch with a suffix ("9.0a", which the GPU
    # machine presets) stops its async_io build with "invalid literal for int() with base 10: '0a'"
    UPSTREAM_ARCHS=$(echo "$TORCH_CUDA_ARCH_LIST" | sed -E 's/([0-9]+\.[0-9]+)[a-z]+/\1/g')
    run upstream "$T_UPSTREAM" DS_BENCH_UPSTREAM=1 PYTHONPATH=/tmp/upstream TORCH_CUDA_ARCH_LIST="$UPSTREAM_ARCHS" \
        -- --systems ds_zero3+nvme
else
    say "== upstream: not run: $upstream_skip"
fi
run cpu_offload "$T_CPU" DS_BENCH_UPSTREAM=0 -- --systems ds_zero3+offload
rm -rf "$NVME_DIR"/zero_stage_3 "$NVME_DIR"/zero_stage_[12]
# -- 3. what this package's host memory holds: the ledger of its host buffers (a small model, the same keys scaled;
# docs/offload.md, "What stays in host memory")
if [ "$(limit "$T_LEDGER")" -ge 10 ]; then
    say "== host memory ledger ($(elapsed) s)"
    PYTHONPATH=$REPO timeout -k 5 "$(limit "$T_LEDGER")" python3 benchmarks/nvme_host_memory.py --device "$DEVICE" \
        --nvme-path "$NVME_DIR" --out "$OUT/host_memory.json" >>"$LOG" 2>&1 || say "   the ledger ended with status $?"
    rm -rf "$NVME_DIR"/zero_stage_3
fi

python3 - "$OUT" "$MODEL" >>"$SUMMARY" <<'EOF'
import json, os, sys
out, model = sys.argv[1], sys.argv[2]
print(f"\n## ZeRO-3, GPT ({model}), one device\n")
print("| run | status | median step (s) | GPU peak (GiB) | host RSS in steps (GiB) | host RSS at set-up (GiB) | "
      "first loss | last loss |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for label, what in (("ours", "this package, parameters and optimizer on NVMe"),
                    ("upstream", "upstream 0.19.8 ZeRO-Infinity, the same config"),
                    ("cpu_offload", "this package, CPU offload (no disk tier)")):
    path = os.path.join(out, f"{label}.jsonl")
    if not os.path.exists(path):
        print(f"| {what} | no result (log.txt) | | | | | | |")
        continue
    for line in open(path):
        r = json.loads(line)
        f = lambda k, s=".2f": "-" if r.get(k) is None else format(r[k], s)
        status = r["status"] if r["status"] == "ok" else (r["status"] + ": " + r.get("error", ""))[:120]
        print(f"| {what} | {status} | {f('median_step_s', '.3f')} | {f('peak_mem_gib')} | {f('host_rss_gib')} | "
              f"{f('host_setup_rss_gib')} | {f('first_loss', '.4f')} | {f('final_loss', '.4f')} |")
EOF
if [ -s "$OUT/host_memory.json" ]; then
    python3 - "$OUT/host_memory.json" >>"$SUMMARY" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"\n## This package's host buffers under NVMe offload (benchmarks/nvme_host_memory.py, {r['parameters']} "
      f"parameters, the keys scaled by {r['scale']:.4f})\n")
print("| buffer | bytes | bytes per element | page-locked |")
print("| --- | ---: | ---: | --- |")
for row in r["ledger"]:
    print(f"| {row['what']} | {row['bytes']:,} | {row['bytes_per_element']} | {row['pinned']} |")
print(f"\nRSS (GiB): after import {r['rss_import_gib']:.2f}, model {r['rss_model_gib']:.2f}, initialized "
      f"{r['rss_initialized_gib']:.2f}, peak in steps {r['rss_steps_peak_gib']:.2f}; the caches at 0.5e9 "
      f"elements: {r['caches_at_5e8_gib']}")
EOF
fi
echo "- total $(elapsed) s" >>"$SUMMARY"
cat "$SUMMARY"
exit $failed
