# SPDX-License-Identifier: Apache-2.0
"""A seeded random sweep of the offloaded step's paths (``offload_paths.py``): the pipelined and the speculative
step, and the pipelined step with state on NVMe, against the whole-partition step, bit for bit, on random shapes,
worlds 1-4 (the disk tier at worlds 1-3), stages 1-3, GAS, precisions, clipping, buckets, parameter offload and
partial offload; fp32 cases against plain torch too.

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


# The disk tier at world 3 (seed 0 draws none there): ZeRO-3 with both tiers on NVMe, and (DS_FULL_MATRIX=1; the
# default cases have ZeRO-1 with the optimizer's at worlds 1 and 2) ZeRO-1 with the optimizer's.
DISK_CASES = [
    dict(widths=[5, 7, 1, 3],
         world=3,
         stage=3,
         gas=2,
         dtype="bf16",
         clip=1.0,
         bucket=16,
         offload_param=True,
         units=(20, 10),
         ratio=1.0,
         delay=0.002,
         call="engine",
         steps=3,
         nvme="both"),
    dict(widths=[13, 2, 5],
         world=3,
         stage=1,
         gas=1,
         dtype="fp16",
         clip=0.05,
         bucket=5,
         offload_param=False,
         units=None,
         ratio=1.0,
         delay=0.0,
         call="direct",
         steps=2,
         nvme="optimizer"),
]

if os.environ.get("DS_FULL_MATRIX") != "1":
    DISK_CASES = DISK_CASES[:1]


@pytest.mark.parametrize("case", DISK_CASES, ids=[offload_case_id(c) for c in DISK_CASES])
def test_offload_paths_disk_tier(case):
    _run(case)
