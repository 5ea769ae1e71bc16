# SPDX-License-Identifier: Apache-2.0
"""The gradient contract under pipeline parallelism: every stage's parameters after each step equal plain torch's
trained on the whole batch (every micro-batch of every data-parallel replica), for stages 1-4, GAS 1-8, uneven
cuts, pipe x data parallelism, ZeRO 0-3, fp32/bf16/fp16, tied weights, checkpointed layers and every schedule.
See ``pipe_cases.py`` for the cases and the reference. The default run holds every property once, with two
seeded random cases; ``DS_FULL_MATRIX=1`` adds a sweep of random widths, cuts, GAS, ZeRO stages and optimizers."""

import os

import pytest

from tests.unit.common import run_distributed
from tests.unit.runtime.pipe.pipe_cases import random_case, run_case

W = [16, 8, 8, 8, 4]  # four linears: enough for four stages

CASES = {
    "pp2-gas1-z0":
    dict(world=2, stages=2, gas=1, zero=0, widths=W),
    "pp2-gas8-z1-adam-clip":
    dict(world=2, stages=2, gas=8, zero=1, widths=W, optimizer="adam", clip=0.05),
    "pp3-gas2-z2-params":
    dict(world=3, stages=3, gas=2, zero=2, widths=[8, 32, 2, 16, 3], partition="parameters"),
    "pp4-gas2-z0":
    dict(world=4, stages=4, gas=2, zero=0, widths=W),
    "pp2xdp2-gas2-z2-clip":
    dict(world=4, stages=2, gas=2, zero=2, widths=W, clip=0.05, optimizer="adam"),
    "pp2-gas2-z1-bf16":
    dict(world=2, stages=2, gas=2, zero=1, widths=W, dtype="bf16"),
    "pp2-gas2-z0-fp16":
    dict(world=2, stages=2, gas=2, zero=0, widths=W, dtype="fp16"),
    "pp3-gas2-z1-tied-clip":
    dict(world=3, stages=3, gas=2, zero=1, widths=[6, 8, 6], tied=True, clip=0.05),
    "pp2xdp2-tied-z0":
    dict(world=4, stages=2, gas=2, zero=0, widths=[6, 6], tied=True, optimizer="adam"),
    "pp2-ckpt-reentrant":
    dict(world=2, stages=2, gas=2, zero=0, widths=W, ckpt="reentrant"),
    "pp2-ckpt-non-reentrant-z2":
    dict(world=2, stages=2, gas=2, zero=2, widths=W, ckpt="non_reentrant"),
    "pp2-interleaved-z1":
    dict(world=2, stages=2, gas=4, zero=1, widths=W, schedule="interleaved_1f1b"),
    "pp2xdp2-interleaved-tied-z2":
    dict(world=4, stages=2, gas=2, zero=2, widths=[6, 8, 6], tied=True, schedule="interleaved_1f1b", clip=0.05),
    "pp3-zero-bubble-z2":
    dict(world=3, stages=3, gas=4, zero=2, widths=W, schedule="zero_bubble", clip=0.05),
    "pp2-zero-bubble-fp16-tied":
    dict(world=2, stages=2, gas=3, zero=0, widths=[6, 6], tied=True, dtype="fp16", schedule="zero_bubble"),
    "pp2xdp2-z3-tied-adam-clip":
    dict(world=4, stages=2, gas=4, zero=3, widths=[6, 8, 6], tied=True, clip=0.05, optimizer="adam"),
    "pp2xdp2-interleaved-z3-ckpt-bf16":
    dict(world=4, stages=2, gas=2, zero=3, widths=W, schedule="interleaved_1f1b", ckpt="reentrant", dtype="bf16"),
    "pp3-empty-stage-z2":
    dict(world=3, stages=3, gas=2, zero=2, widths=[4, 8, 3], partition=[0, 1, 2, 3]),
    "random-11":
    random_case(11),
    "random-23":
    random_case(23),
}
if os.environ.get("DS_FULL_MATRIX") == "1":
    CASES.update({f"random-{seed}": random_case(seed) for seed in range(100, 124)})


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_matches_plain_torch(name):
    case = CASES[name]
    results = run_distributed(run_case, case["world"], args=(case, ), timeout=180)
    tolerance = 1e-5
    for rank, result in enumerate(results):
        assert result["loss"] < tolerance, (name, rank, result["losses"])
        assert result["param"] < tolerance, (name, rank, result)
