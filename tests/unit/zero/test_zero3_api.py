# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 construction and gathering API: zero.Init, GatheredParameters, register_external_parameter."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.common import run_distributed

STAGE3 = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {
        "type": "SGD",
        "params": {
            "lr": 0.1
        }
    },
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 10
    }
}


class Pair(nn.Module):

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def init_and_gather():
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # ranks draw different values: Init must take rank 0's
    with deepspeed.zero.Init():
        model = Pair()
    weight = model.a.weight
    assert weight.ds_status == ZeroParamStatus.NOT_AVAILABLE and weight.data.numel() == 0
    assert tuple(weight.ds_shape) == (5, 6) and weight.ds_tensor.numel() == -(-30 // world)
    torch.manual_seed(100)  # rank 0's construction, redone locally as the reference
    expected = Pair()
    plain = torch.ones(3)
    with deepspeed.zero.GatheredParameters([weight, model.a.bias, plain]):  # plain tensors are ignored
        torch.testing.assert_close(weight.data, expected.a.weight.data, rtol=0, atol=0)
        torch.testing.assert_close(model.a.bias.data, expected.a.bias.data, rtol=0, atol=0)
    assert weight.data.numel() == 0, "released again on exit"
    # modifier_rank: rank 0's edit reaches every rank and is re-partitioned
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.25)
        else:
            weight.data.fill_(-7.0)  # ignored: only the modifier's values count
    with deepspeed.zero.GatheredParameters(weight):
        assert torch.all(weight.data == 0.25)
    # the edited model trains as a stage-3 engine from the edited values
    engine = deepspeed.initialize(model=model, config=STAGE3)[0]
    from deepspeed.utils import safe_get_full_fp32_param
    assert torch.all(safe_get_full_fp32_param(engine.module.a.weight) == 0.25)
    x = torch.ones(2, 6)
    engine.backward(engine(x).sum())
    engine.step()
    engine.destroy()
    with deepspeed.zero.Init(enabled=False):
        unpartitioned = Pair()
    assert not hasattr(unpartitioned.a.weight, "ds_id") and unpartitioned.a.weight.numel() == 30
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_init_and_gathered_parameters(world):
    assert run_distributed(init_and_gather, world, timeout=90) == [True] * world


class External(nn.Module):
    """``head`` uses ``emb.weight`` functionally, outside ``emb``: declared with register_external_parameter."""

    def __init__(self, register):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.mix = nn.Linear(4, 4)
        self.head = Head(self.emb)
        if register:
            import deepspeed
            deepspeed.zero.register_external_parameter(self.head, self.emb.weight)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class Head(nn.Module):

    def __init__(self, emb):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self._emb = [emb]  # not a submodule: the weight is used "externally"

    def forward(self, h):
        return F.linear(h * self.scale, self._emb[0].weight)


