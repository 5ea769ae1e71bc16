# SPDX-License-Identifier: Apache-2.0
"""Requests the contract cannot honour exactly raise a clear error on every rank, then training goes on.

Each case: the bad backward raises ``BackwardContractError`` on every rank (nothing
hangs: the harness timeout bounds the test); then ``zero_grad()`` and one ordinary
step whose gradients and parameters match the plain-torch reference.
"""

import math

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.contract.models import Head, ToyNet, lm_loss, make_batch
from tests.unit.contract.runner import GRAD_TOL, LOSS_SCALE_POWER, PARAM_TOL, Reference, make_config
from tests.unit.contract.shapes import SHAPES


def _engines(stage, dtype, gas_list, scale_powers=None):
    import deepspeed
    torch.manual_seed(0)
    models = [ToyNet(), Head()][:len(gas_list)]
    engines = []
    for i, (model, gas) in enumerate(zip(models, gas_list)):
        cfg = make_config(dict(stage=stage, dtype=dtype, zero_extra=STAGE3_SMALL_UNITS), gas, SHAPES["plain"])
        if scale_powers is not None:
            cfg["fp16"]["initial_scale_power"] = scale_powers[i]
        engines.append(deepspeed.initialize(model=model, config=cfg)[0])
    return models, engines


def _bad_two_loss_scales(engines, tokens, targets):
    hidden = engines[0](tokens, hidden=True)
    first = lm_loss(engines[1](hidden), targets)
    second = hidden.float().pow(2).mean()
    (engines[0].scale(second) + engines[1].scale(first)).backward()


def _bad_no_gas_scaling_across_gas(engines, tokens, targets):
    hidden = engines[0](tokens, hidden=True)
    engines[0].backward(lm_loss(engines[1](hidden), targets), scale_wrt_gas=False)


def _bad_fp16_direct(engines, tokens, targets):
    lm_loss(engines[0](tokens), targets).backward()


# ZeRO-3 with every parameter gathered and released by units (none persistent)
STAGE3_SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}

CASES = {
    "two_loss_scales": ("fp16", [1, 1], [8, 6], _bad_two_loss_scales, "two loss scales"),
    "no_gas_scaling_different_gas": ("fp32", [1, 2], None, _bad_no_gas_scaling_across_gas, "different"),
    "fp16_direct_backward": ("fp16", [1], None, _bad_fp16_direct, "engine.scale"),
}


def error_then_train(case, stage):
    import deepspeed.comm as dist
    from deepspeed.runtime.backward import BackwardContractError
    from deepspeed.runtime.backward.registry import open_sessions
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    dtype, gas_list, powers, bad, needle = CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    models, engines = _engines(stage, dtype, gas_list, powers)
    try:
        tokens, targets = make_batch(rank, 0)
        with pytest.raises(BackwardContractError, match=needle):
            bad(engines, tokens, targets)
        assert not open_sessions(), "a failed backward left a session open"
        for engine in engines:
            engine.zero_grad()
        # An ordinary step of engine 0 afterwards matches the reference.
        engine = engines[0]
        gas = gas_list[0]
        scale = float(2**(powers[0] if powers else LOSS_SCALE_POWER)) if dtype == "fp16" else 1.0
        # a plain model of the same shape; its values are copied from the engine below
        ref = Reference([ToyNet()], {"fp32": torch.float32, "fp16": torch.float16}[dtype], [gas], world, scale)
        # the reference starts from the engine's current parameters
        with torch.no_grad():
            for name, param in engine.module.named_parameters():
                ref.masters[0][name].copy_(safe_get_full_fp32_param(param))
                dict(ref.models[0].named_parameters())[name].copy_(safe_get_full_fp32_param(param))
        for t in range(1, gas + 1):
            tokens, targets = make_batch(rank, t)
            engine.backward(lm_loss(engine(tokens), targets))
            ref.micro_step(SHAPES["plain"], t)
            if t == gas:
                for name, param in engine.module.named_parameters():
                    torch.testing.assert_close(safe_get_full_grad(param), ref.accum[0][name], **GRAD_TOL[dtype])
            engine.step()
        ref.step(0)
        for name, param in engine.module.named_parameters():
            torch.testing.assert_close(safe_get_full_fp32_param(param), ref.masters[0][name].detach(),
                                       **PARAM_TOL[dtype])
        assert math.isfinite(engine.get_global_grad_norm())
    finally:
        for engine in engines:
            engine.destroy()
    return True


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_error_raises_on_every_rank_then_trains(case, world, stage):
    assert run_distributed(error_then_train, world, args=(case, stage), timeout=60) == [True] * world
