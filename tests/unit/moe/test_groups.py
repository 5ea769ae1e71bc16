# SPDX-License-Identifier: Apache-2.0
"""The mesh (deepspeed.utils.groups): rank tables, accessors, groups that work, an mpu's groups, bad sizes.

The expected layouts are written out by hand (sequence-parallel groups contiguous, data-parallel
groups striding, expert groups contiguous within the ranks that see different tokens, expert-data
groups striding across them); the groups themselves are checked with an all-reduce of the rank
numbers against the sum over the expected ranks.
"""

import random

import pytest
import torch
import torch.distributed as tdist

from deepspeed.utils import groups
from deepspeed.utils.groups import MeshDescription, MeshError
from tests.unit.common import run_distributed

T = 90


def _cover(table, world):
    return sorted(r for ranks in table for r in ranks) == list(range(world))


def test_standard_layout_world4():
    d = MeshDescription.standard(4, sequence_parallel_size=2, expert_parallel_sizes=[2])
    assert d.sequence_parallel_ranks == ((0, 1), (2, 3))
    assert d.data_parallel_ranks == ((0, 2), (1, 3))
    assert d.sequence_data_parallel_ranks == ((0, 1, 2, 3), )
    assert d.data_parallel_size == 2 and d.sequence_data_parallel_size == 4
    ep, edp = d.expert_tables["ep_size_2"]
    assert ep == ((0, 1), (2, 3)) and edp == ((0, 2), (1, 3))
    d1 = MeshDescription.standard(4, expert_parallel_sizes=[2, 4, 1])
    assert d1.data_parallel_ranks == ((0, 1, 2, 3), ) and d1.sequence_parallel_ranks == ((0, ), (1, ), (2, ), (3, ))
    assert d1.expert_tables["ep_size_4"] == (((0, 1, 2, 3), ), ((0, ), (1, ), (2, ), (3, )))
    assert d1.expert_tables["ep_size_1"] == (((0, ), (1, ), (2, ), (3, )), ((0, 1, 2, 3), ))
    assert d1.group_names() == ["ep_size_1", "ep_size_2", "ep_size_4"]


