# SPDX-License-Identifier: Apache-2.0
"""Speculative offloaded steps (``offload_optimizer.super_offload``) against the exact pipelined step, bit for bit.

The exact pipelined step (``super_offload: false``) is itself tested bit-identical to the whole-partition step
(``test_offload_overlap.py``). Here the same model is trained with and without speculation and every loss, 16-bit
parameter, fp32 master and Adam moment must be the same bits: when nothing rolls back (the pieces stepped early in
the boundary backward, the rest at the verdict), when one chosen step clips or overflows (rolled back, then the exact
step; training goes on identically), and when the LR changes between backward and step. The host step is slowed on
purpose (``StepPipeline.piece_delay``) and the first layer's backward sleeps, so pieces are stepped early while the
backward runs and some are still left for the verdict: the forward after the step must wait for its own pieces.
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

    def __init__(self, width, depth, stall):
        super().__init__()
        self.stall = stall
        self.embed = torch.nn.Linear(7, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        if self.stall and x.requires_grad:  # the first layer's backward waits: the later buckets are final already
            x.register_hook(lambda grad: time.sleep(self.stall))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _config(stage, super_offload, dtype="bf16", *, gas=1, clip=None, lr=1e-1, weight_decay=None, bucket=None):
    """A ZeRO-``stage`` config with the optimizer offloaded (``super_offload`` speculating); unset keys stay
    absent, so their defaults apply."""
    params = {"lr": lr} if weight_decay is None else {"lr": lr, "weight_decay": weight_decay}
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "super_offload": super_offload}}
    if bucket is not None:
        zero["reduce_bucket_size"] = bucket
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "AdamW",
            "params": params
        },
        "zero_optimization": zero,
    }
    if clip is not None:
        config["gradient_clipping"] = clip
    return with_precision(config, dtype)


def _train(super_offload,
           *,
           stage=2,
           gas=1,
           steps=4,
           dtype="bf16",
           clip=1e6,
           delay=0.0,
           stall=0.0,
           width=9,
           depth=4,
           bucket=40,
           clip_at=(),
           inf_at=(),
           lr_change_at=(),
           twice=False):
    """Train (``speculative_cases.train_steps`` for the forced clips, overflows, LR changes and ``twice``)."""
    with pipelined(dtype, delay):
        torch.manual_seed(7)
        model = _Net(width, depth, stall)
        config = _config(stage, super_offload, dtype, gas=gas, clip=clip, lr=3e-2, weight_decay=0.1, bucket=bucket)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        stage_obj = engine._stage
        assert stage_obj.host_step.pipeline is not None
        assert (stage_obj.speculative is not None) == super_offload
        losses = train_steps(engine,
                             dtype,
                             steps,
                             gas,
                             clip,
                             clip_at=clip_at,
                             inf_at=inf_at,
                             lr_change_at=lr_change_at,
                             twice=twice)
        masters, moments = optimizer_state(stage_obj)
        params = [p.detach().clone() for p in model.parameters()]
        stats = engine.optimizer.speculative_stats
        pieces = len(stage_obj.speculative._pieces) if super_offload else 0
        engine.destroy()
        return losses, params, masters, moments, stats, pieces, engine.skipped_steps


def _nothing_rolls_back(stage, gas, dtype, clip):
    kwargs = dict(stage=stage, gas=gas, dtype=dtype, clip=clip, steps=4)
    exact = _train(False, **kwargs)
    spec = _train(True, delay=0.02, stall=0.05, **kwargs)
    assert_same(exact, spec)
    stats, pieces = spec[4], spec[5]
    assert stats["boundary_steps"] == 4 and stats["speculated"] == 4 and stats["kept"] == 4, stats
    assert stats["rolled_back"] == 0 and stats["not_speculated"] == 0, stats
    # pieces were stepped early (during the stalled backward) and pieces were left to the verdict (forward order)
    assert 0 < stats["pieces_early"] < 4 * pieces, (stats, pieces)
    assert exact[0][0] != exact[0][-1]  # it trained
    return True


@pytest.mark.parametrize("stage,gas,dtype,clip", [(2, 1, "bf16", 1e6), (2, 2, "bf16", 0.0), (1, 2, "bf16", 1e6),
                                                  (2, 2, "fp16", 1e6), (2, 2, "fp32", 1e6)])
def test_nothing_rolls_back_world1(stage, gas, dtype, clip):
    assert run_distributed(_nothing_rolls_back, 1, args=(stage, gas, dtype, clip), timeout=240) == [True]


def test_nothing_rolls_back_world2():
    assert run_distributed(_nothing_rolls_back, 2, args=(2, 2, "bf16", 1e6), timeout=240) == [True, True]


def _forced_rollbacks(stage, gas, dtype, case):
    """Step 1 clips / overflows / changes its LR; the policy then keeps step 2 exact (clip, overflow)."""
    kwargs = dict(stage=stage, gas=gas, dtype=dtype, steps=5, **{case: (1, )})
    exact = _train(False, **kwargs)
    spec = _train(True, delay=0.005, **kwargs)
    assert_same(exact, spec)
    stats = spec[4]
    reason = {"clip_at": "clip", "inf_at": "overflow", "lr_change_at": "scalars"}[case]
    assert stats["rolled_back"] == 1 and stats["reasons"][reason] == 1, stats
    assert sum(stats["reasons"].values()) == 1, stats
    policy_skips = 0 if case == "lr_change_at" else 1  # an LR change says nothing about the next step's norm
    assert stats["not_speculated"] == policy_skips, stats
    assert stats["speculated"] == 5 - policy_skips and stats["kept"] == 4 - policy_skips, stats
    assert stats["boundary_steps"] == 5, stats
    if case == "inf_at":
        assert spec[6] == 1  # the step was skipped, in both modes
    return True


@pytest.mark.parametrize("case,dtype", [("clip_at", "bf16"), ("inf_at", "fp16"), ("lr_change_at", "bf16")])
def test_forced_rollback_world1(case, dtype):
    assert run_distributed(_forced_rollbacks, 1, args=(2, 2, dtype, case), timeout=240) == [True]


@pytest.mark.parametrize("case,dtype", [("clip_at", "bf16"), ("inf_at", "fp16")])
def test_forced_rollback_world2(case, dtype):
    assert run_distributed(_forced_rollbacks, 2, args=(2, 1, dtype, case), timeout=240) == [True, True]


def _second_backward():
    """A second backward in the boundary micro-step folds into pieces already stepped: rolled back at once."""
    kwargs = dict(stage=2, gas=1, steps=3, twice=True)
    exact = _train(False, **kwargs)
    spec = _train(True, delay=0.005, **kwargs)
    assert_same(exact, spec)
    stats = spec[4]
    assert stats["rolled_back"] == 3 and stats["reasons"]["regradient"] == 3 and stats["kept"] == 0, stats
    return True


def test_second_backward_rolls_back():
    assert run_distributed(_second_backward, 1, timeout=180) == [True]


def _always_clipping():
    """Clipping active at every step (the reference model's case): one speculation, one rollback, then exact."""
    kwargs = dict(stage=2, gas=1, clip=1e-3, steps=4)
    exact = _train(False, **kwargs)
    spec = _train(True, **kwargs)
    assert_same(exact, spec)
    stats = spec[4]
    assert stats["speculated"] == 1 and stats["rolled_back"] == 1 and stats["not_speculated"] == 3, stats
    return True


def test_adaptive_policy_stops_speculating_while_clipping():
    assert run_distributed(_always_clipping, 1, timeout=180) == [True]


def _read_before_step():
    """An accessor reading the masters between the boundary backward and step() sees the values before the step."""
    os.environ["DS_OFFLOAD_OVERLAP"] = "1"
    try:
        torch.manual_seed(3)
        model = _Net(6, 3, 0.0)
        config = _config(2, True, bucket=20)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        check_read_before_step(engine, model)
        engine.destroy()
        return True
    finally:
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)


