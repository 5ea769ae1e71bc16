# SPDX-License-Identifier: Apache-2.0
"""A checkpoint of any ZeRO stage loads into an engine of any stage, at another world size.

Every (save stage, load stage) pair in {0, 1, 2, 3}^2, world sizes 1 -> 2, 2 -> 1 and
2 -> 3, fp32 and bf16, with a frozen and a tied parameter. Every rank of every world size
trains on its equal share of one fixed global batch (``test_checkpoint_reshard``), so the
trained model does not depend on the world size (up to rounding). Each cell:

* saves after 3 steps on W ranks, and goes on for 3 more steps (the run that never stopped);
* loads on W' ranks into a fresh engine of another stage (other initial weights): right
  after the load every fp32 parameter, ``exp_avg``, ``exp_avg_sq``, ``step``, every
  16-bit model parameter (frozen included, gathered on stage 3) and the step counter
  equal the saved ones bitwise (``safe_get_full_*``);
* trains 3 more steps: fp32 matches the run that never stopped and a plain-torch AdamW
  reference of all 6 steps (tight tolerance); bf16 matches the run that never stopped.

A few cells run stage 3 with optimizer and parameter offload (16-bit shards beside the
fp32 masters) on either side.

A checkpoint of another model raises on every rank, naming the parameter and both
shapes, across the stage-3 boundary in both directions; the engine then still saves and
loads.
"""

