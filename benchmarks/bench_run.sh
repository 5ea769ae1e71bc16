# SPDX-License-Identifier: Apache-2.0
# Sourced by the benchmark scripts: `run NAME OUTFILE [VAR=VALUE...] -- train_bench args` runs one
# benchmarks/train_bench.py invocation with the caller's BENCH options (and T_RUN seconds at most), writes
# OUT/OUTFILE.{md,log,jsonl} and prints the deepspeed it imported, its rows and any speculative-step counters.
run() {
    local name=$1 file=$2
    shift 2
    local vars=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
    shift
    echo "== $name"
    env "${vars[@]}" timeout "${T_RUN:-100}" python3 benchmarks/train_bench.py "$@" "${BENCH[@]}" \
        --out "$OUT/$file.md" >"$OUT/$file.log" 2>&1
    grep "deepspeed.*from\|^| " "$OUT/$file.log" | grep -v "^| ---" | grep -v "^| system" | head -4
    grep -o '"speculative_stats": {[^}]*}[^}]*}' "$OUT/$file.jsonl" 2>/dev/null | head -2
}
