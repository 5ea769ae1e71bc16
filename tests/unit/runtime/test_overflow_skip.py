# SPDX-License-Identifier: Apache-2.0
"""bf16 and fp32: a NaN loss on one rank skips the step on every rank; training then goes on as if the
bad accumulation window had not happened.

The run: ToyNet, SGD with momentum and clipping (the contract's reference maths), GAS 2, a constant
WarmupLR schedule, 4 accumulation windows; in window 1 the loss of rank 1's first micro-batch is
multiplied by NaN. Checked on both ranks: at the skipped boundary the fp32 parameters and the momentum
buffers are bitwise unchanged, the schedule did not advance, ``was_step_applied()`` is False,
``skipped_steps`` is 1 and ``global_steps`` advanced (upstream counts skipped steps), and rank 0 logged
a warning naming the step; after every applied boundary the parameters equal a plain-torch reference
trained on the same data without window 1.
"""

import logging

import pytest
import torch

from tests.unit.common import run_distributed

GAS = 2
WINDOWS = 4
BAD_WINDOW = 1
STAGE3_SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}


def _config(stage, dtype, check):
    from tests.unit.contract.runner import LR, make_config
    from tests.unit.contract.shapes import SHAPES
    cell = dict(stage=stage, dtype=dtype, zero_extra=STAGE3_SMALL_UNITS if stage == 3 else {})
    cfg = make_config(cell, GAS, SHAPES["plain"])
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": LR,
            "warmup_max_lr": LR,
            "warmup_num_steps": 1
        }
    }
    if dtype == "bf16" and check is not None:
        cfg["bf16"]["check_grad_overflow"] = check
    return cfg


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _snapshot(engine):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    moments = {n: safe_get_full_optimizer_state(p, "momentum_buffer") for n, p in engine.module.named_parameters()}
    return params, {n: (None if m is None else m.clone()) for n, m in moments.items()}


def nan_on_one_rank(stage, dtype, fp32_check_attribute):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed.utils.logging import logger
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    from tests.unit.contract.runner import DTYPES, PARAM_TOL, Reference
    from tests.unit.contract.shapes import SHAPES

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ToyNet()
    ref = Reference([model], DTYPES[dtype], [GAS], world, 1.0)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=_config(stage, dtype, None))
    records = _Records()
    logger.addHandler(records)
    try:
        assert optimizer.check_grad_overflow == (dtype == "bf16"), "bf16 checks by default, fp32 does not"
        if fp32_check_attribute:
            optimizer.check_grad_overflow = True  # upstream's way to turn the check on for fp32
        for window in range(WINDOWS):
            before = _snapshot(engine)
            iterations_before = scheduler.last_batch_iteration
            for micro in range(GAS):
                t = window * GAS + micro
                tokens, targets = make_batch(rank, t)
                loss = lm_loss(engine(tokens), targets)
                if window == BAD_WINDOW and micro == 0 and rank == 1:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                if window != BAD_WINDOW:
                    ref.micro_step(SHAPES["plain"], t)
            assert engine.global_steps == window + 1, "skipped steps still count as global steps"
            if window == BAD_WINDOW:
                assert not engine.was_step_applied()
                assert engine.skipped_steps == 1
                assert scheduler.last_batch_iteration == iterations_before, "the LR schedule advanced"
                params, moments = _snapshot(engine)
                for name, value in params.items():
                    assert torch.equal(value, before[0][name]), f"{name} changed on a skipped step"
                    if before[1][name] is not None:
                        assert torch.equal(moments[name], before[1][name]), f"momentum of {name} changed"
                continue
            assert engine.was_step_applied(), f"window {window} was skipped"
            ref.step(0)
            for name, param in engine.module.named_parameters():
                torch.testing.assert_close(safe_get_full_fp32_param(param).float(),
                                           ref.masters[0][name].detach(),
                                           **PARAM_TOL[dtype],
                                           msg=lambda m: f"rank {rank} window {window} {name}: {m}")
        warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
        if rank == 0:
            assert any(f"step {BAD_WINDOW + 1}:" in m and "skipped" in m for m in warnings), warnings
    finally:
        logger.removeHandler(records)
        engine.destroy()
    return True


CASES = [(stage, "bf16", False) for stage in (0, 1, 2, 3)] + [(stage, "fp32", True) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("stage,dtype,fp32_check_attribute", CASES)
def test_nan_on_one_rank_skips_the_step_everywhere(stage, dtype, fp32_check_attribute):
    assert run_distributed(nan_on_one_rank, 2, args=(stage, dtype, fp32_check_attribute), timeout=90) == [True, True]


def nan_without_check(stage, dtype):
    """With the check off (bf16 ``check_grad_overflow: false``, fp32 by default) the NaN reaches the weights."""
    import deepspeed
    import deepspeed.comm as dist
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, optimizer, _, _ = deepspeed.initialize(model=ToyNet(), config=_config(stage, dtype, False))
    try:
        assert not optimizer.check_grad_overflow
        for t in range(GAS):
            tokens, targets = make_batch(rank, t)
            loss = lm_loss(engine(tokens), targets)
            engine.backward(loss * float("nan") if rank == 1 else loss)
            engine.step()
        assert engine.was_step_applied() and engine.skipped_steps == 0
        return all(torch.isnan(p.float()).any().item() for p in engine.module.parameters() if p.numel())
    finally:
        engine.destroy()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_without_the_check_the_step_is_applied(dtype):
    assert run_distributed(nan_without_check, 2, args=(1, dtype), timeout=60) == [True, True]


def test_bf16_check_grad_overflow_defaults_to_true():
    from deepspeed.runtime.config import DeepSpeedConfig
    base = {"train_micro_batch_size_per_gpu": 1}
    assert DeepSpeedConfig(dict(base, bf16={"enabled": True}), world_size=1).check_grad_overflow
    assert not DeepSpeedConfig(dict(base, bf16={
        "enabled": True,
        "check_grad_overflow": False
    }), world_size=1).check_grad_overflow
    assert DeepSpeedConfig(dict(base, fp16={"enabled": True}), world_size=1).check_grad_overflow
    assert not DeepSpeedConfig(base, world_size=1).check_grad_overflow
