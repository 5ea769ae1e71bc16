# SPDX-License-Identifier: Apache-2.0
"""Speculative offloaded steps on ZeRO-3 (``super_offload``) against the exact overlapped step, bit for bit.

The exact overlapped ZeRO-3 step (``super_offload: false``, ``unit_step.py``) is itself tested bit-identical to the
whole-partition step (``test_stage3_overlap.py``). Here the same model is trained with and without speculation, with
and without ``offload_param``, and every loss, 16-bit parameter, fp32 master and Adam moment must be the same bits:
when nothing rolls back (units' pieces stepped in the boundary backward, the rest after the verdict while the next
forward gathers), and when one chosen step clips, overflows or changes its LR (rolled back once, then exact;
training goes on identically). Every piece is slowed (``StepPipeline.piece_delay``) and the first layer's backward
sleeps, so pieces are stepped while the backward still runs and some are left to the verdict. One block runs twice
in the forward (``reuse``): its unit is gathered again in the backward after other units' gradients are final, so
a speculative piece that wrote the host shards it reads (``offload_param``) would change the gradient.
"""

import os
import time

import pytest
import torch

import deepspeed
from deepspeed.ops.adam import host_adam
from tests.unit.common import run_distributed
from tests.unit.zero.speculative_cases import (assert_same, check_read_before_step, optimizer_state, pipelined,
                                               train_steps, with_precision)

pytestmark = pytest.mark.skipif(host_adam.host_adam_op() is None, reason="the host Adam op cannot be built here")


class _Net(torch.nn.Module):

    def __init__(self, width, depth, stall, reuse):
        super().__init__()
        self.stall = stall
        self.reuse = reuse
        self.embed = torch.nn.Linear(7, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        if self.stall and x.requires_grad:  # the first layer's backward waits: the later units are final already
            x.register_hook(lambda grad: time.sleep(self.stall))
        for block in self.blocks:
            x = torch.tanh(block(x))
        if self.reuse:  # the second block again: its unit is re-gathered in the backward
            x = torch.tanh(self.blocks[1](x))
        return self.head(x)


def _config(super_offload, gas, offload_param, dtype, clip, ratio=1.0):
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 12,  # the biases: a persistent unit
        "stage3_prefetch_bucket_size": 60,  # one unit per block
        "offload_optimizer": {
            "device": "cpu",
            "super_offload": super_offload,
            "ratio": ratio
        },
    }
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 3e-2,
                "weight_decay": 0.1
            }
        },
        "zero_optimization": zero,
    }
    return with_precision(config, dtype)


def _train(super_offload,
           *,
           gas=1,
           offload_param=False,
           steps=4,
           dtype="bf16",
           clip=1e6,
           delay=0.0,
           stall=0.0,
           reuse=True,
           clip_at=(),
           inf_at=(),
           lr_change_at=(),
           twice=False,
           groups=False):
    """Train; ``clip_at``: steps whose clipping threshold is far below the norm, ``inf_at``: steps whose boundary
    loss is infinite, ``lr_change_at``: steps whose LR is halved between the boundary backward and ``step()``;
    ``twice``: the boundary micro-step runs a second forward and backward (its gathers read every unit again);
    ``groups``: two param groups (the persistent unit, the biases, has a segment in each)."""
    with pipelined(dtype, delay):
        torch.manual_seed(7)
        model = _Net(9, 3, stall, reuse)
        config = _config(super_offload, gas, offload_param, dtype, clip)
        params = model.parameters()
        if groups:
            second = ("blocks.1.", "head.")
            params = [{
                "params": [p for n, p in model.named_parameters() if not n.startswith(second)]
            }, {
                "params": [p for n, p in model.named_parameters() if n.startswith(second)],
                "weight_decay": 0.0,
                "lr": 1e-2
            }]
        engine = deepspeed.initialize(model=model, model_parameters=params, config=config)[0]
        stage = engine._stage
        assert stage.unit_step is not None
        assert (stage.speculative is not None) == super_offload
        losses = train_steps(engine,
                             dtype,
                             steps,
                             gas,
                             clip,
                             clip_at=clip_at,
                             inf_at=inf_at,
                             lr_change_at=lr_change_at,
                             twice=twice,
                             record_second=True)
        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # completes a step still running
            params = [p.detach().clone() for p in model.parameters()]
        masters, moments = optimizer_state(stage)
        stats = engine.optimizer.speculative_stats
        pieces = len(stage.speculative._pieces) if super_offload else 0
        engine.destroy()
        return losses, params, masters, moments, stats, pieces, engine.skipped_steps


def _nothing_rolls_back(gas, offload_param, dtype, groups=False):
    kwargs = dict(gas=gas, offload_param=offload_param, dtype=dtype, steps=4, groups=groups)
    exact = _train(False, **kwargs)
    spec = _train(True, delay=0.02, stall=0.05, **kwargs)
    assert_same(exact, spec)
    stats, pieces = spec[4], spec[5]
    assert stats["boundary_steps"] == 4 and stats["speculated"] == 4 and stats["kept"] == 4, stats
    assert stats["rolled_back"] == 0 and stats["not_speculated"] == 0, stats
    # pieces were stepped early (during the stalled backward) and pieces were left to the verdict
    assert 0 < stats["pieces_early"] < 4 * pieces, (stats, pieces)
    assert exact[0][0] != exact[0][-1]  # it trained
    return True


