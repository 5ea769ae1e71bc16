# SPDX-License-Identifier: Apache-2.0
"""Muon (``"optimizer": {"type": "Muon"}`` and a client ``torch.optim.Muon``) on ZeRO 0-3 against plain torch.

Each engine cell trains :class:`muon_cases.Net` (seeded random widths: odd, 1-wide, matrices smaller than the world,
tiny buckets so that matrices are cut across two and three ranks) and compares every parameter after every step
with :class:`muon_cases.Reference`, a single-process plain-torch Muon + AdamW on the global batch. A client
``torch.optim.Muon`` is compared with torch's own Muon stepping the same model in one process.
"""

import os

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
        config["zero_optimization"] = {
            "stage": stage,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0
        }
        if cell.get("offload"):
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            config["zero_force_ds_cpu_optimizer"] = False
            config["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = cell.get("in_memory", False)
    if cell.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    if cell.get("dtype") == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
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
    start = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cell.get("dtype"))
    reference = cases.Reference(cases.Net(seed),
                                lr=0.02,
                                adam_lr=1e-3,
                                weight_decay=0.01,
                                clip=cell.get("clip", 0),
                                low=start,
                                scale=2.0**8 if start == torch.float16 else 1.0)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if cell.get("in_memory"):  # save_muon_momentum_buffer_in_memory: the momentum beside the model, not the masters
        assert optimizer.optimizer.momentum_device == engine.device
    muon = {n for n, p in model.named_parameters() if p.use_muon}
    assert muon == {n for n, p in reference.model.named_parameters() if cases.is_muon(n, p)}, muon
    gas = cell.get("gas", 1)
    tol = dict(rtol=1e-5, atol=1e-6)  # the float32 masters (16-bit cells: the reference computes in 16 bits too)
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
    dict(world=2, stage=0, gas=4, clip=0.5, dtype="fp16", seed=7),
]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_muon_matches_reference(cell):
    assert all(run_distributed(train_worker, cell["world"], args=(cell, ), timeout=180))


# ------------------------------------------------------------------ client torch.optim.Muon
def torch_muon_worker(stage, seed):
    import copy
    import deepspeed
    import deepspeed.comm as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    model = cases.Net(seed, bias=False, embed=False)  # every parameter a matrix: torch's Muon takes only those
    reference = copy.deepcopy(model)
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    theirs = torch.optim.Muon(reference.parameters(), **kwargs)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}}
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           optimizer=torch.optim.Muon(model.parameters(), **kwargs),
                                           config=config)
    for step in range(STEPS):
        engine.backward(engine(*cases.batch(step, 0, rank)))
        engine.step()
        theirs.zero_grad()
        for r in range(world):
            (reference(*cases.batch(step, 0, r)) / world).backward()
        theirs.step()
        ours = _full_params(engine, model)
        for name, p in reference.named_parameters():
            # torch's Newton-Schulz runs in bfloat16: a gradient one float32 rounding away may round one element
            # of the bfloat16 iterate the other way, so the bound is the bfloat16 step of lr * O, not float32's
            torch.testing.assert_close(ours[name], p.detach(), rtol=0, atol=2e-3, msg=lambda m: f"{step} {name}: {m}")
    engine.destroy()
    return True


@pytest.mark.parametrize("stage,world", [(3, 3)])
def test_client_torch_muon_on_partitions(stage, world):
    assert all(run_distributed(torch_muon_worker, world, args=(stage, 7), timeout=180))


# ------------------------------------------------------------------ checkpoints
GLOBAL_BATCH = 12


def global_batch(step, rank, world):
    """Rank ``rank``'s share of one global batch of 12 samples, the same samples at every world size."""
    ids, y = cases.batch(step, 0, 0, n=GLOBAL_BATCH)
    n = GLOBAL_BATCH // world
    return ids[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _ckpt_config(stage, world):
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "optimizer": {
            "type": "Muon",
            "params": {
                "lr": 0.02,
                "adam_lr": 1e-3
            }
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40
        },
    }


def _losses(engine, steps, world):
    import deepspeed.comm as dist
    losses = []
    for step in steps:
        loss = engine(*global_batch(step, dist.get_rank(), world))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def ckpt_save_worker(root, stage):
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.checkpoint.test_checkpoint_resume import attach_checkpointing
    attach_checkpointing()
    world = dist.get_world_size()
    model = cases.Net(8)
    engine, _, _, _ = deepspeed.initialize(model=model, config=_ckpt_config(stage, world))
    _losses(engine, range(2), world)
    engine.save_checkpoint(root, tag="t")
    continued = _losses(engine, range(2, 4), world)
    engine.destroy()
    return continued


