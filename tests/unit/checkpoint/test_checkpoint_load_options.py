# SPDX-License-Identifier: Apache-2.0
"""What each ``load_checkpoint`` option restores, engines without an optimizer, and ``save_16bit_model``.

* ``load_module_only=True``: the module only; fp32 masters are refreshed from it, the
  optimizer state, schedule and counters stay those of the fresh engine;
* ``load_optimizer_states=False``: the module and the exact fp32 masters, counters and
  (unless also turned off) the LR schedule; no inner optimizer state;
* a checkpoint of an engine without an optimizer loads with ``load_optimizer_states=False``
  and is refused, with a clear message, otherwise;
* ``save_16bit_model`` writes the module's state dict in the model's dtype (rank 0); on
  ZeRO stage 3 it gathers the parameters (only with ``stage3_gather_16bit_weights_on_model_save``);
  a stage-3 checkpoint loads into a stage-2 engine (every stage pair: test_checkpoint_cross_stage.py).
"""

import os

import pytest
import torch

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed


def _fp32(engine):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).cpu() for n, p in engine.module.named_parameters() if p.requires_grad}


def _state(engine, key):
    from deepspeed.utils import safe_get_full_optimizer_state
    return [safe_get_full_optimizer_state(p, key) for p in engine.module.parameters() if p.requires_grad]


def load_options_worker(tmp, stage, dtype):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.checkpoint import CheckpointError
    common.attach_checkpointing()
    rank = dist.get_rank()
    cfg = common.make_config(stage, dtype)
    trained = common.build_engine(cfg, seed=0, frozen=True)
    common.train(trained, 3, 0, rank)
    trained.save_checkpoint(tmp)
    fp32 = _fp32(trained)
    model = {n: p.detach().clone() for n, p in trained.module.named_parameters()}
    schedule = trained.lr_scheduler.state_dict()
    trained.destroy()

    def fresh():
        engine = common.build_engine(cfg, seed=1, frozen=True)
        return engine, engine.lr_scheduler.state_dict()

    # load_module_only: module only, masters refreshed from it.
    engine, initial_schedule = fresh()
    engine.load_checkpoint(tmp, load_module_only=True)
    for name, param in engine.module.named_parameters():
        assert torch.equal(param.detach(), model[name]), name
    for name, value in _fp32(engine).items():
        assert torch.equal(value, model[name].float()), name
    assert all(state is None for state in _state(engine, "exp_avg"))
    assert engine.global_steps == 0 and engine.lr_scheduler.state_dict() == initial_schedule
    common.train(engine, 1, 3, rank)  # and it trains
    engine.destroy()

    # load_optimizer_states=False: exact masters and counters, no inner state, schedule as asked.
    for load_schedule in (False, True):
        engine, initial_schedule = fresh()
        engine.load_checkpoint(tmp, load_optimizer_states=False, load_lr_scheduler_states=load_schedule)
        assert common.differences(fp32, _fp32(engine)) == []
        assert all(state is None for state in _state(engine, "exp_avg"))
        assert engine.global_steps == 3
        assert engine.lr_scheduler.state_dict() == (schedule if load_schedule else initial_schedule)
        engine.destroy()

    # An engine without an optimizer saves and loads the module; a training engine loads that only without
    # optimizer state.
    torch.manual_seed(1)
    eval_model = common.build_model(2, frozen=True)
    evaluator = deepspeed.initialize(model=eval_model, config={"train_micro_batch_size_per_gpu": 2})[0]
    path, _ = evaluator.load_checkpoint(tmp)
    assert path is not None
    assert evaluator.global_steps == 3
    for name, param in evaluator.module.named_parameters():  # an fp32 model: the bf16 values, widened
        assert torch.equal(param.detach(), model[name].float()), name
    eval_dir = os.path.join(tmp, "eval")
    evaluator.save_checkpoint(eval_dir)
    assert sorted(os.listdir(os.path.join(eval_dir, "global_step3"))) == [".ds_complete", "mp_rank_00_model_states.pt"]
    engine, _ = fresh()
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        engine.load_checkpoint(eval_dir)
    engine.load_checkpoint(eval_dir, load_optimizer_states=False)
    for name, value in _fp32(engine).items():  # masters from the loaded (rounded to bf16) module
        assert torch.equal(value, model[name].float()), name
    engine.destroy()
    evaluator.destroy()
    return True


@pytest.mark.parametrize("stage", [0, 2])
def test_load_options(tmp_path, stage):
    assert run_distributed(load_options_worker, 2, args=(str(tmp_path), stage, "bf16"), timeout=60) == [True] * 2


def save_16bit_worker(tmp):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    engine = common.build_engine(common.make_config(2, "bf16"), seed=0, frozen=True)
    common.train(engine, 1, 0, dist.get_rank())
    with pytest.raises(ValueError, match="None"):
        engine.save_16bit_model(None)
    assert engine.save_16bit_model(tmp) is True
    assert engine.save_16bit_model(tmp, "trainable.bin", exclude_frozen_parameters=True) is True
    state = {name: t.detach().clone() for name, t in engine.module.state_dict().items()}
    engine.destroy()
    return state


def test_save_16bit_model(tmp_path):
    state = run_distributed(save_16bit_worker, 2, args=(str(tmp_path), ), timeout=60)[0]
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert list(saved) == list(state)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, state[name]), name
    trainable = torch.load(tmp_path / "trainable.bin")
    assert list(trainable) == [name for name in state if name != "block2.bias"]


def stage3_worker(tmp, gather):
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    common.attach_checkpointing()
    cfg = common.make_config(3, "bf16")
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    engine = common.build_engine(cfg, seed=0, frozen=True)
    common.train(engine, 1, 0, dist.get_rank())
    assert engine.save_checkpoint(os.path.join(tmp, "ckpt")) is True
    written = engine.save_16bit_model(tmp)
    fp32 = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters() if p.requires_grad}
    expected = {name: value.to(torch.bfloat16) for name, value in fp32.items()}
    engine.destroy()
    other = common.build_engine(common.make_config(2, "bf16"), seed=1, frozen=True)
    path, _ = other.load_checkpoint(os.path.join(tmp, "ckpt"))  # a stage-3 checkpoint loads into stage 2
    assert path is not None
    for name, param in other.module.named_parameters():
        if param.requires_grad:
            assert torch.equal(safe_get_full_fp32_param(param).cpu(), fp32[name]), name
    other.destroy()
    return written, expected


@pytest.mark.parametrize("gather", [True, False])
def test_stage3_16bit_model_and_cross_stage_load(tmp_path, gather):
    results = run_distributed(stage3_worker, 2, args=(str(tmp_path), gather), timeout=60)
    assert [written for written, _ in results] == [gather] * 2
    path = tmp_path / "pytorch_model.bin"
    assert path.exists() == gather
    if gather:
        saved = torch.load(path)
        for name, value in results[0][1].items():  # the 16-bit parameters are the masters, rounded
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value), name
        assert "block2.bias" in saved
