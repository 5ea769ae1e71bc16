# SPDX-License-Identifier: Apache-2.0
"""Behaviour upstream's tests (tests/unit/v1/zero/test_zero_user_backward.py) and frameworks rely on.

``needs_scaler()`` and the loss-scaler attributes; ``engine.scale`` of a non-scalar (AssertionError
matching "scalar tensor"); the fp16 direct-backward error ("Loss scaling is required", a RuntimeError);
a client optimizer beside a config ``optimizer`` section (the client one is used); ``global_samples``
with unmanaged accumulation (the micro-batches run, not ``train_batch_size``);
``set_gradient_accumulation_boundary`` with unmanaged accumulation (AssertionError, and RuntimeError
as before); fp16 on the CPU whatever ``is_fp16_supported()`` answers.
"""

import logging

import pytest
import torch

from tests.unit.common import run_distributed


def _config(stage, dtype="fp32", gas=1, managed=True, optimizer=True):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "zero_optimization": {
            "stage": stage
        },
    }
    if optimizer:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _model():
    from tests.unit.contract.models import ToyNet
    torch.manual_seed(0)
    return ToyNet()


def scaling_surface(stage):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from tests.unit.contract.models import lm_loss, make_batch
    rank = dist.get_rank()
    tokens, targets = make_batch(rank, 0)
    seen = {}
    for dtype in ("fp16", "bf16", "fp32"):
        engine, optimizer, _, _ = deepspeed.initialize(model=_model(), config=_config(stage, dtype))
        try:
            assert isinstance(optimizer, ZeROOptimizer)
            seen[dtype] = optimizer.needs_scaler()
            assert optimizer.dynamic_loss_scale == (dtype == "fp16")
            assert optimizer.custom_loss_scaler is False and optimizer.torch_autocast_gradscaler is None
            assert optimizer.cur_scale == optimizer.loss_scale == optimizer.loss_scaler.cur_scale
            assert optimizer.loss_scaler.loss_scale == (2.0**8 if dtype == "fp16" else 1.0)
            loss = lm_loss(engine(tokens), targets)
            assert torch.equal(optimizer.loss_scaler.scale_loss(loss), loss * optimizer.loss_scale)
            # engine.scale of a non-scalar: upstream's tests expect AssertionError matching "scalar tensor"
            with pytest.raises(AssertionError, match="scalar tensor"):
                engine.scale(engine(tokens))
            with pytest.raises(ValueError, match="scalar tensor"):
                engine.backward(engine(tokens).float())
            if dtype == "fp16":
                with pytest.raises(RuntimeError, match="Loss scaling is required"):
                    loss.backward()
                engine.zero_grad()
            else:
                loss.backward()  # no scaling needed
                engine.zero_grad()
            scaled = engine.scale(lm_loss(engine(tokens), targets))
            assert scaled.requires_grad
            scaled.backward()
            engine.step()
            assert engine.was_step_applied()
        finally:
            engine.destroy()
    return seen


@pytest.mark.parametrize("stage", [1, 3])
def test_needs_scaler_and_scale_checks(stage):
    for seen in run_distributed(scaling_surface, 2, args=(stage, ), timeout=90):
        assert seen == {"fp16": True, "bf16": False, "fp32": False}


def client_and_config_optimizer():
    import deepspeed
    from deepspeed.utils.logging import logger
    from tests.unit.contract.models import lm_loss, make_batch
    model = _model()
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_config(1))
    finally:
        logger.removeHandler(handler)
    try:
        assert optimizer.optimizer is client, "the client optimizer must be the one that steps"
        assert optimizer.param_groups[0]["lr"] == 0.5
        tokens, targets = make_batch(0, 0)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        assert engine.was_step_applied()
        return [r.getMessage() for r in records if r.levelno == logging.WARNING]
    finally:
        engine.destroy()


def test_client_optimizer_wins_over_config_section():
    warnings = run_distributed(client_and_config_optimizer, 2, timeout=60)
    assert any("client optimizer is used" in m for m in warnings[0]), warnings[0]


def unmanaged_counters(stage):
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import lm_loss, make_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=_config(stage, gas=4, managed=False))
    try:
        with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(True)
        with pytest.raises(RuntimeError, match="set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(False)
        expected = 0
        t = 0
        for backward_calls in (2, 5, 3):  # micro-batches per step: neither GAS nor constant
            for _ in range(backward_calls):
                tokens, targets = make_batch(rank, t)
                t += 1
                loss = lm_loss(engine(tokens), targets)
                if t % 2:
                    engine.backward(loss / backward_calls, scale_wrt_gas=False)
                else:
                    engine.scale(loss / backward_calls).backward()
            engine.step()
            assert engine.was_step_applied()
            expected += backward_calls * engine.train_micro_batch_size_per_gpu() * world
            assert engine.global_samples == expected, (engine.global_samples, expected)
        assert engine.global_steps == 3
    finally:
        engine.destroy()
    return True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unmanaged_global_samples_and_boundary_error(stage):
    assert run_distributed(unmanaged_counters, 2, args=(stage, ), timeout=60) == [True, True]


def managed_global_samples():
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import lm_loss, make_batch
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=_config(1, gas=2))
    try:
        for t in range(4):
            tokens, targets = make_batch(dist.get_rank(), t)
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()
        assert engine.global_steps == 2 and engine.global_samples == 2 * engine.train_batch_size()
    finally:
        engine.destroy()
    return True


def test_managed_global_samples_count_whole_batches():
    assert run_distributed(managed_global_samples, 2, timeout=60) == [True, True]


def fp16_on_cpu_whatever_the_accelerator_says():
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from tests.unit.contract.models import lm_loss, make_batch
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return True
    original = type(accelerator).is_fp16_supported
    type(accelerator).is_fp16_supported = lambda self: False
    try:
        engine, _, _, _ = deepspeed.initialize(model=_model(), config=_config(1, "fp16"))
        tokens, targets = make_batch(0, 0)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        assert engine.was_step_applied() and next(engine.module.parameters()).dtype == torch.float16
        engine.destroy()
    finally:
        type(accelerator).is_fp16_supported = original
    return True


def test_fp16_trains_on_cpu_as_an_extension():
    assert run_distributed(fp16_on_cpu_whatever_the_accelerator_says, 1, timeout=60) == [True]
