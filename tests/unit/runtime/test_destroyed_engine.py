# SPDX-License-Identifier: Apache-2.0
"""After ``engine.destroy()`` every method of the engine and of its optimizer raises an error naming
``destroy()`` on every rank, ``destroy()`` again is harmless, and the model is free for a new engine."""

import pytest
import torch

from tests.unit.common import run_distributed

STAGE3_SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}


def _config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(STAGE3_SMALL_UNITS)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": zero
    }


def use_after_destroy(stage):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.engine_parts.lifecycle import EngineDestroyedError
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ToyNet()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=_config(stage))
    tokens, targets = make_batch(rank, 0)
    loss = lm_loss(engine(tokens), targets)
    engine.backward(loss)
    engine.step()
    engine.destroy()
    engine.destroy()  # harmless

    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    calls = {
        "engine(x)": lambda: engine(tokens),
        "forward": lambda: engine.forward(tokens),
        "backward": lambda: engine.backward(loss),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "scale": lambda: engine.scale(loss),
        "save_checkpoint": lambda: engine.save_checkpoint("/nonexistent"),
        "load_checkpoint": lambda: engine.load_checkpoint("/nonexistent"),
        "no_sync": engine.no_sync,
        "train": engine.train,
        "optimizer.step": optimizer.step,
        "optimizer.zero_grad": optimizer.zero_grad,
        "optimizer.state_dict": optimizer.state_dict,
    }
    # ... and every other public method of the engine's own classes, called without arguments
    for name in dir(type(engine)):
        value = getattr(type(engine), name, None)
        if not name.startswith("_") and callable(value) and name != "destroy" and not hasattr(torch.nn.Module, name):
            calls.setdefault(name, getattr(engine, name))
    refused = []
    for name, call in calls.items():
        with pytest.raises(EngineDestroyedError, match=r"after engine\.destroy\(\)") as info:
            call()
        assert isinstance(info.value, RuntimeError)
        refused.append(name)
    assert len(refused) > 30, refused

    if stage < 3:
        # The user's model is plain torch again: no hooks, so its gradients are the plain gradients.
        from deepspeed.runtime.backward.ownership import owner_of
        assert not any(owner_of(p) for p in model.parameters())
        model.zero_grad()
        lm_loss(model(tokens), targets).backward()
        assert model.head.weight.grad is not None and model.emb.weight.grad is not None
        model.zero_grad()
        second, _, _, _ = deepspeed.initialize(model=model, config=_config(stage))
        second.backward(lm_loss(second(tokens), targets))
        second.step()
        assert second.was_step_applied()
        second.destroy()
    return sorted(refused)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_use_after_destroy_raises_on_every_rank(stage):
    results = run_distributed(use_after_destroy, 2, args=(stage, ), timeout=90)
    assert results[0] == results[1]