@pytest.mark.parametrize("gas,offload_param,dtype", [(1, False, "bf16"), (2, False, "bf16"), (1, True, "bf16"),
                                                     (2, True, "bf16"), (2, True, "fp16"), (2, True, "fp32"),
                                                     (1, False, "fp32")])
def test_nothing_rolls_back_world1(gas, offload_param, dtype):
    assert run_distributed(_nothing_rolls_back, 1, args=(gas, offload_param, dtype), timeout=300) == [True]


@pytest.mark.parametrize("offload_param", [False, True])
def test_nothing_rolls_back_two_groups_world1(offload_param):
    assert run_distributed(_nothing_rolls_back, 1, args=(2, offload_param, "bf16", True), timeout=300) == [True]


@pytest.mark.parametrize("offload_param", [False, True])
def test_nothing_rolls_back_world2(offload_param):
    assert run_distributed(_nothing_rolls_back, 2, args=(2, offload_param, "bf16"), timeout=300) == [True, True]


def _forced_rollbacks(gas, offload_param, dtype, case):
    """Step 1 clips / overflows / changes its LR; the policy then keeps step 2 exact (clip, overflow)."""
    kwargs = dict(gas=gas, offload_param=offload_param, dtype=dtype, steps=5, **{case: (1, )})
    exact = _train(False, **kwargs)
    spec = _train(True, delay=0.005, stall=0.02, **kwargs)
    assert_same(exact, spec)
    stats = spec[4]
    reason = {"clip_at": "clip", "inf_at": "overflow", "lr_change_at": "scalars"}[case]
    assert stats["rolled_back"] == 1 and stats["reasons"][reason] == 1, stats
    assert sum(stats["reasons"].values()) == 1, stats
    assert stats["pieces_rolled_back"] > 0, stats
    policy_skips = 0 if case == "lr_change_at" else 1  # an LR change says nothing about the next step's norm
    assert stats["not_speculated"] == policy_skips, stats
    assert stats["speculated"] == 5 - policy_skips and stats["kept"] == 4 - policy_skips, stats
    assert stats["boundary_steps"] == 5, stats
    if case == "inf_at":
        assert spec[6] == 1  # the step was skipped, in both modes
    return True


@pytest.mark.parametrize("case,dtype,offload_param", [("clip_at", "bf16", False), ("clip_at", "bf16", True),
                                                      ("inf_at", "fp16", True), ("lr_change_at", "bf16", True)])
def test_forced_rollback_world1(case, dtype, offload_param):
    assert run_distributed(_forced_rollbacks, 1, args=(2, offload_param, dtype, case), timeout=300) == [True]


@pytest.mark.parametrize("case,dtype", [("clip_at", "bf16"), ("inf_at", "fp16")])
def test_forced_rollback_world2(case, dtype):
    assert run_distributed(_forced_rollbacks, 2, args=(1, True, dtype, case), timeout=300) == [True, True]


def _second_backward(offload_param):
    """A second forward and backward in the boundary micro-step: its gathers read the 16-bit values the first
    backward read (nothing speculative reached them), and its folds into pieces already stepped roll back at once."""
    kwargs = dict(gas=1, offload_param=offload_param, steps=3, twice=True)
    exact = _train(False, **kwargs)
    spec = _train(True, delay=0.005, stall=0.02, **kwargs)
    assert_same(exact, spec)
    stats = spec[4]
    assert stats["rolled_back"] == 3 and stats["reasons"]["regradient"] == 3 and stats["kept"] == 0, stats
    assert stats["pieces_rolled_back"] > 0, stats
    return True


@pytest.mark.parametrize("offload_param", [False, True])
def test_second_backward_rolls_back(offload_param):
    assert run_distributed(_second_backward, 1, args=(offload_param, ), timeout=180) == [True]


def _read_before_step(offload_param):
    """An accessor reading the masters between the boundary backward and step() sees the values before the step."""
    os.environ["DS_OFFLOAD_OVERLAP"] = "1"
    try:
        torch.manual_seed(3)
        model = _Net(9, 3, 0.0, False)
        config = _config(True, 1, offload_param, "bf16", 1e6)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        check_read_before_step(engine, model)
        engine.destroy()
        return True
    finally:
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)


@pytest.mark.parametrize("offload_param", [False, True])
def test_read_before_step_rolls_back(offload_param):
    assert run_distributed(_read_before_step, 1, args=(offload_param, ), timeout=120) == [True]


def _device_share_raises():
    try:
        deepspeed.initialize(model=_Net(9, 3, 0.0, False), config=_config(True, 1, False, "bf16", 1e6, ratio=0.5))
    except NotImplementedError as exc:
        return "super_offload" in str(exc)
    return False


def test_device_share_raises_on_every_rank():
    assert run_distributed(_device_share_raises, 2, timeout=120) == [True, True]
