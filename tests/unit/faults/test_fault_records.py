# SPDX-License-Identifier: Apache-2.0
"""When ranks that all raised count as having left the step at the same point (peer_failure._in_step).

Each rank's fault record maps the process groups it holds to the collectives it issued on each. A rank holds only
the groups it is a member of: the mesh's one-rank groups (each made by its rank alone) and the subgroups of a
larger mesh differ between ranks. Counts are compared group by group among the ranks that hold the group; the
whole maps are not expected to be equal (they were once, and a mesh with one-rank groups then turned a fault every
rank raised alike into an aborted process group).
"""

from deepspeed.comm.peer_failure import _in_step


def record(**seq):
    return {"seq": seq, "reason": "left engine.backward with ValueError"}


def test_groups_held_by_one_rank_only_do_not_put_ranks_out_of_step():
    records = {0: record(world=12, solo_a=3), 1: record(world=12, solo_b=7)}
    assert _in_step(records)


def test_subgroups_compare_among_their_members():
    # world 4, data-parallel groups [0, 2] and [1, 3]
    records = {
        0: record(world=9, dp02=4),
        1: record(world=9, dp13=6),
        2: record(world=9, dp02=4),
        3: record(world=9, dp13=6),
    }
    assert _in_step(records)


def test_a_shared_group_with_different_counts_is_out_of_step():
    assert not _in_step({0: record(world=12), 1: record(world=11)})
    records = {0: record(world=9, dp02=4), 1: record(world=9), 2: record(world=9, dp02=5)}
    assert not _in_step(records)
