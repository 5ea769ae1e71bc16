# SPDX-License-Identifier: Apache-2.0
"""What cannot be honoured in a foreign checkpoint raises on every rank, naming the file and the key; nothing loads.

Each case copies an upstream fixture, breaks it in one way, and loads it on 2 ranks into an engine that trained
one step: every rank raises (the same exception type and message on each), the message names the file and the
key, and the engine's fp32 masters, moments and counters are unchanged (no partial load); the engine then still
trains and loads its own checkpoint.
"""

import os
import shutil

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.checkpoint import test_upstream_fixtures as fixtures
from tests.unit.checkpoint.upstream import model as fixture_model
from tests.unit.common import run_distributed


def _edit(path, change):
    payload = torch.load(path, weights_only=False)
    change(payload)
    torch.save(payload, path)


def break_fixture(root, case):
    """Copy a fixture into ``root`` and break it; returns (cell, exception name, words the message must hold)."""
    if case == "missing-rank-file":
        cell = "z2-fp32"
        shutil.copytree(os.path.join(fixtures.FIXTURES, cell), os.path.join(root, cell))
        path = os.path.join(root, cell, "t3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        os.remove(path)
        return cell, "CheckpointError", [path, "dp_world_size"]
    if case == "unmappable-state":
        cell = "z1-bf16"
        shutil.copytree(os.path.join(fixtures.FIXTURES, cell), os.path.join(root, cell))
        path = os.path.join(root, cell, "t3", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")

        def add(payload):
            state = payload["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
            state["momentum_matrix"] = torch.zeros(3, 3)

        _edit(path, add)
        return cell, "NotImplementedError", [path, "momentum_matrix"]
    if case == "pipeline-file":
        cell = "z3-fp32"
        shutil.copytree(os.path.join(fixtures.FIXTURES, cell), os.path.join(root, cell))
        path = os.path.join(root, cell, "t3", "layer_01-model_00-model_states.pt")
        torch.save({}, path)
        return cell, "NotImplementedError", [path, "pipeline"]
    if case == "tensor-parallel":
        cell = "z0-fp32"
        shutil.copytree(os.path.join(fixtures.FIXTURES, cell), os.path.join(root, cell))
        path = os.path.join(root, cell, "t3", "mp_rank_00_model_states.pt")
        _edit(path, lambda payload: payload.update(mp_world_size=2))
        return cell, "NotImplementedError", [path, "mp_world_size"]
    if case == "short-partition":
        cell = "z3-bf16"
        shutil.copytree(os.path.join(fixtures.FIXTURES, cell), os.path.join(root, cell))
        path = os.path.join(root, cell, "t3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")

        def cut(payload):
            groups = payload["optimizer_state_dict"]["fp32_flat_groups"]
            groups[0] = groups[0][:5].clone()

        _edit(path, cut)
        return cell, "CheckpointError", [path, "fp32_flat_groups"]
    raise ValueError(case)


def error_worker(root, cell, kind, words):
    import deepspeed
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank = dist.get_rank()
    stage, dtype, _, _ = fixture_model.parse_cell(cell)
    model = fixture_model.build_model(seed=1)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=fixtures.our_config(stage, dtype, False, 2))

    def train(step):
        for x, y in fixtures.batches(step, rank, 2):
            engine.backward(fixture_model.loss_fn(engine(x.to(fixture_model.torch_dtype(dtype))), y))
            engine.step()

    train(0)
    before = fixtures.state_of(engine)
    steps = engine.global_steps
    with pytest.raises(Exception) as info:
        engine.load_checkpoint(os.path.join(root, cell), tag=fixtures.TAG)
    assert type(info.value).__name__ == kind, f"rank {rank}: {type(info.value).__name__}: {info.value}"
    for word in words:
        assert word in str(info.value), f"rank {rank}: {word!r} not in {info.value}"
    fixtures.compare(fixtures.state_of(engine), before, 0.0, f"rank {rank}: after the failed load")
    assert engine.global_steps == steps
    train(1)  # the ranks are still in step
    own = os.path.join(root, "own")
    engine.save_checkpoint(own)
    assert engine.load_checkpoint(own)[0] is not None
    engine.destroy()
    return str(info.value)


CASES = ["missing-rank-file", "unmappable-state", "pipeline-file", "tensor-parallel", "short-partition"]


@pytest.mark.parametrize("case", CASES)
def test_unloadable_upstream_checkpoint_raises_on_every_rank(tmp_path, case):
    root = str(tmp_path)
    cell, kind, words = break_fixture(root, case)
    messages = run_distributed(error_worker, 2, args=(root, cell, kind, words), timeout=120)
    assert messages[0] == messages[1]