def external_parameter():
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad
    world = dist.get_world_size()
    torch.manual_seed(0)
    reference = External(register=False)
    torch.manual_seed(0)
    model = External(register=True)
    engine = deepspeed.initialize(model=model, config=STAGE3)[0]
    try:
        tokens = torch.arange(6).view(2, 3) % 11
        engine.backward(engine(tokens).pow(2).mean())
        loss = sum(reference(tokens).pow(2).mean() for _ in range(world)) / world  # same data on every rank
        grads = torch.autograd.grad(loss, list(reference.parameters()))
        for (name, param), expected in zip(engine.module.named_parameters(), grads):
            torch.testing.assert_close(safe_get_full_grad(param), expected, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        engine.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_register_external_parameter(world):
    assert run_distributed(external_parameter, world, timeout=90) == [True] * world


def empty_partition_cache_worker(stage, persistence):
    import copy
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(7)
    model = Pair()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    cfg = {**STAGE3, "gradient_clipping": 0.0,
           "zero_optimization": {**STAGE3["zero_optimization"], "stage": stage,
                                 "stage3_param_persistence_threshold": persistence}}  # yapf: disable
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    engine.empty_partition_cache()  # right after initialize: nothing to free, nothing breaks
    world = dist.get_world_size()
    if stage == 3:  # a unit left gathered with nobody using it, as an unconsumed prefetch leaves it
        for unit in engine._stage.coordinator.units:
            engine._stage.coordinator.gather(unit)
    engine.empty_partition_cache()
    if stage == 3:  # persistent units too, as upstream (gathered again when the next forward begins)
        for param in engine.module.parameters():
            assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0, param.ds_shape
    for step in range(3):
        x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(step))
        out = engine(x[2 * dist.get_rank():2 * dist.get_rank() + 2])
        if step == 1:  # between the forward and its backward: the backward gathers what it needs again
            engine.empty_partition_cache()
        engine.backward(out.square().sum())
        engine.step()
        engine.empty_partition_cache()
        ref_opt.zero_grad()
        (reference(x).square().sum() / world).backward()
        ref_opt.step()
    got = [deepspeed.utils.safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    engine.destroy()
    return all(torch.allclose(g, r, atol=1e-6) for g, r in zip(got, reference.parameters()))


@pytest.mark.parametrize("stage,persistence", [(3, 0), (3, 10), (1, 0)])
def test_empty_partition_cache(stage, persistence):
    """Upstream's engine.empty_partition_cache(): gathered ZeRO-3 copies nobody uses are freed (persistent ones
    too), on any stage it may be called between steps or between a forward and its backward, and training is
    unchanged (plain torch)."""
    assert run_distributed(empty_partition_cache_worker, 2, args=(stage, persistence), timeout=90) == [True, True]


def all_gather_coalesced_worker():
    import io
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(100)
    expected = Pair()  # rank 0's construction, redone locally: zero.Init shards rank 0's values
    torch.manual_seed(100)
    with deepspeed.zero.Init():
        model = Pair()
    params = list(model.parameters())
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params)
    params[0].all_gather_coalesced(params).wait()
    whole = all(torch.equal(p.data, e) for p, e in zip(params, expected.parameters()))
    buffer = io.BytesIO()
    torch.save(params[0], buffer)  # the attribute is a module function: the parameter still pickles
    engine = deepspeed.initialize(model=model, config={**STAGE3, "gradient_clipping": 0.0})[0]
    engine.backward(engine(torch.ones(2, 6)).sum())
    engine.step()
    params[0].all_gather_coalesced(params).wait()  # after a step: the updated values
    stepped = all(torch.equal(p.data, deepspeed.utils.safe_get_full_fp32_param(p)) for p in params)
    engine.destroy()
    return whole, stepped


@pytest.mark.parametrize("world", [1, 2])
def test_param_all_gather_coalesced(world):
    """Upstream's ``param.all_gather_coalesced(params).wait()``: every listed ZeRO-3 parameter whole, exactly
    (rank 0's construction), also after an engine's step."""
    assert run_distributed(all_gather_coalesced_worker, world, timeout=90) == [(True, True)] * world


class ParentInitializesChildren(nn.Module):
    """Initialises its children's weights in its own ``__init__``, after zero.Init partitioned them (HF's
    ``self.apply(self._init_weights)``)."""

    def __init__(self, rank):
        super().__init__()
        self.pair = Pair()
        self.head = nn.Linear(3, 2)
        self.apply(functools.partial(self._init_weights, rank))

    @staticmethod
    def _init_weights(rank, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.5)  # this rank's generator
            with torch.no_grad():
                module.bias.fill_(0.1 * (1 + rank))


def parent_init_worker():
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    torch.manual_seed(100)
    expected = ParentInitializesChildren(0)  # rank 0's construction, redone locally
    torch.manual_seed(100 + rank)
    with deepspeed.zero.Init():
        model = ParentInitializesChildren(rank)
    assert torch.nn.Module.apply is not None and "apply" not in vars(type(model))
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return all(torch.equal(p.data, e) for p, e in zip(params, expected.parameters()))


@pytest.mark.parametrize("world", [1, 2])
def test_apply_inside_zero_init_initialises_partitioned_children(world):
    """``module.apply(fn)`` under zero.Init sees each module's parameters whole and keeps rank 0's result on every
    rank (upstream's behaviour; plain torch's values on rank 0's generator)."""
    import deepspeed
    original = torch.nn.Module.apply
    assert run_distributed(parent_init_worker, world, timeout=90) == [True] * world
    with deepspeed.zero.Init(enabled=False):
        assert torch.nn.Module.apply is original
    assert torch.nn.Module.apply is original
