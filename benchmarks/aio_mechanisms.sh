#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Read and write throughput on one folder, by mechanism (docs/ops.md, "async_io"): dd with O_DIRECT (the raw
# bandwidth), the async_io op's thread pool (ds_io, the compiled op), the same on Python threads, and io_uring
# (benchmarks/aio_uring_probe.c). Each mechanism moves SIZE_MB in 1 MiB requests, QUEUE_DEPTH of them in flight (dd:
# one request of 64 MiB at a time, which the kernel splits and keeps in flight itself, overwriting its file as the
# others do); every cell is the median over ROUNDS rounds of each round's median of 3 passes, in GB/s, and each row
# is printed as soon as its mechanism is measured (so a time limit keeps the rows done).
#
#   bash benchmarks/aio_mechanisms.sh FOLDER [SIZE_MB=512] [ROUNDS=3] [QUEUE_DEPTH=8] > table.md
set -u
FOLDER=${1:?folder}
SIZE_MB=${2:-512}
ROUNDS=${3:-3}
QD=${4:-8}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
PROBE=$(mktemp -d)/uring_probe
cc -O2 -o "$PROBE" benchmarks/aio_uring_probe.c 2>/dev/null || PROBE=""
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "n/a"; else printf "%.2f\n", a[int((NR+1)/2)]}'; }
dd_pass() {  # dd_pass write|read -> GB/s of one pass
    local f="$FOLDER/ds_dd_$$.bin" out
    if [ "$1" = write ]; then
        out=$(dd if=/dev/zero of="$f" bs=64M count=$((SIZE_MB / 64)) oflag=direct conv=notrunc,fsync 2>&1 | tail -1)
    else
        out=$(dd if="$f" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1)
    fi
    echo "$out" | awk -v n=$((SIZE_MB / 64 * 64 * 1048576)) '{for (i=1;i<=NF;i++) if ($i=="s,") print n/$(i-1)/1e9}'
}
native_pass() {  # native_pass native|python -> "write read" GB/s (median of 3 passes after 1 warm-up)
    $PY -c "
import sys
from deepspeed.nvme.ds_io import measure
r = measure(sys.argv[1], int(sys.argv[2]) << 20, queue_depth=int(sys.argv[3]), loops=3, backend=sys.argv[4])
print(r['write'], r['read'])" "$FOLDER" "$SIZE_MB" "$QD" "$1" 2>/dev/null || echo "n/a n/a"
}
echo "| mechanism ($FOLDER, $SIZE_MB MiB, queue depth $QD) | write GB/s | read GB/s |"
echo "| --- | ---: | ---: |"
row() {  # row NAME WRITES READS: the medians over the rounds
    echo "| $1 | $(echo "$2" | tr ' ' '\n' | grep -v '^$' | median) | $(echo "$3" | tr ' ' '\n' | grep -v '^$' | median) |"
}
w="" r=""
for round in $(seq "$ROUNDS"); do
    w+="$( (for i in 1 2 3; do dd_pass write; done) | median) "
    r+="$( (for i in 1 2 3; do dd_pass read; done) | median) "
done
rm -f "$FOLDER/ds_dd_$$.bin"
row "dd, O_DIRECT, 64 MiB requests" "$w" "$r"
for engine in native python; do
    w="" r=""
    for round in $(seq "$ROUNDS"); do
        set -- $(native_pass $engine)
        w+="$1 " r+="$2 "
    done
    if [ $engine = native ]; then
        row "async_io op: thread pool, pread/pwrite (ds_io)" "$w" "$r"
    else
        row "the same on Python threads (ds_io --backend python)" "$w" "$r"
    fi
done
if [ -n "$PROBE" ]; then
    w="" r=""
    for round in $(seq "$ROUNDS"); do
        out=$("$PROBE" "$FOLDER/ds_uring_$$.bin" "$SIZE_MB" 1024 "$QD" 3)
        w+="$(echo "$out" | awk '$2=="write" {print $3}') " r+="$(echo "$out" | awk '$2=="read" {print $3}') "
    done
    row "io_uring, raw system calls (aio_uring_probe.c)" "$w" "$r"
fi
