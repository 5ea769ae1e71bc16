# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 parameters used outside their module's forward: read by another module's forward (no
``register_external_parameter``), returned by a submodule to its caller, declared external up front, with and without
activation checkpointing; and the parameter dict behind it (``ZeROOrderedDict``, late-attached modules, restored at
``destroy``).

Each model trains three steps on two ranks with one unit per linear layer (so every such use crosses a unit), and
its parameters are compared with plain torch training the same model on the same global batches.
"""

import pytest
import torch

from tests.unit.common import run_distributed

STEPS, MICRO, LR = 3, 2, 0.1


class ReadsOtherWeight(torch.nn.Module):
    """The parent's forward applies ``head``'s weight itself (``head`` never runs)."""

    def __init__(self, widths, checkpoint):
        super().__init__()
        self.body = torch.nn.Linear(widths[0], widths[1])
        self.head = torch.nn.Linear(widths[1], widths[2])
        self.checkpoint = checkpoint

    def _inner(self, x):
        h = torch.tanh(self.body(x))
        return torch.nn.functional.linear(h, self.head.weight) + self.head.bias

    def forward(self, x):
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=False)
        return self._inner(x)


class ReturnsBias(torch.nn.Linear):

    def forward(self, x):
        return super().forward(x), self.bias


class UsesReturnedBias(torch.nn.Module):
    """A submodule returns its own bias; the caller adds it again after a further layer."""

    def __init__(self, widths, checkpoint):
        super().__init__()
        self.first = ReturnsBias(widths[0], widths[1])
        self.second = torch.nn.Linear(widths[1], widths[1])
        self.out = torch.nn.Linear(widths[1], widths[2])

    def forward(self, x):
        h, bias = self.first(x)
        h = torch.tanh(self.second(h)) + bias
        return self.out(h)


class DeclaredExternal(ReadsOtherWeight):
    """As :class:`ReadsOtherWeight`, with the use declared before ``initialize``."""

    def __init__(self, widths, checkpoint):
        super().__init__(widths, checkpoint)
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
        register_external_parameter(self, self.head.weight)


MODELS = {"reads_other_weight": ReadsOtherWeight, "returned_bias": UsesReturnedBias, "declared": DeclaredExternal}


def _batches(widths, world, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(world * MICRO, widths[0], generator=gen), torch.randn(world * MICRO,
                                                                               widths[-1],
                                                                               generator=gen)) for _ in range(STEPS)]


def _reference(name, widths, checkpoint, world, seed):
    torch.manual_seed(seed)
    model = MODELS[name](widths, checkpoint)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches(widths, world, seed):
        optimizer.zero_grad()
        loss = sum(
            torch.nn.functional.mse_loss(model(x[r * MICRO:(r + 1) * MICRO]), y[r * MICRO:(r + 1) * MICRO])
            for r in range(world)) / world
        loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(name, widths, checkpoint, seed):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    from deepspeed.utils import safe_get_full_fp32_param
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = MODELS[name](widths, checkpoint)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": LR
            }
        },
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    assert all(isinstance(m._parameters, ZeROOrderedDict) for m in model.modules())
    for x, y in _batches(widths, world, seed):
        loss = torch.nn.functional.mse_loss(engine(x[rank * MICRO:(rank + 1) * MICRO]),
                                            y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
    got = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    released = all(p.numel() == 0 for p in model.parameters())  # nothing stays gathered after the step
    externals = {type(m).__name__: len(m._external_params) for m in model.modules() if m._external_params}
    engine.destroy()
    plain = all(type(m._parameters) is dict for m in model.modules())
    return got, released, externals, plain


CASES = [("reads_other_weight", (5, 7, 3), False, 0), ("reads_other_weight", (4, 1, 6), True, 1),
         ("returned_bias", (3, 5, 2), False, 2), ("returned_bias", (6, 1, 1), True, 3),
         ("declared", (5, 3, 4), False, 4)]


@pytest.mark.parametrize("name,widths,checkpoint,seed", CASES)
def test_external_uses_train_like_plain_torch(name, widths, checkpoint, seed):
    results = run_distributed(_train, 2, args=(name, widths, checkpoint, seed), timeout=120)
    expected = _reference(name, widths, checkpoint, 2, seed)
    for got, released, externals, plain in results:
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert released, "a unit stayed gathered after the step"
        assert plain, "destroy() must leave plain parameter dicts"
        if name == "returned_bias":
            assert externals == {"UsesReturnedBias": 1}, externals  # the caller holds the returned bias
        else:
            assert externals == {type(MODELS[name](widths, checkpoint)).__name__: 1}, externals


def _late_module(seed):
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine, *_ = deepspeed.initialize(model=model,
                                      config={
                                          "train_micro_batch_size_per_gpu": 1,
                                          "zero_optimization": {
                                              "stage": 3
                                          }
                                      })
    first = model[0]._parameters
    late = torch.nn.Linear(4, 2)
    late._parameters = dict(late._parameters)
    model.append(late)
    out = engine(torch.randn(1, 4))
    engine(torch.randn(1, 4))
    return (tuple(out.shape), isinstance(late._parameters, ZeROOrderedDict), model[0]._parameters is first)


def test_late_attached_module_gets_the_dict_at_the_next_forward():
    for shape, converted, same in run_distributed(_late_module, 2, args=(0, ), timeout=60):
        assert shape == (1, 2) and converted and same


def test_ordered_dict_helpers():
    from deepspeed.runtime.zero.parameter_offload import (ZeROOrderedDict, ensure_zero_ordered_dict,
                                                          restore_parameters_dict)
    m = torch.nn.Linear(3, 2)
    original = m._parameters
    ensure_zero_ordered_dict(m)
    assert isinstance(m._parameters, ZeROOrderedDict) and m._original_parameters is original
    assert list(m._parameters) == ["weight", "bias"] and m.weight is original["weight"]
    converted = m._parameters
    ensure_zero_ordered_dict(m)
    assert m._parameters is converted
    import copy
    clone = copy.deepcopy(m)
    assert isinstance(clone._parameters, ZeROOrderedDict) and clone._parameters._coordinator is None
    torch.testing.assert_close(clone.weight, m.weight)
    restore_parameters_dict(m)
    assert type(m._parameters) is dict and not hasattr(m, "_original_parameters")
    ensure_zero_ordered_dict(object())  # nothing to convert: no error
