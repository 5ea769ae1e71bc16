# SPDX-License-Identifier: Apache-2.0
"""fp16: the dynamic loss-scale rules, and an overflow on one rank skipping the step on every rank."""

import pytest
import torch

from deepspeed.runtime.precision.loss_scaler import DynamicLossScaler, LossScaler, create_loss_scaler
from tests.unit.common import run_distributed


def _expected_scales(init, window, hysteresis, min_scale, overflows, consecutive=False):
    """The documented rule, step by step: halve once the hysteresis budget is spent; double after
    ``window`` good steps since the last overflow (refilling the budget)."""
    scale, budget, last_overflow, out = init, hysteresis, -1, []
    for it, overflow in enumerate(overflows):
        if overflow:
            if budget <= 1:
                scale = max(scale / 2, min_scale)
            else:
                budget -= 1
            last_overflow = it
        else:
            if consecutive:
                budget = hysteresis
            if (it - last_overflow) % window == 0:
                budget = hysteresis
                scale *= 2
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("pattern", [
    [False] * 6,
    [False, True, True, False, False, False, True, False],
    [True] * 8,
    [True, False, True, False, True, False, False, False, False],
])
def test_dynamic_scaler_follows_the_rules(hysteresis, consecutive, pattern):
    scaler = DynamicLossScaler(init_scale=16.0,
                               scale_window=2,
                               min_scale=2.0,
                               delayed_shift=hysteresis,
                               consecutive_hysteresis=consecutive)
    got = []
    for overflow in pattern:
        scaler.update_scale(overflow)
        got.append(scaler.loss_scale)
    assert got == _expected_scales(16.0, 2, hysteresis, 2.0, pattern, consecutive)


def test_static_and_disabled_scalers():
    assert isinstance(create_loss_scaler(False, 0, None), LossScaler)
    static = create_loss_scaler(True, 128.0, None)
    static.update_scale(True)
    assert static.loss_scale == 128.0 and not static.dynamic
    dynamic = create_loss_scaler(True, 0, {
        "init_scale": 2.0**10,
        "scale_window": 5,
        "min_scale": 1.0,
        "delayed_shift": 1,
        "consecutive_hysteresis": False
    })
    assert dynamic.dynamic and dynamic.loss_scale == 2.0**10


def overflow_on_one_rank(stage):
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.01,
                "warmup_max_lr": 0.1,
                "warmup_num_steps": 4,
                "warmup_type": "linear"
            }
        },
        "fp16": {
            "enabled": True,
            "initial_scale_power": 8,
            "hysteresis": 1
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    engine, _, _, scheduler = deepspeed.initialize(model=ToyNet(), config=cfg)
    try:
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        lr_before = engine.get_lr()
        tokens, targets = make_batch(rank, 0)
        loss = lm_loss(engine(tokens), targets)
        if rank == 1:
            loss = loss * float("inf")  # only rank 1 overflows
        engine.backward(loss)
        engine.step()
        assert not engine.was_step_applied()
        assert engine.skipped_steps == 1
        assert engine.get_loss_scale() == 2.0**7
        assert engine.get_lr() == lr_before, "the LR schedule must not advance on a skipped step"
        for n, p in engine.module.named_parameters():
            assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
        # the next, finite step applies
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        assert engine.was_step_applied()
        assert any(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    finally:
        engine.destroy()
    return True


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_everywhere(stage):
    assert run_distributed(overflow_on_one_rank, 2, args=(stage, ), timeout=60) == [True, True]


def parameter_owned_twice():
    import deepspeed
    from tests.unit.contract.models import ToyNet
    torch.manual_seed(0)
    model = ToyNet()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    first = deepspeed.initialize(model=model, config=cfg)[0]
    try:
        with pytest.raises(ValueError, match="already owned"):
            deepspeed.initialize(model=model, config=cfg)
    finally:
        first.destroy()
    second = deepspeed.initialize(model=model, config=cfg)[0]  # free again after destroy()
    second.destroy()
    return True


def test_a_parameter_has_one_owner():
    assert run_distributed(parameter_owned_twice, 1, timeout=60) == [True]