def ckpt_load_worker(root, stage, universal):  # universal: the latest tag (the converted folder) is loaded
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.checkpoint.test_checkpoint_resume import attach_checkpointing
    attach_checkpointing()
    world = dist.get_world_size()
    config = _ckpt_config(stage, world)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    model = cases.Net(8, init_seed=9)  # other initial values: everything comes from the checkpoint
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    path, _ = engine.load_checkpoint(root, tag=None if universal else "t")
    assert path is not None
    momenta = [s["momentum_buffer"] for s in engine.optimizer.optimizer.state.values() if "momentum_buffer" in s]
    assert momenta and all(m.abs().sum() > 0 for m in momenta), "the momentum buffers were not restored"
    resumed = _losses(engine, range(2, 4), world)
    engine.destroy()
    return resumed


def test_checkpoint_reshard_and_universal(tmp_path):
    """Saved at ZeRO-2 on 2 ranks; loaded at ZeRO-3 on 3 ranks, at ZeRO-0 on 1 and, converted to the universal
    format, at ZeRO-1 on 2: the next two losses equal the continued run's."""
    from tests.unit.checkpoint.test_universal_checkpoint import convert
    root = str(tmp_path / "ckpt")
    continued = run_distributed(ckpt_save_worker, 2, args=(root, 2))[0]
    for stage, world in ((3, 3), (0, 1)):
        resumed = run_distributed(ckpt_load_worker, world, args=(root, stage, False))[0]
        assert resumed == pytest.approx(continued, rel=1e-5), (stage, world)
    universal = str(tmp_path / "ckpt" / "t_universal")
    done = convert(str(tmp_path / "ckpt" / "t"), universal)
    assert done.returncode == 0, done.stderr
    assert os.path.exists(os.path.join(universal, "zero", "layers.0.weight", "momentum_buffer.pt"))
    with open(os.path.join(root, "latest_universal"), "w") as handle:
        handle.write("t_universal")
    resumed = run_distributed(ckpt_load_worker, 2, args=(root, 1, True))[0]
    assert resumed == pytest.approx(continued, rel=1e-5)


# ------------------------------------------------------------------ single process: split, keys, Newton-Schulz
def test_split_keys_and_defaults():
    from deepspeed.ops.muon import tag_muon_params
    from deepspeed.runtime.engine_parts.optimizer_factory import build_optimizer
    model = cases.Net(3)
    model.layers[0].weight.use_muon = False  # a user's marking is kept
    model.layers[1].bias.ds_shape = torch.Size([2, 3])  # a zero.Init placeholder reports its layer shape
    tag_muon_params(model)
    names = {n for n, p in model.named_parameters() if p.use_muon}
    assert names == {"layers.1.bias", "layers.1.weight", "layers.2.weight"}
    del model.layers[1].bias.ds_shape
    model.layers[1].bias.use_muon = False
    opt = build_optimizer("Muon", model.parameters(), {"muon_lr": 0.05, "weight_decay": 0.1})
    muon, adam = opt.param_groups
    assert (muon["name"], muon["lr"], muon["momentum"], muon["ns_method"], muon["ns_steps"], muon["weight_decay"]) \
        == ("muon-params", 0.05, 0.95, "gram", 5, 0.1)
    assert (adam["name"], adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) \
        == ("adam-params", 3e-4, (0.9, 0.95), 1e-10, 0.1)
    with pytest.raises(ValueError, match="nesterovv"):
        build_optimizer("Muon", model.parameters(), {"nesterovv": True})
    with pytest.raises(NotImplementedError, match="per_head_muon"):
        build_optimizer("Muon", model.parameters(), {"per_head_muon": True})
    bare = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="use_muon"):
        build_optimizer("Muon", [bare], {})


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (5, 5), (1, 9), (9, 1), (1, 1)])
def test_newton_schulz_variants_match_reference(shape):
    from deepspeed.ops.muon import orthogonalize
    G = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    expected = cases.newton_schulz(G)
    for method in ("gram", "standard"):
        torch.testing.assert_close(orthogonalize(G, 5, method), expected, rtol=1e-4, atol=1e-5)


def test_upstream_original_muon_names():
    """``deepspeed.runtime.zero.muon.original_muon``: ``SingleDeviceMuon`` steps as the reference's Muon half, and
    ``muon_update`` keeps the momentum out of an overflowed step."""
    from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuon, muon_update
    gen = torch.Generator().manual_seed(5)
    ours = torch.nn.Parameter(torch.randn(5, 3, generator=gen))
    value, buf = ours.detach().clone(), torch.zeros(5, 3)
    opt = SingleDeviceMuon([ours], lr=0.02, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(5, 3, generator=gen)
        ours.grad = grad.clone()
        opt.step()
        buf.lerp_(grad, 1 - 0.95)
        value = value * (1 - 0.02 * 0.1) - 0.02 * cases.newton_schulz(grad.lerp(buf, 0.95)) * (5 / 3)**0.5
    torch.testing.assert_close(ours.detach(), value, rtol=1e-5, atol=1e-6)
    momentum = torch.ones(4, 4)
    bad = torch.full((4, 4), float("inf"))
    assert not torch.isfinite(muon_update(bad, momentum)).all() and torch.equal(momentum, torch.ones(4, 4))