def test_model_parallel_layout():
    d = MeshDescription.standard(8, model_parallel_size=2, sequence_parallel_size=2, expert_parallel_sizes=[2])
    assert d.model_parallel_ranks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert d.sequence_parallel_ranks == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert d.data_parallel_ranks == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert d.sequence_data_parallel_ranks == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert d.expert_tables["ep_size_2"][0] == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_pipe_model_data_layout():
    """Upstream's PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2): rank = p*4 + d*2 + m."""
    d = MeshDescription.standard(8, pipe_parallel_size=2, model_parallel_size=2)
    assert d.model_parallel_ranks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert d.data_parallel_ranks == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert d.pipe_parallel_ranks == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert d.pipe_model_parallel_ranks == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert d.sequence_data_parallel_ranks == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert d.data_parallel_size == 2 and d.sequence_data_parallel_size == 2 and d.pipe_parallel_size == 2
    d2 = MeshDescription.standard(4, pipe_parallel_size=2, expert_parallel_sizes=[2])
    assert d2.pipe_parallel_ranks == ((0, 2), (1, 3)) and d2.data_parallel_ranks == ((0, 1), (2, 3))
    assert d2.expert_tables["ep_size_2"] == (((0, 1), (2, 3)), ((0, ), (1, ), (2, ), (3, )))
    with pytest.raises(MeshError, match="pipeline parallel size"):
        MeshDescription.standard(6, pipe_parallel_size=4)
    with pytest.raises(MeshError, match="pipeline x model"):  # stages that cut across tensor groups
        single = tuple((r, ) for r in range(8))
        dp = ((0, 4), (1, 5), (2, 6), (3, 7))
        MeshDescription.from_tables(8, ((0, 1), (2, 3), (4, 5), (6, 7)),
                                    single,
                                    dp,
                                    dp,
                                    pp_table=((0, 2), (1, 4), (3, 5), (6, 7)))


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_are_consistent(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 6, 8, 12])
    pp = rng.choice([d for d in range(1, world + 1) if world % d == 0])
    sp = rng.choice([d for d in range(1, world // pp + 1) if (world // pp) % d == 0])
    ep = rng.choice([d for d in range(1, world // pp + 1) if (world // pp) % d == 0])
    d = MeshDescription.standard(world, sequence_parallel_size=sp, expert_parallel_sizes=[ep], pipe_parallel_size=pp)
    for _, table in d.tables():
        assert _cover(table, world)
    for a in d.pipe_parallel_ranks:  # a pipeline group meets every sequence-data group at most once
        for b in d.sequence_data_parallel_ranks:
            assert len(set(a) & set(b)) <= 1
    ep_table, edp_table = d.expert_tables[f"ep_size_{ep}"]
    assert all(len(g) == ep for g in ep_table) and all(len(g) == world // pp // ep for g in edp_table)
    spdp_of = {r: ranks for ranks in d.sequence_data_parallel_ranks for r in ranks}
    for a in ep_table:  # an expert-parallel group meets every expert-data group of its stage in exactly one rank
        for b in edp_table:
            assert len(set(a) & set(b)) == (1 if spdp_of[a[0]] == spdp_of[b[0]] else 0)
    for r in range(world):
        c = d.coordinates(r)
        assert d.ranks_of("sequence_parallel", r)[c["sequence_parallel"]] == r
        assert d.ranks_of("data_parallel", r)[c["data_parallel"]] == r


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=4, sequence_parallel_size=3), "not divisible"),
    (dict(world_size=4, expert_parallel_sizes=[3]), "ep_size=3"),
    (dict(world_size=4, sequence_parallel_size=2, expert_parallel_sizes=[8]), "ep_size=8"),
    (dict(world_size=0), "positive"),
])
def test_bad_sizes(kwargs, match):
    world = kwargs.pop("world_size")
    with pytest.raises(MeshError, match=match):
        MeshDescription.standard(world, **kwargs)


def _sum_over(group):
    t = torch.tensor([float(tdist.get_rank())])
    tdist.all_reduce(t, group=group)
    return t.item()


def _check_groups(sp, ep, pp=1):
    world, rank = tdist.get_world_size(), tdist.get_rank()
    mesh = groups.initialize_mesh(sequence_parallel_size=sp, expert_parallel_sizes=[ep], pipe_parallel_size=pp)
    d = MeshDescription.standard(world, sequence_parallel_size=sp, expert_parallel_sizes=[ep], pipe_parallel_size=pp)
    assert mesh.description == d
    name = f"ep_size_{ep}"
    expect = {
        "sp": d.ranks_of("sequence_parallel", rank),
        "dp": d.ranks_of("data_parallel", rank),
        "spdp": d.ranks_of("sequence_data_parallel", rank),
        "ep": d.ranks_of(f"expert_parallel:{name}", rank),
        "edp": d.ranks_of(f"expert_data_parallel:{name}", rank),
        "pp": d.ranks_of("pipe_parallel", rank),
        "pmp": d.ranks_of("pipe_model_parallel", rank),
    }
    got = {
        "sp": (groups._get_sequence_parallel_group(), groups._get_sequence_parallel_world_size(),
               groups._get_sequence_parallel_rank()),
        "dp":
        (groups._get_data_parallel_group(), groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "spdp": (groups._get_sequence_data_parallel_group(), groups._get_sequence_data_parallel_world_size(),
                 groups._get_sequence_data_parallel_rank()),
        "ep": (groups._get_expert_parallel_group(name), groups._get_expert_parallel_world_size(name),
               groups._get_expert_parallel_rank(name)),
        "edp": (groups._get_expert_data_parallel_group(name), groups._get_expert_data_parallel_world_size(name),
                groups._get_expert_data_parallel_rank(name)),
        "pp":
        (groups._get_pipe_parallel_group(), groups._get_pipe_parallel_world_size(), groups._get_pipe_parallel_rank()),
        "pmp": (groups._get_pipe_model_parallel_group(), groups._get_pipe_model_parallel_world_size(),
                groups._get_pipe_model_parallel_rank()),
    }
    for key, ranks in expect.items():
        group, size, index = got[key]
        assert size == len(ranks) and ranks[index] == rank, (key, ranks, size, index)
        assert _sum_over(group) == float(sum(ranks)), key
    assert groups._get_expert_parallel_group_dict()[name] is got["ep"][0]
    assert groups._get_expert_data_parallel_group_dict()[name] is got["edp"][0]
    assert groups._get_max_expert_size() == ep and groups._get_max_expert_size_name() == name
    assert groups._get_broadcast_src_rank() == expect["spdp"][0]
    assert groups._get_expert_broadcast_src_rank(name) == expect["edp"][0]
    assert groups._get_model_parallel_world_size() == 1 and groups._get_model_parallel_rank() == 0
    # A second build of the same mesh creates no group: the same objects come back.
    again = groups.initialize_mesh(sequence_parallel_size=sp, expert_parallel_sizes=[ep], pipe_parallel_size=pp)
    assert again.groups == mesh.groups
    groups.reset_mesh()
    return True


@pytest.mark.parametrize("world, sp, ep, pp", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 1, 1), (3, 1, 3, 1), (4, 2, 2, 1),
                                               (4, 1, 2, 1), (4, 4, 4, 1), (4, 2, 4, 1), (2, 1, 1, 2), (4, 1, 2, 2),
                                               (3, 1, 1, 3)])
def test_groups_work(world, sp, ep, pp):
    assert run_distributed(_check_groups, world, args=(sp, ep, pp), timeout=T) == [True] * world


class _SequenceMpu:
    """An mpu like upstream's parallel_state_sp: sequence and sequence-data groups, made with plain torch."""

    def __init__(self, sp):
        world, rank = tdist.get_world_size(), tdist.get_rank()
        self.sp = sp
        for start in range(0, world, sp):
            ranks = list(range(start, start + sp))
            g = tdist.new_group(ranks)
            if rank in ranks:
                self.sp_group = g
        self.spdp_group = tdist.group.WORLD

    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self):
        return tdist.get_world_size(self.sp_group)

    def get_sequence_parallel_rank(self):
        return tdist.get_rank(self.sp_group)

    def get_sequence_data_parallel_group(self):
        return self.spdp_group

    def get_sequence_data_parallel_world_size(self):
        return tdist.get_world_size()

    def get_sequence_data_parallel_rank(self):
        return tdist.get_rank()


def _check_mpu():
    world, rank = tdist.get_world_size(), tdist.get_rank()
    mpu = _SequenceMpu(2)
    groups.initialize_mesh(mpu=mpu, expert_parallel_sizes=[2])
    assert groups._get_sequence_parallel_group() is mpu.sp_group
    assert groups._get_sequence_data_parallel_group() is mpu.spdp_group
    assert groups._get_sequence_parallel_world_size() == 2
    assert groups._get_data_parallel_world_size() == world // 2
    dp = [r for r in range(world) if r % 2 == rank % 2]
    assert _sum_over(groups._get_data_parallel_group()) == float(sum(dp))
    ep = [rank - rank % 2, rank - rank % 2 + 1]
    assert _sum_over(groups._get_expert_parallel_group("ep_size_2")) == float(sum(ep))
    assert _sum_over(groups._get_expert_data_parallel_group("ep_size_2")) == float(sum(dp))
    assert groups.mpu is mpu
    groups.reset_mesh()
    return True


def test_mpu_groups():
    assert run_distributed(_check_mpu, 4, timeout=T) == [True] * 4


def _engine_with_mpu(sp, tensor_parallel):
    import deepspeed
    mpu = _SequenceMpu(sp)
    if tensor_parallel:
        mpu.get_model_parallel_world_size = lambda: 2
    model = torch.nn.Linear(4, 3)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    except ValueError as err:  # tensor parallel size without the tensor-parallel groups
        return "ValueError: " + str(err)
    out = (engine.dp_world_size, engine.seq_dp_world_size, engine.train_batch_size(),
           groups._get_sequence_parallel_world_size())
    engine.destroy()
    groups.reset_mesh()
    return out


def test_engine_takes_mpu():
    assert run_distributed(_engine_with_mpu, 4, args=(2, False), timeout=T) == [(2, 4, 2, 2)] * 4
    for message in run_distributed(_engine_with_mpu, 2, args=(1, True), timeout=T):
        assert message.startswith("ValueError") and "tensor" in message


def _bad_sp():
    import deepspeed
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": 3,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        }
    }
    try:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    except Exception as err:  # noqa: BLE001 - the error type and text are the result
        return type(err).__name__
    return "no error"


