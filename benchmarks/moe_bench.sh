#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every system of benchmarks/moe_bench.py on the DeepSeek-V3-shaped and the Qwen3.6-MoE-shaped model, one after
# another, on one GPU (one device call, about 4-5 minutes on one H100; each run is capped at SYSTEM_TIMEOUT=35 s):
#   bash benchmarks/moe_bench.sh [UPSTREAM=.whl-upstream] [extra moe_bench.py arguments]
# UPSTREAM holds upstream DeepSpeed 0.19.8 for the GPU machine's Python: either wheels (UPSTREAM/*.whl: deepspeed
# and its pure-Python dependencies) or UPSTREAM/whl (dependency wheels) and UPSTREAM/pkg (the deepspeed package).
# MODELS (default "deepseek_v3 qwen3_6_moe") picks the models, SYSTEMS (default "ours ours_z2 upstream_autoep
# upstream_z3_leaf"; also ours_z3_leaf) the systems. Every RESULT line is printed and, with $OUT set,
# collected into $OUT/moe_bench.json.
set -u
UP=${1:-.whl-upstream}
MODELS=${MODELS:-deepseek_v3 qwen3_6_moe}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext-moe-bench
LOG=$(mktemp)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
have_upstream=0
if [ -d "$UP/pkg" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$UP"/whl/*.whl
    cp -r "$UP"/pkg/* /tmp/upstream/ && have_upstream=1
elif ls "$UP"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$UP"/*.whl && have_upstream=1
fi
run() {  # run SYSTEM MODEL PYTHONPATH
    PYTHONPATH=$3 timeout "${SYSTEM_TIMEOUT:-35}" python3 benchmarks/moe_bench.py --system "$1" --model "$2" \
        --warmup 2 --steps 4 "${@:4}" 2>&1 | grep -E "^RESULT|Error" | tail -3 | tee -a "$LOG"
}
for model in $MODELS; do
    for system in ${SYSTEMS:-ours ours_z2 upstream_autoep upstream_z3_leaf}; do
        case $system in
            upstream_*) [ $have_upstream = 1 ] && run "$system" "$model" /tmp/upstream "${@:2}" ;;
            *) run "$system" "$model" "$PWD" "${@:2}" ;;
        esac
    done
done
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    python3 - "$LOG" "$OUT/moe_bench.json" <<'EOF'
import json, sys
rows = [json.loads(line.split("RESULT ", 1)[1]) for line in open(sys.argv[1]) if line.startswith("RESULT ")]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
print(f"wrote {len(rows)} results to {sys.argv[2]}")
EOF
fi
