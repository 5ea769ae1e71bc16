# SPDX-License-Identifier: Apache-2.0
"""The checkpoint reshaping tools (upstream's names): which saved (pipeline, tensor, data) ranks each rank of a
smaller run takes over, the degrees of a checkpoint folder, ZeRO files merged for a target rank, ``merge_state``,
and ``DeepSpeedCheckpoint`` on a pipeline checkpoint (upstream 0.19.8's own, from the fixtures)."""

import os

import pytest
import torch

from deepspeed.checkpoint import (DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, merge_state,
                                  model_3d_desc)
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARTITION_COUNT

PIPE = os.path.join(os.path.dirname(__file__), "upstream", "fixtures_pipe", "pp2-z1-fp32", "t2")


@pytest.mark.parametrize("target,expected", [
    ((1, 1, 1), {
        (0, 0, 0): [0, 4, 1, 5, 2, 6, 3, 7]
    }),
    ((1, 2, 1), {
        (0, 0, 0): [0, 4, 2, 6],
        (0, 1, 0): [1, 5, 3, 7]
    }),
    ((1, 2, 2), {
        (0, 0, 0): [0, 4],
        (0, 1, 0): [1, 5],
        (0, 0, 1): [2, 6],
        (0, 1, 1): [3, 7]
    }),
    ((2, 1, 1), {
        (0, 0, 0): [0, 4, 1, 5],
        (1, 0, 0): [2, 6, 3, 7]
    }),
])
def test_reshape_222(target, expected):
    src = model_3d_desc(pp_degree=2, tp_degree=2, dp_degree=2)
    tgt = model_3d_desc(*target)
    assert src.can_reshape(tgt)[0]
    maps = src.reshape(tgt)
    assert len(maps) == tgt.dp_degree
    assert all(m.pp_degree == tgt.pp_degree and m.tp_degree == tgt.tp_degree for m in maps)
    for (pp, tp, dp), ranks in expected.items():
        assert maps[dp].get_data(pp_index=pp, tp_index=tp) == ranks
    ok, errors = tgt.can_reshape(src)
    assert not ok and any("Expansion reshape not supported" in e for e in errors)


def test_pipeline_checkpoint_degrees_and_zero_files_merged():
    assert get_model_3d_descriptor(PIPE).get_desc() == "PP,TP,DP = (2, 1, 1)"
    ckpt = DeepSpeedCheckpoint(PIPE)
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 1, 1) and len(ckpt.layer_files) == 5
    assert os.path.basename(ckpt.get_zero_files(1, 0, 0)[0]) == "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    zero = ZeROCheckpoint(PIPE)
    zero.reshape(model_3d_desc(pp_degree=1, tp_degree=1, dp_degree=1))
    assert [os.path.basename(f) for f in zero.get_files_for_rank(0, 0, 0)
            ] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]


def test_zero_files_of_two_data_parallel_ranks_merged(tmp_path):
    torch.save({"param_shapes": [{}], "ds_config": {}}, os.path.join(str(tmp_path), "mp_rank_00_model_states.pt"))
    for rank in range(2):
        param = torch.nn.Parameter(torch.full((8, ), float(rank)))
        optimizer = torch.optim.AdamW([param], lr=1e-3)
        param.grad = torch.ones(8)
        optimizer.step()
        torch.save(
            {
                OPTIMIZER_STATE_DICT: {
                    "base_optimizer_state": optimizer.state_dict(),
                    "group_paddings": [2],
                    PARTITION_COUNT: [2]
                }
            }, os.path.join(str(tmp_path), f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    zero = ZeROCheckpoint(str(tmp_path))
    assert zero.get_src_dp_degree() == 2
    zero.reshape(model_3d_desc(pp_degree=1, tp_degree=1, dp_degree=1))
    state = zero.get_state_for_rank(0, 0, 0)[OPTIMIZER_STATE_DICT]
    merged = state["base_optimizer_state"]["state"][0]
    assert merged["exp_avg"].numel() == 12 and merged["step"].dim() == 0  # each rank's padding of 2 stripped
    assert state[PARTITION_COUNT] == [1] and state["group_paddings"] == [0]


def test_merge_state(capsys):
    merged = merge_state({"exp_avg": torch.ones(4), "rank_0_only": torch.ones(2)}, {"exp_avg": torch.ones(4)})
    assert list(merged) == ["exp_avg", "rank_0_only"] and merged["exp_avg"].numel() == 8
    with pytest.raises(ValueError, match="Cannot merge lists of different lengths"):
        merge_state({"opt": {"groups": [1, 2]}}, {"opt": {"groups": [1]}})
    assert "opt.groups" in capsys.readouterr().out
