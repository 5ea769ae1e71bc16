# SPDX-License-Identifier: Apache-2.0
"""A seeded random sweep over shapes and options, each case compared with plain torch.

Each case (``cases.py``) draws MLP widths (1-wide layers, parameters smaller than the world), the world size
(1-4), the ZeRO stage, GAS, clipping, bucket size, ``overlap_comm``, optimizer (and parameter) offload, ZenFlow,
bf16/fp16, ``torch.compile`` and how backward is called. A case without ZenFlow is compared with the contract's
plain-torch reference at every boundary (``run.run_against_torch``); a ZenFlow case with the world-1 run of the
same algorithm over the same global batches, and with ``tests/unit/zenflow/reference.py`` (``run.run_zenflow``).

CI runs ``DEFAULT_CASES`` cases of ``DEFAULT_SEED``. More on demand::

    DS_SWEEP_SEED=7 DS_SWEEP_CASES=200 python -m pytest tests/unit/sweep -q

A case's test id is ``seed<S>-<i>-<description>``; ``DS_SWEEP_SEED=<S> DS_SWEEP_CASES=<i+1> pytest
tests/unit/sweep -k 'seed<S>-<i>-'`` reruns it alone. A failing case becomes a named regression case in
``regressions.py`` (the whole case dict, so it stays the same whatever the drawing code becomes).
"""

import os

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.sweep.cases import DEFAULT_CASES, DEFAULT_SEED, case_id, cases
from tests.unit.sweep.regressions import REGRESSIONS
from tests.unit.sweep.run import run_against_torch, run_zenflow

SEED = int(os.environ.get("DS_SWEEP_SEED", DEFAULT_SEED))
COUNT = int(os.environ.get("DS_SWEEP_CASES", DEFAULT_CASES))
TIMEOUT_S = 240

_world_one = {}


def run_case(case):
    if not case["zenflow"]:
        checked = run_distributed(run_against_torch, case["world"], args=(case, ), timeout=TIMEOUT_S)
        assert checked == [case["steps"]] * case["world"], checked
        return
    results = run_distributed(run_zenflow, case["world"], args=(case, case["world"]), timeout=TIMEOUT_S)
    key = repr(case)
    if key not in _world_one:
        _world_one[key] = run_distributed(run_zenflow, 1, args=(case, case["world"]), timeout=TIMEOUT_S)[0]
    single = _world_one[key]
    assert single["selections"], "no selection was made"
    for rank, result in enumerate(results):
        assert result["selections"] == single["selections"], f"rank {rank}: the selection differs from world 1's"
        for step, (got, want) in enumerate(zip(result["params"], single["params"])):
            for name in want:
                torch.testing.assert_close(got[name],
                                           want[name],
                                           rtol=1e-5,
                                           atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step} {name} vs world 1: {m}")


# sorted by world size, so each worker pool is started once and used for a run of cases
DRAWN = sorted(enumerate(cases(SEED, COUNT)), key=lambda ic: (ic[1]["world"], ic[0]))


@pytest.mark.parametrize("case", [c for _, c in DRAWN], ids=[f"seed{SEED}-{i}-{case_id(c)}" for i, c in DRAWN])
def test_sweep(case):
    run_case(case)


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(name):
    run_case(REGRESSIONS[name])
