#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Where this package's NVMe-offload step spends its time (docs/performance.md, "NVMe offload", "Where the time goes"),
# one command, this package only (no upstream wheels, no libaio: this package's aio op is pread/pwrite threads):
#
#   1. the disk, before: dd with O_DIRECT (64 MiB requests) writing, then reading DISK_MB, then one dd reading while
#      another writes (does the disk add the two directions up, or share one bandwidth between them?);
#   2. this package's ops (host Adam, async_io) built, so the run times training, not a first compilation;
#   3. benchmarks/nvme_profile.py: ZeRO-3, parameters and optimizer on NVMe (the "+nvme" keys of systems.py, those
#      nvme_bench.sh times), WARMUP warm-up steps, PROFILE profiled steps (torch.profiler, CPU and CUDA), then plain
#      steps until the time limit (at most MORE); per step the bytes each tier moved, the time the disk had reads /
#      writes / both / nothing in flight, the training thread's and the host-step worker's states, /proc/diskstats;
#   4. the disk, after (the same dd runs: did sustained traffic slow it?).
#
# Run (one H200, TOTAL=300 s for everything, the device command's limit 330 s):
#
#   device run, timeout_s 330:   bash benchmarks/nvme_profile.sh $OUT
#
# DS_ROOT (default: this checkout) is a folder with deepspeed/ and csrc/ to measure instead, e.g. the committed tree
# while the checkout holds someone's edits in progress (an ignored folder, carried):
#
#   echo /.nvp_tree/ >>.git/info/exclude; rm -rf .nvp_tree; mkdir .nvp_tree
#   git archive HEAD deepspeed csrc | tar -x -C .nvp_tree; git rev-parse --short HEAD >.nvp_tree/COMMIT
#   device run, carry [".nvp_tree"], timeout_s 330:   DS_ROOT=.nvp_tree bash benchmarks/nvme_profile.sh $OUT
#
# CPU smoke test of the script (a tiny model; small pages so the disk is read):
#
#   DEVICE=cpu TOTAL=120 DISK_MB=64 MODEL="--d-model 256 --layers 4 --heads 4 --vocab 2048 --seq 64 --micro-batch 2 \
#       --unit-size 1e5" EXTRA='{"zero_optimization": {"sub_group_size": 200000, "offload_param": {"buffer_size": \
#       200000, "max_in_cpu": 1000000}}}' bash benchmarks/nvme_profile.sh /tmp/nvp_smoke
#
# Files in OUT: nvme_profile_summary.md, nvme_profile_steps.jsonl, nvme_profile_cpu_top40.txt,
# nvme_profile_cuda_top40.txt, nvme_profile_timeline.txt (benchmarks/nvme_profile.py), nvme_profile_disk.md (the dd
# runs), nvme_profile_log.txt. Exit status 2 when a precondition fails, 1 when the profile did not finish, else 0.
set -u -o pipefail
OUT=${1:?usage: nvme_profile.sh OUT}
DEVICE=${DEVICE:-cuda}
TOTAL=${TOTAL:-300}
NVME_DIR=${NVME_DIR:-/var/tmp/nvme_bench}
MODEL=${MODEL:---d-model 2048 --layers 8 --seq 2048 --micro-batch 4 --gas 2}
[ -n "${EXTRA:-}" ] || EXTRA='{}'
WARMUP=${WARMUP:-1}
PROFILE=${PROFILE:-2}
MORE=${MORE:-8}
DISK_MB=${DISK_MB:-2048}
T_BUILD=${T_BUILD:-90}
DS_ROOT=${DS_ROOT:-}  # a folder with deepspeed/ and csrc/ to import instead of this checkout's (see below)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext}
start=$(date +%s)
deadline=$((start + TOTAL))
elapsed() { echo $(($(date +%s) - start)); }
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
case "$DS_ROOT" in "") DS_ROOT=$REPO ;; /*) ;; *) DS_ROOT=$REPO/$DS_ROOT ;; esac
LOG="$OUT/nvme_profile_log.txt"
DISK="$OUT/nvme_profile_disk.md"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
die() { say "nvme_profile: $*"; exit 2; }

say "== preflight ($(elapsed) s): $(date -u +%FT%TZ), $(nproc) cores, kernel $(uname -r)"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
    timeout -k 5 60 python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU visible to torch'" >>"$LOG" 2>&1 ||
        die "torch sees no GPU (DEVICE=cpu runs the CPU smoke test)"
fi
mkdir -p "$NVME_DIR" && touch "$NVME_DIR/.probe" && rm -f "$NVME_DIR/.probe" || die "NVME_DIR '$NVME_DIR' is not writable"
rm -rf "$NVME_DIR"/zero_stage_3 "$NVME_DIR"/zero_stage_[12]
{
    echo "- NVME_DIR $NVME_DIR on $(df -hT "$NVME_DIR" | tail -1 | awk '{print $1 " (" $2 ", " $3 ", " $5 " free)"}')"
    echo "- deepspeed/ and csrc/ from $DS_ROOT$([ -f "$DS_ROOT/COMMIT" ] && echo " (commit $(cat "$DS_ROOT/COMMIT"))")"
    echo "- python3 $(python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)')"
    echo "- memory: $(free -g | awk '/Mem:/ {print $2 " GiB total, " $7 " GiB available"}')"
} | tee -a "$LOG"

# dd_probe LABEL: write, read, then read one file while writing another (MB/s from dd's byte counts and times)
dd_probe() {
    local label=$1 f1=$NVME_DIR/dd_probe1.bin f2=$NVME_DIR/dd_probe2.bin n=$((DISK_MB / 64))
    rate() { awk '/copied/ {for (i = 1; i <= NF; i++) if ($i == "s,") printf "%.0f", $1 / $(i - 1) / 1e6}'; }
    local w r rr ww
    w=$(dd if=/dev/zero of="$f1" bs=64M count=$n oflag=direct conv=fsync 2>&1 | rate)
    r=$(dd if="$f1" of=/dev/null bs=64M iflag=direct 2>&1 | rate)
    (dd if="$f1" of=/dev/null bs=64M iflag=direct 2>"$OUT/.rr") &
    ww=$(dd if=/dev/zero of="$f2" bs=64M count=$n oflag=direct conv=fsync 2>&1 | rate)
    wait
    rr=$(rate <"$OUT/.rr")
    rm -f "$f1" "$f2" "$OUT/.rr"
    echo "| $label | $w | $r | $rr + $ww = $((${rr:-0} + ${ww:-0})) |"
}
{
    echo "| dd, O_DIRECT, 64 MiB requests, $DISK_MB MiB | write MB/s | read MB/s | read + write at once MB/s |"
    echo "| --- | ---: | ---: | --- |"
} >"$DISK"
say "== disk, before ($(elapsed) s)"
timeout -k 5 60 bash -c "$(declare -f dd_probe); OUT=$OUT NVME_DIR=$NVME_DIR DISK_MB=$DISK_MB dd_probe before" \
    >>"$DISK" 2>>"$LOG" || say "   the dd probe ended with status $?"
tail -1 "$DISK" | tee -a "$LOG"

say "== build this package's ops ($(elapsed) s; TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
(cd /tmp && PYTHONPATH=$DS_ROOT timeout -k 5 "$T_BUILD" python3 -c "
import time
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    t = time.time()
    builder.load()
    print('   built', builder.NAME, 'in %.1f s' % (time.time() - t))
t = time.time()
AsyncIOBuilder().load_native(verbose=False)  # the compiled aio op (pread/pwrite threads) the disk tiers use
print('   built the native async_io op in %.1f s' % (time.time() - t))
") 2>>"$LOG" | tee -a "$LOG" || say "   the build ended with status $? (time limit?)"

# the profile gets what is left, less the second dd probe (about 3 x DISK_MB at ~1 GB/s) and a margin
after=$((DISK_MB * 3 / 1000 + 15))
left=$((deadline - $(date +%s) - after))
[ "$left" -gt 30 ] || die "only $left s left for the profile"
say "== profile ($(elapsed) s, limit $left s)"
status=0
# $MODEL is split into words on purpose
NVP_DS_ROOT=$DS_ROOT PYTHONPATH=$REPO timeout -k 10 "$left" python3 benchmarks/nvme_profile.py --device "$DEVICE" --nvme-path "$NVME_DIR" \
    --out-dir "$OUT" --warmup "$WARMUP" --profile-steps "$PROFILE" --more-steps "$MORE" \
    --deadline $((deadline - after)) --ds-extra "$EXTRA" $MODEL 2>&1 | grep -v '^USDT' >>"$LOG" || status=$?
[ $status -eq 0 ] || say "   the profile ended with status $status$([ $status -ge 124 ] && echo ": time limit $left s")"
grep "^nvme_profile:" "$LOG" | tail -20
rm -rf "$NVME_DIR"/zero_stage_3 "$NVME_DIR"/zero_stage_[12]

say "== disk, after ($(elapsed) s)"
timeout -k 5 60 bash -c "$(declare -f dd_probe); OUT=$OUT NVME_DIR=$NVME_DIR DISK_MB=$DISK_MB dd_probe after" \
    >>"$DISK" 2>>"$LOG" || say "   the dd probe ended with status $?"
tail -1 "$DISK" | tee -a "$LOG"
say "== done ($(elapsed) s)"
cat "$OUT/nvme_profile_summary.md" 2>/dev/null
[ $status -eq 0 ] && [ -s "$OUT/nvme_profile_summary.md" ] || exit 1
exit 0
