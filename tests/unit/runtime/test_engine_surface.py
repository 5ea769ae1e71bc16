# SPDX-License-Identifier: Apache-2.0
"""Upstream's engine surface: every name of upstream 0.19.8's ``DeepSpeedEngine`` / ``PipelineEngine`` and of the
``deepspeed`` package (the generated list ``deepspeed/runtime/engine_parts/names.py``) is here or refused by name; and
``set_train_batch_size`` changes GAS mid-run with gradients exact against plain torch."""

import pytest
import torch

import deepspeed
from deepspeed.runtime.engine_parts import api as engine_api
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.engine_parts.names import DEEPSPEED_ENGINE, PIPELINE_ENGINE, TOP_LEVEL
from deepspeed.runtime.pipe.engine import PipelineEngine
from tests.unit.common import run_distributed


def test_every_upstream_engine_name_is_defined():
    assert len(DEEPSPEED_ENGINE) >= 228 and PIPELINE_ENGINE
    missing = [n for n in DEEPSPEED_ENGINE if not hasattr(DeepSpeedEngine, n)]
    missing += [n for n in PIPELINE_ENGINE if not hasattr(PipelineEngine, n)]
    assert missing == []
    kinds = {n: k for n, k in DEEPSPEED_ENGINE.items() if k == "property"}
    assert all(isinstance(getattr(DeepSpeedEngine, n), property) for n in kinds), kinds


@pytest.mark.parametrize("name", sorted(engine_api.REFUSED))
def test_refused_names_raise_naming_the_method(name):
    with pytest.raises(NotImplementedError, match=rf"engine\.{name}\(\).*docs/compatibility\.md"):
        getattr(DeepSpeedEngine, name)(object())


def test_top_level_names():
    from deepspeed import top_level
    absent = []
    for name in TOP_LEVEL:
        if name in top_level.NOT_BUILT:
            with pytest.raises(AttributeError, match=rf"deepspeed\.{name} is not part of this runtime.*compatibility"):
                getattr(deepspeed, name)
        elif not hasattr(deepspeed, name):
            absent.append(name)
    assert absent == []
    assert issubclass(deepspeed.PipelineEngine, deepspeed.DeepSpeedEngine)
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from deepspeed.runtime.zero.offload_states import OffloadStateTypeEnum as again
    assert OffloadStateTypeEnum is again  # one definition


class _Model(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 5)
        self.b = torch.nn.Linear(5, 1)
        self.custom_value = 17

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def live_surface(stage):
    """On a live engine: every upstream name resolves (properties read); a pipeline-only name raises naming the
    engine method, not the model class; the model's own attributes still resolve through the engine."""
    engine = deepspeed.initialize(model=_Model(),
                                  config={
                                      "train_micro_batch_size_per_gpu": 1,
                                      "optimizer": {
                                          "type": "SGD",
                                          "params": {
                                              "lr": 0.1
                                          }
                                      },
                                      "zero_optimization": {
                                          "stage": stage
                                      }
                                  })[0]
    try:
        unresolved = [n for n in DEEPSPEED_ENGINE if not hasattr(engine, n)]
        try:
            engine.train_batch
            pipeline_error = None
        except AttributeError as error:
            pipeline_error = str(error)
        return (unresolved, "PipelineEngine.train_batch" in pipeline_error
                and "_Model" not in pipeline_error, engine.custom_value, engine.zero_optimization_partition_weights(),
                engine.get_data_parallel_rank(), engine.loss_scale())
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_live_engine_surface(stage):
    results = run_distributed(live_surface, 2, args=(stage, ), timeout=60)
    assert results == [([], True, 17, stage == 3, rank, 0.0) for rank in range(2)]


def batch_ramp(stage, seed):
    """GAS 2 for two windows, then ``set_train_batch_size`` to GAS 3 (the first new window starts after an even
    number of micro-steps, where upstream's ``micro_steps % GAS`` rule would end it early), against plain SGD."""
    import copy
    from deepspeed.runtime.engine_parts.usage_errors import EngineUsageError
    torch.manual_seed(seed)
    model = _Model()
    plain = copy.deepcopy(model)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine = deepspeed.initialize(model=model,
                                  config={
                                      "train_micro_batch_size_per_gpu": 2,
                                      "gradient_accumulation_steps": 2,
                                      "gradient_clipping": 0.0,
                                      "optimizer": {
                                          "type": "SGD",
                                          "params": {
                                              "lr": 0.1
                                          }
                                      },
                                      "zero_optimization": {
                                          "stage": stage
                                      }
                                  })[0]
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    mid_window_refused = False
    for window, gas in enumerate([2, 2, 3, 3, 1]):
        if window and gas != engine.gradient_accumulation_steps():
            engine.set_train_batch_size(gas * 2 * world)
        assert engine.gradient_accumulation_steps() == gas and engine.train_batch_size() == gas * 2 * world
        reference.zero_grad()
        for micro in range(gas):
            batches = [torch.randn(2, 3, generator=generator) for _ in range(world)]
            loss = engine(batches[rank]).pow(2).mean()
            engine.backward(loss)
            if window == 2 and micro == 0:
                try:
                    engine.set_train_batch_size(4 * 2 * world)
                except EngineUsageError:
                    mid_window_refused = True
            assert engine.is_gradient_accumulation_boundary() == (micro == gas - 1)
            engine.step()
            for x in batches:  # the mean over ranks of sum over micro-steps of grad / GAS
                (plain(x).pow(2).mean() / (gas * world)).backward()
        reference.step()
        for p, q in zip(engine.module.parameters(), plain.parameters()):
            full = deepspeed.utils.safe_get_full_fp32_param(p)
            worst = max(worst, float((full - q.detach()).abs().max()))
    engine.set_train_micro_batch_size(4)
    sizes = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.train_batch_size())
    engine.destroy()
    return worst, mid_window_refused, sizes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_set_train_batch_size_is_exact(stage):
    for worst, refused, sizes in run_distributed(batch_ramp, 2, args=(stage, 100 + stage), timeout=90):
        assert worst < 1e-6 and refused and sizes == (4, 1, 8)
