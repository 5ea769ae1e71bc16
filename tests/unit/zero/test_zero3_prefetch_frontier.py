# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 prefetches only from the frontier of a forward pass.

A unit used again behind the frontier (DeepSeek-V3's shared expert runs after the block's routed experts, with
the block's own unit; an ``lm_head`` runs after the model, with the root unit) used to prefetch the unit that
follows it in the trace, which the pass had already used and released: a gather nobody consumed, held until the
backward reached it (every MoE layer's expert weights, from the end of the forward to the backward). Here, after
every forward, no unit but the persistent one holds gathered memory, and training still equals plain torch
(same maths: SGD over the mean gradient of every rank's batch).
"""

import copy

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.moe.autoep_models import deepseek_v3

T = 240
LR = 0.1


class _Block(torch.nn.Module):
    """A router-experts-shared layout: ``a`` (the block's own unit) runs before and after ``b`` (a unit)."""

    def __init__(self, width, hidden):
        super().__init__()
        self.a = torch.nn.Linear(width, hidden)
        self.b = torch.nn.Linear(hidden, width)
        self.a2 = torch.nn.Linear(width, width)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        return x + h + self.a2(x) * torch.tanh(self.a(x)).mean(-1, keepdim=True)


class _Net(torch.nn.Module):

    def __init__(self, width, hidden, blocks):
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(_Block(width, hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _held_after_forward(stage):
    """``[(unit index, state, bytes)]`` of every non-persistent unit that holds gathered memory."""
    held = []
    for unit in stage.coordinator.units:
        full = unit._full
        nbytes = full.untyped_storage().nbytes() if full is not None else 0
        if not unit.persistent and (nbytes or unit.state.value != "sharded"):
            held.append((unit.index, unit.state.value, nbytes))
    return held


def _train(make_model, batches, config, call):
    """Train with ZeRO-3 and with plain torch; returns (mismatches, units held after a forward)."""
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_fp32_param
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = make_model()
    reference = copy.deepcopy(model)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    stage = engine.optimizer.stage
    losses, held = [], []
    for step, per_rank in enumerate(batches):
        loss = call(engine, per_rank[rank])
        if step > 0:  # the first forward traces the order; prefetching starts with the second
            held += [(step, *h) for h in _held_after_forward(stage)]
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    got = {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    engine.destroy()
    groups.reset_mesh()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    bad = []
    for step, per_rank in enumerate(batches):
        opt.zero_grad()
        for r in range(world):
            loss = call(reference, per_rank[r])
            (loss / world).backward()
            if r == rank and abs(float(loss) - losses[step]) > 1e-5 * abs(float(loss)):
                bad.append(f"loss {step}: {losses[step]} vs {float(loss)}")
        opt.step()
    for n, p in reference.named_parameters():
        err = float((got[n] - p.detach()).norm())
        if not err <= 2e-5 * max(float(p.norm()), 1e-3):
            bad.append(f"{n}: |diff| {err:.3g}")
    return bad, held


def _config(**zero):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            **zero
        },
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": LR
            }
        },
    }


def _deepseek(steps):
    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(21)
    batches = [[torch.randint(0, 32, (1, 6), generator=g) for _ in range(world)] for _ in range(steps)]
    # units: each layer and its experts; the router and the shared expert join their layer's unit
    config = _config(stage3_prefetch_bucket_size=1000)
    config["expert_parallel"] = {"enabled": True, "autoep_size": 1}

    def call(m, ids):
        return m(input_ids=ids, labels=ids).loss

    return _train(lambda: deepseek_v3(seed=6), batches, config, call)


def _plain(seed, steps):
    g = torch.Generator().manual_seed(seed)
    width, hidden, blocks = (int(v) for v in (torch.randint(1, 9, (1, ), generator=g),
                                              torch.randint(1, 6, (1, ), generator=g),
                                              torch.randint(1, 4, (1, ), generator=g)))
    world = torch.distributed.get_world_size()
    batches = [[torch.randn(3, width, generator=g) for _ in range(world)] for _ in range(steps)]
    torch.manual_seed(seed)
    return _train(lambda: _Net(width, hidden, blocks), batches, _config(stage3_prefetch_bucket_size=1),
                  lambda m, x: m(x))


def test_autoep_deepseek_v3_holds_no_unit_after_forward_world2():
    """The tiny DeepSeek-V3 (shared expert after the routed experts) on AutoEP ep 1, ZeRO-3, two ranks."""
    for bad, held in run_distributed(_deepseek, 2, args=(3, ), timeout=T):
        assert held == [] and bad == [], (held, bad)


@pytest.mark.parametrize("world, seed", [(1, 5), (2, 33)])
def test_block_reusing_its_unit_holds_nothing_after_forward(world, seed):
    """A block whose own unit runs again after a child unit; seeded random widths (1-wide included)."""
    for bad, held in run_distributed(_plain, world, args=(seed, 3), timeout=T):
        assert held == [] and bad == [], (held, bad)
