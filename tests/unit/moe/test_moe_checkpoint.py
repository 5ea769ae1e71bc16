# SPDX-License-Identifier: Apache-2.0
"""Expert checkpoints: upstream's per-expert files, an exact resume, and another expert-parallel size.

A run trains, saves, and trains on; a fresh engine (other initial weights) loads the checkpoint
and trains the same steps: its losses and every parameter (read with safe_get_full_fp32_param,
expert parameters on their own rank) must equal the first run's continuation exactly. The
MoE layer at ep 2 on ZeRO 0 and 2, AutoEP on a tiny Mixtral on ZeRO 1, Adam (so that the optimizer
state matters). Loading an ep-2 checkpoint into an ep-1 model: the module only works (every
expert read from its own file, with load_module_strict=False), a full load raises on every rank.
"""

import os

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.moe.test_moe_contract import Net, _data

T = 240


def _engine(kind, stage, ep, seed):
    import deepspeed
    torch.manual_seed(seed)
    if kind == "moe":
        model = Net(ep, 2)
        if seed != 0:  # other weights than the run that saved
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.3)
    else:
        from tests.unit.moe.test_autoep import _mixtral
        model = _mixtral()
        if seed != 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": stage
        },
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.01
            }
        }
    }
    if kind == "autoep":
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine, model


def _train(engine, kind, steps, offset):
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(steps):
        if kind == "moe":
            loss = engine(_data(torch.distributed.get_world_size(), 4)[(step + offset) % 4][rank])
        else:
            ids = (torch.arange(6) * (step + offset + 1) + rank).remainder(32).unsqueeze(0)
            loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _values(engine):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _resume(kind, stage, ep, directory):
    from deepspeed.utils import groups
    engine, _ = _engine(kind, stage, ep, 0)
    _train(engine, kind, 2, 0)
    engine.save_checkpoint(directory, tag="t")
    want_losses = _train(engine, kind, 2, 2)
    want = _values(engine)
    engine.destroy()
    engine, _ = _engine(kind, stage, ep, 1)
    engine.load_checkpoint(directory, tag="t")
    got_losses = _train(engine, kind, 2, 2)
    got = _values(engine)
    engine.destroy()
    groups.reset_mesh()
    files = sorted(os.listdir(os.path.join(directory, "t")))
    bad = [n for n in want if not torch.equal(want[n], got[n])]
    return got_losses == want_losses, bad, files


@pytest.mark.parametrize("kind, stage", [("moe", 0), ("moe", 2), ("autoep", 1)])
def test_resume_is_exact(kind, stage, tmp_path):
    results = run_distributed(_resume, 2, args=(kind, stage, 2, str(tmp_path)), timeout=T)
    for same_losses, bad, files in results:
        assert same_losses and bad == [], bad
    files = results[0][2]
    layers = 1 if kind == "moe" else 2
    for layer in range(layers):
        for e in range(4):
            assert f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" in files
    assert {"expp_rank_0_mp_rank_00_expert_states.pt", "expp_rank_1_mp_rank_00_expert_states.pt"} <= set(files)


def _other_ep(directory):
    from deepspeed.runtime.checkpoint.validate import CheckpointError
    from deepspeed.utils import groups
    engine, model = _engine("moe", 2, 2, 0)
    _train(engine, "moe", 1, 0)
    engine.save_checkpoint(directory, tag="t")
    rank = torch.distributed.get_rank()
    saved = {
        f"{e}": [p.detach().clone() for p in model.moe.deepspeed_moe.experts.deepspeed_experts[i].parameters()]
        for i, e in enumerate(model.moe.global_expert_indices)
    }
    engine.destroy()
    engine, model = _engine("moe", 2, 1, 1)
    try:
        engine.load_checkpoint(directory, tag="t")
        full = "no error"
    except CheckpointError as err:
        full = "CheckpointError" if "expert-parallel sizes" in str(err) else str(err)
    engine.load_checkpoint(directory, tag="t", load_module_only=True, load_module_strict=False)
    experts = model.moe.deepspeed_moe.experts.deepspeed_experts
    mine = [experts[int(e)] for e in saved]  # this rank's saved experts, now at their global index
    same = all(torch.equal(p, q) for e, m in zip(saved, mine) for p, q in zip(saved[e], m.parameters()))
    engine.destroy()
    groups.reset_mesh()
    return full, same, rank


def test_other_expert_parallel_size(tmp_path):
    for full, same, _ in run_distributed(_other_ep, 2, args=(str(tmp_path), ), timeout=T):
        assert full == "CheckpointError" and same
