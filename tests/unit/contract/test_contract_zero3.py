# SPDX-License-Identifier: Apache-2.0
"""The gradient contract on ZeRO stage 3, and the parameter lifetimes.

Small units (``stage3_prefetch_bucket_size`` 100) and no persistent parameters make
every module gather and release its parameters; after every micro-step the runner
checks that every non-persistent parameter was released again.

* every shape x dtype x GAS 1, 4 at world 2;
* core shapes at worlds 1 and 3, with the model built inside ``zero.Init`` and
  outside, with persistent small parameters, with optimizer and parameter offload;
* a leaf module (``moe_leaf``: a mixture of experts whose router picks experts per token,
  so that an expert runs on one rank and not on another) at worlds 1 and 2, with small
  units, persistent small parameters and offload.
* optimizer and parameter offload x bf16, fp16 x GAS 1, 4 x one backward, several backward
  calls per micro-step, two losses over a retained graph (world 2).

Excluded shapes: ``no_sync`` (rejected on stage 3, as upstream) and ``unused_param``
(a module run on one rank only): ZeRO-3 gathers a module's parameters with a
collective when it runs, so every rank must run the same modules.
``unused_param_all_ranks`` covers a parameter unused in one step of three.
``DS_FULL_MATRIX=1`` runs every shape at every world size with every variant.
"""

import itertools
import os

import pytest

from tests.unit.common import run_distributed
from tests.unit.contract.runner import run_cell
from tests.unit.contract.shapes import SHAPES

FULL = os.environ.get("DS_FULL_MATRIX") == "1"
SHAPES3 = sorted(s for s in SHAPES if s not in ("no_sync", "unused_param"))
CORE = [
    "plain", "module_twice", "mixed_submodule_direct", "two_losses_retained", "two_losses_retained_zero_grad",
    "unused_param_all_ranks", "ckpt_reentrant", "ckpt_non_reentrant", "ckpt_early_stop", "tied_weights",
    "two_engines_direct"
]
SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}
VARIANTS = {
    "units":
    dict(zero_extra=SMALL_UNITS),
    "zinit":
    dict(zero_extra=SMALL_UNITS, zero_init=True),
    "persist":
    dict(zero_extra={
        "stage3_param_persistence_threshold": 100,
        "stage3_prefetch_bucket_size": 100
    }),
    "offload":
    dict(zero_extra=dict(SMALL_UNITS, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}),
         zero_init=True),
}

# Optimizer and parameter offload x bf16, fp16 x GAS 1, 4 x one backward, several backward calls per micro-step,
# two losses over a retained graph.
OFFLOAD_SHAPES = ["plain", "n_backward_per_step", "two_losses_retained"]


def _cells():
    cells = []
    for shape, dtype, gas in itertools.product(OFFLOAD_SHAPES, ["bf16", "fp16"], [1, 4]):
        cells.append(("offload", dict(stage=3, shape=shape, dtype=dtype, gas=gas), 2))
    for shape, dtype, gas in itertools.product(SHAPES3, ["fp32", "bf16", "fp16"], [1, 4]):
        for world in ([1, 2, 3] if FULL else [2]):
            cells.append(("units", dict(stage=3, shape=shape, dtype=dtype, gas=gas), world))
    for variant, shape, dtype, world in itertools.product(VARIANTS, SHAPES3 if FULL else CORE, ["fp32", "bf16"],
                                                          [1, 2, 3] if FULL else [1, 3]):
        cells.append((variant, dict(stage=3, shape=shape, dtype=dtype, gas=2), world))
    # A ZeRO-3 leaf module (a mixture of experts routing data-dependently: some experts run on one rank and not on
    # another) at worlds 1 and 2, with small units, persistent small parameters and offload.
    for variant, dtype, world in itertools.product(["units", "persist", "offload"], ["fp32", "bf16"], [1, 2]):
        cells.append((variant, dict(stage=3, shape="moe_leaf", dtype=dtype, gas=2), world))
    return cells


CELLS = _cells()


@pytest.mark.parametrize("variant,cell,world",
                         CELLS,
                         ids=[f"{v}-{c['shape']}-{c['dtype']}-gas{c['gas']}-w{w}" for v, c, w in CELLS])
def test_contract_zero3(variant, cell, world):
    cell = dict(cell, **VARIANTS[variant])
    checked = run_distributed(run_cell, world, args=(cell, ), timeout=120)
    assert all(c >= 2 for c in checked), checked
