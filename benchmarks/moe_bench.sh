#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every system of benchmarks/moe_bench.py, one after another, on one GPU (one device call):
#   bash benchmarks/moe_bench.sh [UPSTREAM=.up]
# UPSTREAM holds upstream DeepSpeed 0.19.8 for the GPU machine's Python: whl/ (its pure-Python dependencies as
# wheels: hjson, pydantic, pydantic-core, annotated-types, typing-inspection) and pkg/ (the deepspeed package
# and its dist-info, no ops built); ../shared/tools/upstream-wheels.sh builds an equivalent set of wheels.
set -u
UP=${1:-.up}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext-moe-bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
PYTHONPATH=$PWD timeout ${SYSTEM_TIMEOUT:-150} python3 benchmarks/moe_bench.py --system ours "${@:2}"
if [ -d "$UP" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream "$UP"/whl/*.whl
    cp -r "$UP"/pkg/* /tmp/upstream/
    PYTHONPATH=/tmp/upstream timeout ${SYSTEM_TIMEOUT:-150} python3 benchmarks/moe_bench.py --system upstream_z3_leaf "${@:2}"
    PYTHONPATH=/tmp/upstream timeout ${SYSTEM_TIMEOUT:-150} python3 benchmarks/moe_bench.py --system upstream_autoep "${@:2}"
fi
