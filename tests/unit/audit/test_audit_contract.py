# SPDX-License-Identifier: Apache-2.0
"""The gradient audit passes on the contract's graph shapes, and leaves gradient, weights and generators untouched.

Every cell trains two optimizer steps of each engine and audits every engine at every
boundary (``harness.run_audit_cell``: the audit must report ``ok``, the same report on every
rank, and the gradient, fp32 values, model parameters and CPU generator must be bit for bit
what they were before it). The matrix:

* every shape on every stage, GAS 4, world 2, fp32 (the tightest tolerance): the shapes are
  what differs in the backward path the audit is independent of;
* the core shapes on the full grid of stages 0-3 x GAS 1, 4 x world 1, 2: a plain step, a
  retained graph with two backward calls, two engines of different GAS in one graph, and
  reentrant checkpointing;
* bf16 and fp16 on every stage (plain and two engines), GAS 1 and 4, world 2;
* options that change where the gradient and the masters live: optimizer and parameter
  offload, sum reduction, bf16 accumulation, persistent stage-3 parameters, overlap_comm.

Excluded, as in the contract: ``no_sync`` on stages 2 and 3 (rejected), ``unused_param`` on
stage 3 (a module run on one rank only).
"""

import itertools

import pytest

from tests.unit.audit.harness import run_audit_cell
from tests.unit.common import run_distributed
from tests.unit.contract.shapes import SHAPES

SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}
CORE = ["plain", "two_losses_retained", "two_engines_direct_diff_gas", "ckpt_reentrant"]


def _valid(stage, shape):
    return not (stage >= 2 and shape == "no_sync") and not (stage == 3 and shape == "unused_param")


def _cell(stage, shape, dtype="fp32", gas=4, **extra):
    cell = dict(stage=stage, shape=shape, dtype=dtype, gas=gas, bucket=64)
    if stage == 3:
        cell["zero_extra"] = dict(SMALL_UNITS)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cell.get(key), dict):
            cell[key] = dict(cell[key], **value)
        else:
            cell[key] = value
    return cell


def _check(cell, world):
    per_rank = run_distributed(run_audit_cell, world, args=(cell, ), timeout=120)
    reports = per_rank[0]
    assert reports, "no boundary was audited"
    assert all(r == reports for r in per_rank), "the ranks' reports differ"
    for ok, max_rel, rel, dominant, tol, skipped in reports:
        assert skipped is None
        assert ok, f"audit mismatch on a correct gradient: max relative error {max_rel:.3e} > {tol} ({rel})"
        assert len(rel) == 4 and max_rel == max(rel)


SHAPE_CELLS = [(stage, shape) for stage, shape in itertools.product(range(4), sorted(SHAPES)) if _valid(stage, shape)]


@pytest.mark.parametrize("stage,shape", SHAPE_CELLS, ids=[f"z{s}-{n}" for s, n in SHAPE_CELLS])
def test_audit_every_shape(stage, shape):
    _check(_cell(stage, shape), 2)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("shape", CORE)
def test_audit_core_grid(shape, stage, gas, world):
    _check(_cell(stage, shape, gas=gas), world)


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("shape", ["plain", "two_engines_direct"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_audit_low_precision(dtype, stage, shape, gas):
    _check(_cell(stage, shape, dtype=dtype, gas=gas), 2)


OPTIONS = {
    "offload_optimizer_z1": (1, "bf16", dict(zero_extra={"offload_optimizer": {
        "device": "cpu"
    }})),
    "offload_optimizer_z2": (2, "fp32", dict(zero_extra={"offload_optimizer": {
        "device": "cpu"
    }})),
    "offload_both_z3":
    (3, "bf16", dict(zero_extra={
        "offload_optimizer": {
            "device": "cpu"
        },
        "offload_param": {
            "device": "cpu"
        }
    })),
    "persistent_z3":
    (3, "fp32", dict(zero_extra={
        "stage3_param_persistence_threshold": 100,
        "stage3_prefetch_bucket_size": 100
    })),
    "overlap_z2": (2, "bf16", dict(zero_extra={"overlap_comm": True}, bucket=16)),
    "sum_z0": (0, "fp32", dict(zero_extra_top={"gradient_allreduce_op": "sum"})),
    "sum_z2": (2, "fp32", dict(zero_extra_top={"gradient_allreduce_op": "sum"})),
    "bf16_accum_z1": (1, "bf16", dict(zero_extra_top={"data_types": {
        "grad_accum_dtype": "bf16"
    }})),
    "bf16_accum_z3": (3, "bf16", dict(zero_extra_top={"data_types": {
        "grad_accum_dtype": "bf16"
    }})),
}


@pytest.mark.parametrize("shape", ["plain", "two_losses_retained"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_audit_options(option, shape):
    stage, dtype, extra = OPTIONS[option]
    _check(_cell(stage, shape, dtype=dtype, gas=2, **extra), 2)
