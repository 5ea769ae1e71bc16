# SPDX-License-Identifier: Apache-2.0
"""A pipeline engine built from parameter groups (dicts, their ``params`` a generator) with the config's optimizer:
each group keeps its own settings, and one step equals the same SGD step in plain torch."""

import torch

from tests.unit.common import run_distributed


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)]


def _step():
    import deepspeed
    from deepspeed.pipe import PipelineModule
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)
    reference = torch.nn.Sequential(*_layers())
    torch.nn.functional.mse_loss(reference(x), y).backward()
    expected = {}
    for name, p in reference.named_parameters():  # weights: lr 0.1; biases: their group's lr 0
        expected[name] = p.detach() - (0.1 * p.grad if name.endswith("weight") else 0)

    model = PipelineModule(_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    named = list(model.named_parameters())
    groups = [{
        "params": (p for n, p in named if n.endswith("weight"))
    }, {
        "params": (p for n, p in named if n.endswith("bias")),
        "lr": 0.0
    }]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        }
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    engine.train_batch(iter([(x, y)]))
    lrs = sorted(group["lr"] for group in optimizer.param_groups)
    # this stage's parameters under the reference's names (layer index . weight / bias)
    diffs = {n: float((p.detach() - expected[n]).abs().max()) for n, p in engine.module.named_parameters()}
    return lrs, diffs


def test_parameter_groups_keep_their_settings():
    results = run_distributed(_step, 2)
    names = set()
    for lrs, diffs in results:
        assert lrs == [0.0, 0.1]
        assert all(d < 1e-6 for d in diffs.values()), diffs
        names |= set(diffs)
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}
