# SPDX-License-Identifier: Apache-2.0
"""Muon (``"optimizer": {"type": "Muon"}`` and a client ``torch.optim.Muon``) on ZeRO 0-3 against plain torch.

Each engine cell trains :class:`muon_cases.Net` (seeded random widths: odd, 1-wide, matrices smaller than the world,
tiny buckets so that matrices are cut across two and three ranks) and compares every parameter after every step
with :class:`muon_cases.Reference`, a single-process plain-torch Muon + AdamW on the global batch. A client
``torch.optim.Muon`` is compared with torch's own Muon stepping the same model in one process.
"""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.ops import muon_cases as cases

STEPS = 3


def _config(cell):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": cell.get("gas", 1),
        "gradient_clipping": cell.get("clip", 0.0),
        "optimizer": {
            "type": "Muon",
            "params": {
                "lr": 0.02,
                "adam_lr": 1e-3,
                "weight_decay": 0.01
            }
        },
    }
    stage = cell.get("stage")
    if stage is not None:
        config["zero_optimization"] = {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0}
        if cell.get("offload"):
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            config["zero_force_ds_cpu_optimizer"] = False
            config["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = cell.get("in_memory", False)
    if cell.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _full_params(engine, model):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters()}


def train_worker(cell):
    import deepspeed
    import deepspeed.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _config(cell)
    seed = cell["seed"]
    if cell.get("zero_init"):
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = cases.Net(seed)
    else:
        model = cases.Net(seed)
    reference = cases.Reference(cases.Net(seed), lr=0.02, adam_lr=1e-3, weight_decay=0.01, clip=cell.get("clip", 0))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    muon = {n for n, p in model.named_parameters() if p.use_muon}
    assert muon == {n for n, p in reference.model.named_parameters() if cases.is_muon(n, p)}, muon
    gas = cell.get("gas", 1)
    tol = dict(rtol=1e-5, atol=1e-6) if cell.get("dtype") != "bf16" else dict(rtol=1e-2, atol=1e-2)
    for step in range(STEPS):
        for micro in range(gas):
            engine.backward(engine(*cases.batch(step, micro, rank)))
            engine.step()
        reference.step(step, world, gas)
        ours, expected = _full_params(engine, model), reference.params()
        for name in expected:
            torch.testing.assert_close(ours[name], expected[name], **tol, msg=lambda m: f"step {step} {name}: {m}")
    engine.destroy()
    return True


CELLS = [
    dict(world=1, stage=None, gas=1, seed=1),  # no ZeRO section
    dict(world=2, stage=1, gas=4, clip=0.5, seed=2),
    dict(world=3, stage=2, gas=1, clip=0.05, seed=3),
    dict(world=4, stage=3, gas=1, zero_init=True, seed=4),
    dict(world=2, stage=3, gas=4, offload=True, in_memory=True, seed=5),
    dict(world=2, stage=2, offload=True, dtype="bf16", seed=6),
]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_muon_matches_reference(cell):
    assert all(run_distributed(train_worker, cell["world"], args=(cell, ), timeout=180))
