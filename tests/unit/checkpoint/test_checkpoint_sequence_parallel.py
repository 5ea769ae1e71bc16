# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of a sequence-parallel engine resume exactly.

With ``sequence_parallel_size`` > 1, ZeRO partitions span every rank that saw different tokens (data x
sequence parallel), while ``engine.dp_world_size`` counts data-parallel ranks only; the files of a save are one
per rank of the partition group. 2 steps + save + load into a fresh engine + 2 steps must equal 4 uninterrupted
steps bitwise, on every stage, at sp 2 of world 2 and sp 2 x dp 2 of world 4.
"""

import pytest

from tests.unit.checkpoint.test_checkpoint_resume import (attach_checkpointing, build_engine, differences, make_config,
                                                          snapshot, train)
from tests.unit.common import run_distributed


def sp_resume_worker(tmp, stage, sp):
    import deepspeed.comm as dist
    attach_checkpointing()
    rank = dist.get_rank()
    cfg = dict(make_config(stage, "fp32", gas=2), sequence_parallel_size=sp)
    straight = build_engine(cfg, seed=0)
    train(straight, 4, 0, rank)
    expected = snapshot(straight)
    straight.destroy()

    first = build_engine(cfg, seed=0)
    train(first, 2, 0, rank)
    first.save_checkpoint(tmp, tag="sp")
    first.destroy()
    resumed = build_engine(cfg, seed=1)  # other initial weights: everything must come from the files
    resumed.load_checkpoint(tmp, tag="sp")
    train(resumed, 2, 2, rank)
    bad = differences(expected, snapshot(resumed))
    resumed.destroy()
    return bad


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sequence_parallel_resume_is_exact(tmp_path, stage, world, sp):
    results = run_distributed(sp_resume_worker, world_size=world, args=(str(tmp_path), stage, sp))
    assert all(not bad for bad in results), results