import itertools

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_reshard as reshard
from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def config(stage, dtype, world, offload=False):
    cfg = common.make_config(stage, dtype, gas=1, micro=reshard.GLOBAL_BATCH // world, bucket=40, scheduler=False)
    if stage == 3:
        cfg["zero_optimization"].update(SMALL_UNITS)
        if offload:  # 16-bit shards kept beside the fp32 masters
            cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return cfg


def build(stage, dtype, world, seed, dim=None, offload=False):
    return common.build_engine(config(stage, dtype, world, offload), seed=seed, frozen=True, tie=True, dim=dim)


def snapshot(engine):
    """Collective: fp32 parameters, optimizer state and the 16-bit model (gathered on stage 3), as CPU tensors."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    snap = {}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        for name, param in params:
            snap[f"model/{name}"] = param.detach().cpu().clone()
    for name, param in params:
        if param.requires_grad:
            snap[f"fp32/{name}"] = safe_get_full_fp32_param(param).cpu()
            for key in STATE_KEYS:
                value = safe_get_full_optimizer_state(param, key)
                snap[f"{key}/{name}"] = None if value is None else value.cpu()
    snap["counters"] = (engine.global_steps, engine.skipped_steps)
    return snap


def save_worker(tmp, stage, dtype, offload=False):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = build(stage, dtype, world, seed=0, offload=offload)
    batch = reshard.shard_fn(rank, world)
    common.train(engine, 3, 0, rank, batch_fn=batch)
    assert engine.save_checkpoint(tmp) is True
    at_save = snapshot(engine)
    common.train(engine, 3, 3, rank, batch_fn=batch)
    final = snapshot(engine)
    engine.destroy()
    return at_save, final


def reference_params(steps):
    """Plain torch: AdamW over the trainable parameters on the global batch, gradient clipping at 1.0."""
    from tests.unit.contract.models import lm_loss
    model = common.build_model(0, frozen=True, tie=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=common.LR, weight_decay=0.01, foreach=False)
    for step in range(steps):
        tokens, targets = reshard.global_batch(step)
        opt.zero_grad()
        lm_loss(model(tokens), targets).backward()
        for p in params:
            if p.grad is None:  # an unused parameter: the engine steps it with a zero gradient
                p.grad = torch.zeros_like(p)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        coef = min(1.0, 1.0 / (float(norm) + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def load_worker(tmp, stage, dtype, at_save, final, offload=False):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = build(stage, dtype, world, seed=1, offload=offload)
    path, _ = engine.load_checkpoint(tmp)
    assert path is not None
    bad = common.differences(at_save, snapshot(engine))
    assert not bad, f"rank {rank}: the state right after the load differs from the saved one: {bad}"
    common.train(engine, 3, 3, rank, batch_fn=reshard.shard_fn(rank, world))
    after = snapshot(engine)
    engine.destroy()
    reshard.check_continuation(after, final, reference_params(6) if dtype == "fp32" else None, dtype, rank,
                               "the run that never stopped")
    return True


WORLDS = [(1, 2), (2, 1), (2, 3)]
CELLS = [(s, t, w, v, d)
         for (s, t), (w, v), d in itertools.product(itertools.product(range(4), range(4)), WORLDS, ["fp32", "bf16"])]


@pytest.mark.parametrize("save_stage,load_stage,save_world,load_world,dtype",
                         CELLS,
                         ids=[f"z{s}w{w}-to-z{t}w{v}-{d}" for s, t, w, v, d in CELLS])
def test_cross_stage_load(tmp_path, save_stage, load_stage, save_world, load_world, dtype):
    tmp = str(tmp_path)
    at_save, final = run_distributed(save_worker, save_world, args=(tmp, save_stage, dtype), timeout=120)[0]
    results = run_distributed(load_worker, load_world, args=(tmp, load_stage, dtype, at_save, final), timeout=120)
    assert results == [True] * load_world


OFFLOAD_CELLS = [(1, 3, 2, 2, "bf16", False, True), (3, 0, 2, 1, "bf16", True, False),
                 (3, 3, 2, 3, "fp32", True, True)]


@pytest.mark.parametrize("save_stage,load_stage,save_world,load_world,dtype,save_offload,load_offload",
                         OFFLOAD_CELLS,
                         ids=[
                             f"z{c[0]}w{c[2]}{'off' if c[5] else ''}-to-z{c[1]}w{c[3]}{'off' if c[6] else ''}-{c[4]}"
                             for c in OFFLOAD_CELLS
                         ])
def test_cross_stage_load_stage3_offload(tmp_path, save_stage, load_stage, save_world, load_world, dtype, save_offload,
                                         load_offload):
    """Stage 3 with optimizer and parameter offload keeps 16-bit shards beside the masters: both are restored."""
    tmp = str(tmp_path)
    at_save, final = run_distributed(save_worker, save_world, args=(tmp, save_stage, dtype, save_offload),
                                     timeout=120)[0]
    results = run_distributed(load_worker,
                              load_world,
                              args=(tmp, load_stage, dtype, at_save, final, load_offload),
                              timeout=120)
    assert results == [True] * load_world


def other_model_worker(tmp, save_stage, load_stage):
    import os
    import deepspeed.comm as dist
    from deepspeed.runtime.checkpoint import CheckpointError
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    saver = build(save_stage, "fp32", world, seed=0)
    common.train(saver, 1, 0, rank, batch_fn=reshard.shard_fn(rank, world))
    saver.save_checkpoint(tmp)
    saver.destroy()
    other = build(load_stage, "fp32", world, seed=0, dim=12)
    with pytest.raises(CheckpointError) as info:
        other.load_checkpoint(tmp)
    message = str(info.value)
    for needle in ("emb.weight", "(16, 8)", "(16, 12)"):
        assert needle in message, f"rank {rank}: {needle!r} not in {message}"
    # the ranks are still in step: the engine saves and loads its own checkpoint
    fresh = os.path.join(tmp, "after")
    other.save_checkpoint(fresh)
    assert other.load_checkpoint(fresh)[0] is not None
    other.destroy()
    return True


@pytest.mark.parametrize("save_stage,load_stage", [(1, 3), (3, 0)])
def test_other_model_raises_on_every_rank(tmp_path, save_stage, load_stage):
    assert run_distributed(other_model_worker, 2, args=(str(tmp_path), save_stage, load_stage),
                           timeout=60) == [True] * 2
