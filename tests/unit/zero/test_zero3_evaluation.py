# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 engines without an optimizer (evaluation: Transformers' ``deepspeed_init(inference=True)``, a model built
under ``zero.Init``): the parameters stay partitioned, each forward gathers and releases them, and the outputs,
the gradient of the input and the consolidated state dict equal plain torch's. Two ranks, one unit per layer."""

import pytest
import torch

from tests.unit.common import run_distributed


def _model(widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _evaluate(widths, under_init, seed):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1,
            "stage3_gather_16bit_weights_on_model_save": True
        }
    }
    torch.manual_seed(seed)
    reference = _model(widths)
    if under_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = _model(widths)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            model.load_state_dict(reference.state_dict())
    else:
        model = _model(widths)
        model.load_state_dict(reference.state_dict())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    failures = []
    if optimizer is not None or engine.optimizer is not None:
        failures.append("an engine without an optimizer returns none")
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(2):
        x = torch.randn(2, widths[0], generator=gen, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        with torch.no_grad():
            if not torch.allclose(engine(x), reference(x_ref), rtol=1e-6, atol=1e-6):
                failures.append("no_grad output differs")
        out = engine(x)
        if not all(p.numel() == 0 for p in model.parameters()):
            failures.append("parameters stayed gathered after the forward")
        engine.backward(out.square().sum())
        reference(x_ref).square().sum().backward()
        if not torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6):
            failures.append("input gradient differs")
        engine.step()  # nothing to step: a no-op
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        expected = reference.state_dict()
        if set(state) != set(expected) or any(not torch.equal(state[k], expected[k]) for k in expected):
            failures.append("consolidated state dict differs")
    engine.destroy()
    return failures


@pytest.mark.parametrize("widths,under_init,seed", [((5, 7, 3), True, 0), ((4, 1, 6, 2), False, 1),
                                                    ((3, 9, 1), True, 2)])
def test_zero3_engine_without_optimizer_evaluates_like_plain_torch(widths, under_init, seed):
    for failures in run_distributed(_evaluate, 2, args=(widths, under_init, seed), timeout=120):
        assert not failures, failures