def test_read_before_step_rolls_back():
    assert run_distributed(_read_before_step, 1, timeout=120) == [True]


def _unsupported(stage, extra):
    config = _config(stage, True)
    config["zero_optimization"].update(extra)
    try:
        deepspeed.initialize(model=_Net(4, 1, 0.0), config=config)
    except NotImplementedError as exc:
        return "super_offload" in str(exc)
    return False


@pytest.mark.parametrize("stage,extra", [(2, {"zenflow": {"topk_ratio": 0.1}})])
def test_unsupported_raise_on_every_rank(stage, extra):
    assert run_distributed(_unsupported, 2, args=(stage, extra), timeout=120) == [True, True]


def _no_pipeline():
    os.environ["DS_OFFLOAD_OVERLAP"] = "0"
    try:
        return _unsupported(2, {})
    finally:
        os.environ.pop("DS_OFFLOAD_OVERLAP", None)


def test_without_pipelined_step_raises():
    assert run_distributed(_no_pipeline, 1, timeout=120) == [True]


def test_host_adam_backup_restores_bit_for_bit():
    """The op's backup (in its pass) and the torch fallback save the same values; restore undoes the update."""
    op = host_adam.host_adam_op()
    gen = torch.Generator().manual_seed(0)
    n = 70_001
    group = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    state0 = {
        "step": torch.tensor(3.0),
        "exp_avg": torch.randn(n, generator=gen) * 0.1,
        "exp_avg_sq": torch.rand(n, generator=gen) * 0.01
    }
    out0 = torch.randn(n, generator=gen).to(torch.bfloat16)

    class _NoBackupOp:  # the op without backup support: step_piece copies first

        def __getattr__(self, name):
            if name == "has_backup":
                raise AttributeError(name)
            return getattr(op, name)

    results = []
    for which in (op, _NoBackupOp()):
        p, out = p0.clone(), out0.clone()
        state = {k: v.clone() for k, v in state0.items()}
        backup = host_adam.StepBackup(p, torch.bfloat16)
        scalars = host_adam.begin_step(group, p, state)
        for start, length in ((50_000, 20_001), (0, 50_000)):
            host_adam.step_piece(which, group, scalars, p, g, state, start, length, out, 1.0, None, backup)
        assert not torch.equal(p, p0)
        results.append((p.clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), out.clone()))
        backup.restore(p, state, out, 0, n)
        assert torch.equal(p, p0) and torch.equal(out.view(torch.int16), out0.view(torch.int16))
        assert torch.equal(state["exp_avg"], state0["exp_avg"]) and torch.equal(state["exp_avg_sq"],
                                                                                state0["exp_avg_sq"])
    for a, b in zip(*results):  # the update itself does not depend on the backup
        assert torch.equal(a, b)
    plain = p0.clone()
    state = {k: v.clone() for k, v in state0.items()}
    host_adam.adam_step(op, group, plain, g, state)
    assert torch.equal(plain, results[0][0])
