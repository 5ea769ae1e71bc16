# SPDX-License-Identifier: Apache-2.0
"""The gradient contract, stage 0: every graph shape x fp32/bf16/fp16 x GAS 1, 4 x world 1, 2."""

import pytest

from tests.unit.common import run_distributed
from tests.unit.contract.runner import run_cell
from tests.unit.contract.shapes import SHAPES


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_contract_stage0(shape, dtype, gas, world):
    cell = dict(stage=0, shape=shape, dtype=dtype, gas=gas)
    checked = run_distributed(run_cell, world, args=(cell, ), timeout=120)
    assert all(c >= 2 for c in checked), checked
