# SPDX-License-Identifier: Apache-2.0
"""A seeded random sweep of the offloaded step's paths (``offload_paths.py``): the pipelined and the speculative
step against the whole-partition step, bit for bit, on random shapes, worlds 1-4, stages 1-3, GAS, precisions,
clipping, buckets, parameter offload and partial offload; fp32 cases against plain torch too.

CI runs ``DEFAULT_CASES`` cases of seed 0; ``DS_SWEEP_SEED`` / ``DS_OFFLOAD_SWEEP_CASES`` run more. A failing case
becomes a named case of its own here (the whole case dict), as ``regressions.py`` does for the main sweep."""

import os

import pytest

from deepspeed.ops.adam import host_adam
from tests.unit.common import run_distributed
from tests.unit.sweep.offload_paths import DEFAULT_CASES, offload_case_id, offload_cases, run_offload_paths

pytestmark = pytest.mark.skipif(host_adam.host_adam_op() is None, reason="the host Adam op cannot be built here")

SEED = int(os.environ.get("DS_SWEEP_SEED", 0))
COUNT = int(os.environ.get("DS_OFFLOAD_SWEEP_CASES", DEFAULT_CASES))
DRAWN = sorted(enumerate(offload_cases(SEED, COUNT)), key=lambda ic: (ic[1]["world"], ic[0]))


def _run(case):
    stats = run_distributed(run_offload_paths, case["world"], args=(case, ), timeout=300)
    if case["ratio"] == 1.0:
        first = stats[0]
        assert first["boundary_steps"] == case["steps"], first
        assert first["kept"] + first["rolled_back"] + first["not_speculated"] == case["steps"], first
        if case["clip"] == 0.05 or case["call"] == "two_losses":  # rolled back (a clip, a second gradient)
            assert first["rolled_back"] >= 1 and first["kept"] == 0, first


@pytest.mark.parametrize("case", [c for _, c in DRAWN], ids=[f"seed{SEED}-{i}-{offload_case_id(c)}" for i, c in DRAWN])
def test_offload_paths_sweep(case):
    _run(case)