def test_bad_sequence_parallel_size_errors_on_every_rank():
    results = run_distributed(_bad_sp, 2, timeout=T)
    assert len(set(results)) == 1 and results[0] != "no error"


@pytest.mark.parametrize("world, tp, ep, pp", [(16, 2, 4, 1), (8, 1, 2, 2), (12, 3, 2, 2), (4, 1, 4, 1)])
def test_expert_parallel_ranks_helper(world, tp, ep, pp):
    """Upstream's pure ``_get_expert_parallel_ranks``: written out from its rule (pipeline stages of consecutive
    ranks; in a stage, the data-parallel ranks of each tensor rank cut into expert groups of ``ep`` consecutive
    members; expert-data-parallel groups take one position of each), in upstream's order."""
    stage = world // pp
    ep_groups, edp_groups = [], []
    for start in range(0, world, stage):
        for t in range(tp):
            dp = list(range(start + t, start + stage, tp))
            ep_groups += [dp[i:i + ep] for i in range(0, len(dp), ep)]
            edp_groups += [dp[j::ep] for j in range(ep)]
    assert groups._get_expert_parallel_ranks(world, tp, ep, pp) == (ep_groups, edp_groups)
    with pytest.raises(MeshError):
        groups._get_expert_parallel_ranks(world, tp, world + 1, pp)
