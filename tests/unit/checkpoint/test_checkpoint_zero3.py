# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of ZeRO stage 3: exact resume, resharding to other world sizes, zero_to_fp32.

* resume: 3 steps + save + load into a fresh engine (other initial weights) + 3 steps
  equals 6 uninterrupted steps bitwise (fp32 masters, ``exp_avg``, ``exp_avg_sq``,
  ``step``, learning rates, scheduler, loss scaler, counters), for fp32, bf16 and fp16
  (dynamic loss scale with a skipped step), GAS 1 and 2, AdamW + WarmupLR, with a
  frozen and a tied parameter; small units without persistent parameters, and once
  with the default persistence threshold.
* reshard: saved on 2 ranks, loaded on 1 and 3: right after the load every fp32 value
  and optimizer state equals the saved one bitwise; after 3 more steps fp32 matches the
  never-resharded run and a plain-torch AdamW reference (tight tolerance).
* zero_to_fp32 of a stage-3 checkpoint equals ``safe_get_full_fp32_param`` of every
  trainable parameter at the save (frozen ones: their gathered 16-bit value).
"""

import os

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.checkpoint import test_checkpoint_reshard as reshard
from tests.unit.common import run_distributed

SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}


def zero3_config(dtype, gas=1, micro=2, small_units=True, scheduler=True):
    cfg = common.make_config(3, dtype, gas, micro=micro, scheduler=scheduler)
    if small_units:
        cfg["zero_optimization"].update(SMALL_UNITS)
    return cfg


def resume_worker(tmp, dtype, gas, small_units):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank = dist.get_rank()
    cfg = zero3_config(dtype, gas, small_units=small_units)
    inf_step = 1 if dtype == "fp16" else None
    model = dict(frozen=True, tie=True)

    straight = common.build_engine(cfg, seed=0, **model)
    common.train(straight, 6, 0, rank, inf_step)
    expected = common.snapshot(straight)
    straight.destroy()

    first = common.build_engine(cfg, seed=0, **model)
    common.train(first, 3, 0, rank, inf_step)
    if dtype == "fp16":
        assert first.skipped_steps == 1
    assert first.save_checkpoint(tmp, client_state={"epoch": 3}) is True
    first.destroy()

    resumed = common.build_engine(cfg, seed=1, **model)
    path, client_state = resumed.load_checkpoint(tmp)
    assert path == os.path.join(tmp, "global_step3", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"), path
    assert client_state["epoch"] == 3, client_state
    assert common.same_content(client_state, common.upstream_client_state(path, 3)), sorted(client_state)
    common.train(resumed, 3, 3, rank, inf_step)
    actual = common.snapshot(resumed)
    resumed.destroy()
    bad = common.differences(expected, actual)
    assert not bad, f"rank {rank}: resumed run differs from the uninterrupted one: {bad}"
    if dtype == "fp16":
        assert actual["loss_scaler"]["cur_scale"] == 2.0**(common.LOSS_SCALE_POWER + 1), actual["loss_scaler"]
    return sorted(n for n in os.listdir(os.path.join(tmp, "global_step3")) if not n.startswith("."))


RESUME_CELLS = [("fp32", 1, True), ("fp32", 2, True), ("bf16", 2, True), ("fp16", 1, True), ("bf16", 1, False)]


@pytest.mark.parametrize("dtype,gas,small_units",
                         RESUME_CELLS,
                         ids=[f"{d}-gas{g}-{'units' if s else 'persist'}" for d, g, s in RESUME_CELLS])
def test_zero3_resume_is_exact(tmp_path, dtype, gas, small_units):
    files = run_distributed(resume_worker, 2, args=(str(tmp_path), dtype, gas, small_units), timeout=120)
    prefix = "bf16_" if dtype == "bf16" else ""
    expected = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]
    expected += [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    assert files[0] == sorted(expected)
    assert (tmp_path / "latest").read_text() == "global_step3"


def reshard_config(dtype, world):
    return zero3_config(dtype, micro=reshard.GLOBAL_BATCH // world, scheduler=False)


def save_worker(tmp, dtype):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = common.build_engine(reshard_config(dtype, world), seed=0)
    batch = reshard.shard_fn(rank, world)
    common.train(engine, 3, 0, rank, batch_fn=batch)
    engine.save_checkpoint(tmp)
    at_save = common.snapshot(engine)
    common.train(engine, 3, 3, rank, batch_fn=batch)
    final = common.snapshot(engine)
    engine.destroy()
    return at_save, final


def _fp32_and_state(snap):
    return {k: v for k, v in snap.items() if k.split("/")[0] in ("fp32", "exp_avg", "exp_avg_sq", "step")}


def load_worker(tmp, dtype, at_save, final):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = common.build_engine(reshard_config(dtype, world), seed=1)
    path, _ = engine.load_checkpoint(tmp)
    assert path is not None
    bad = common.differences(_fp32_and_state(at_save), _fp32_and_state(common.snapshot(engine)))
    assert not bad, f"rank {rank}: state right after the resharded load differs from the saved state: {bad}"
    common.train(engine, 3, 3, rank, batch_fn=reshard.shard_fn(rank, world))
    after = common.snapshot(engine)
    engine.destroy()
    expected = reshard.reference_params(6) if dtype == "fp32" else None
    tol = reshard.FP32_TOL if dtype == "fp32" else reshard.BF16_TOL
    for name in (n for n in after if n.startswith("fp32/")):
        torch.testing.assert_close(after[name], final[name], **tol)
        if expected is not None:
            torch.testing.assert_close(after[name], expected[name[len("fp32/"):]], **reshard.FP32_TOL)
    return True


@pytest.mark.parametrize("load_world,dtype", [(1, "fp32"), (3, "fp32"), (3, "bf16")])
def test_zero3_reshard(tmp_path, load_world, dtype):
    tmp = str(tmp_path)
    at_save, final = run_distributed(save_worker, 2, args=(tmp, dtype), timeout=120)[0]
    results = run_distributed(load_worker, load_world, args=(tmp, dtype, at_save, final), timeout=120)
    assert results == [True] * load_world


def fp32_worker(tmp):
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    common.attach_checkpointing()
    rank = dist.get_rank()
    engine = common.build_engine(zero3_config("bf16"), seed=0, frozen=True, tie=True)
    common.train(engine, 2, 0, rank)
    engine.save_checkpoint(tmp)
    full = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters() if p.requires_grad}
    consolidated = engine._stage.consolidated_state_dict()  # the frozen parameter's 16-bit value
    frozen = [name for name, p in engine.module.named_parameters() if not p.requires_grad]
    full.update({name: consolidated[name].float() for name in frozen})
    keys = list(engine.module.state_dict().keys())
    engine.destroy()
    return full, keys


def test_zero3_zero_to_fp32(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    full, keys = run_distributed(fp32_worker, 2, args=(str(tmp_path), ), timeout=120)[0]
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert list(state.keys()) == keys
    for name, value in full.items():
        assert torch.equal(state[name].float(), value), name
    tied = [k for k in keys if k not in full and k in state and k.endswith("weight")]
    for name in tied:  # a tied alias shares its parameter's tensor
        assert any(state[name] is state[n] for n in full), name
