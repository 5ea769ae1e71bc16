# SPDX-License-Identifier: Apache-2.0
"""The gradient contract for unmanaged accumulation with what upstream rejects there and this runtime keeps.

Upstream refuses ``managed_gradient_accumulation: false`` together with ``overlap_comm`` on stages 0
and 1, and with ``coalesce_grad_reduction()``. Here both stay supported, because these cells prove them
exact: the ``unmanaged`` shape (1 to 3 backward calls per micro-step, ``step()`` only at the caller's
boundary) on every stage, with ``overlap_comm`` on and off and every micro-step inside
``coalesce_grad_reduction()`` or not, compared with the plain-torch reference like every contract cell.
"""

import itertools

import pytest

from tests.unit.common import run_distributed
from tests.unit.contract.runner import run_cell

SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}


def _cells():
    cells = []
    for stage, overlap, coalesce in itertools.product([0, 1, 2, 3], [False, True], [False, True]):
        dtypes = ["fp32", "bf16"] if overlap and coalesce else ["fp32"]
        for dtype in dtypes:
            cells.append((stage, overlap, coalesce, dtype, 2))
    cells += [(1, True, True, "fp32", 3), (2, True, True, "fp32", 3)]
    return cells


CELLS = _cells()


@pytest.mark.parametrize("stage,overlap,coalesce,dtype,world",
                         CELLS,
                         ids=[
                             f"z{s}-{'overlap' if o else 'no_overlap'}-{'coalesce' if c else 'plain'}-{d}-w{w}"
                             for s, o, c, d, w in CELLS
                         ])
def test_unmanaged_with_overlap_and_coalesce(stage, overlap, coalesce, dtype, world):
    zero = dict(SMALL_UNITS) if stage == 3 else {}
    zero["overlap_comm"] = overlap
    cell = dict(stage=stage, shape="unmanaged", dtype=dtype, gas=2, bucket=16, zero_extra=zero, coalesce=coalesce)
    checked = run_distributed(run_cell, world, args=(cell, ), timeout=120)
    assert all(c >= 2 for c in checked), checked
