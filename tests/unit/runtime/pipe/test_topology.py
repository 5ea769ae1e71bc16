# SPDX-License-Identifier: Apache-2.0
"""Process topologies (pure maps between ranks and coordinates) and the pipeline grid as a view of the mesh."""

import pytest

from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology,
                                             _prime_factors)
from tests.unit.common import run_distributed


def test_row_major_mapping_and_queries():
    topo = ProcessTopology(axes=["a", "b", "c"], dims=[2, 3, 2])
    assert topo.world_size() == 12
    for rank in range(12):
        coord = topo.get_coord(rank)
        assert topo.get_rank(**coord._asdict()) == rank
        assert rank == (coord.a * 3 + coord.b) * 2 + coord.c
    assert topo.get_dim("b") == 3 and topo.get_dim("missing") == 0
    assert topo.get_axis_comm_lists("a") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert topo.get_axis_comm_lists("missing") == []
    assert topo.filter_match(a=1, c=0) == [6, 8, 10]
    assert topo.get_axis_list("b", 2) == [4, 5, 10, 11]
    assert topo.get_rank_repr(rank=11) == "a_01-b_02-c_01"
    assert topo.get_rank_repr(rank=11, omit_axes=["a", "c"], inner_sep="=", outer_sep="/") == "b=02"
    with pytest.raises(ValueError):
        topo.get_rank(a=0, b=0)  # slices are filter_match's
    with pytest.raises(ValueError):
        ProcessTopology(axes=["x", "x"], dims=[1, 2])


def test_pipeline_topologies_and_prime_factors():
    pd = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert pd.get_axis_names() == ["pipe", "data"] and pd.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert pmd.get_axis_names() == ["pipe", "data", "model"]
    assert pmd.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pmd.get_rank_repr(rank=5) == "model_01"  # data and pipe omitted: checkpoint names
    assert _prime_factors(12) == [2, 2, 3] and _prime_factors(7) == [7]


def _grid_views(axes, dims):
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    from deepspeed.utils import groups
    topo = ProcessTopology(axes=axes, dims=dims)
    grid = PipelineParallelGrid(topology=topo)
    rank = dist.get_rank()

    def ranks(group):
        return sorted(dist.get_process_group_ranks(group))

    return dict(stage=grid.get_stage_id(),
                dp_rank=grid.get_data_parallel_rank(),
                dp=ranks(grid.get_data_parallel_group()),
                pp=ranks(grid.get_pipe_parallel_group()),
                model=ranks(grid.get_model_parallel_group()),
                slice=ranks(grid.get_slice_parallel_group()),
                mp_rank=grid.get_model_parallel_rank(),
                mesh_dp=sorted(groups._get_data_parallel_group_ranks()),
                to_global=[grid.stage_to_global(s) for s in range(grid.pipe_parallel_size)],
                p2p=grid.p2p_groups[rank],
                topo_dp=next(r for r in topo.get_axis_comm_lists("data") if rank in r),
                topo_pp=next(r for r in topo.get_axis_comm_lists("pipe") if rank in r))


@pytest.mark.parametrize("axes,dims", [(["pipe", "data"], [2, 2]), (["data", "pipe"], [2, 2]),
                                       (["pipe", "data", "model"], [2, 1, 2])])
def test_grid_is_a_view_of_the_mesh(axes, dims):
    views = run_distributed(_grid_views, 4, args=(axes, dims))
    for rank, v in enumerate(views):
        assert v["dp"] == sorted(v["topo_dp"]) == v["mesh_dp"], (rank, v)
        assert v["pp"] == sorted(v["topo_pp"]), (rank, v)
        assert v["to_global"] == v["topo_pp"]  # stage s of this rank's pipeline
        assert v["p2p"] == [rank, v["topo_pp"][(v["stage"] + 1) % len(v["topo_pp"])]]
        # the grid's model-parallel group is the pipe x model group of one data-parallel replica
        assert len(v["model"]) == len(v["topo_pp"]) * len(v["slice"]) and rank in v["model"]
        assert v["mp_rank"] == v["model"].index(rank)
