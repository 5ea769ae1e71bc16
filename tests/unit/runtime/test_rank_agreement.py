# SPDX-License-Identifier: Apache-2.0
"""Ranks whose configs or models differ get the same clear error on every rank at initialize, before any
other collective (which would hang, or abort in gloo), naming the first differing field and the ranks."""

import pytest
import torch

from tests.unit.common import run_distributed


def _config(stage=1, gas=1):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": stage
        }
    }


class Wide(torch.nn.Module):
    """``layers`` linear layers of width ``width``; ``tail`` adds one more layer; ``frozen`` freezes one."""

    def __init__(self, layers=3, width=4, last_width=4, tail=False, frozen=False):
        super().__init__()
        widths = [width] * layers + [last_width]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(widths[i], widths[i + 1]) for i in range(layers))
        if tail:
            self.tail = torch.nn.Linear(last_width, 1)
        if frozen:
            self.layers[0].bias.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _many(count):
    return torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(2)) for _ in range(count))


def _case(case, rank):
    """(config, model) of ``rank`` for one case; rank 1 is the odd one out."""
    odd = rank == 1
    if case == "gas":
        return _config(gas=2 if odd else 1), Wide()
    if case == "stage":
        return _config(stage=3 if odd else 1), Wide()
    if case == "precision":
        cfg = _config()
        if odd:
            cfg["bf16"] = {"enabled": True}
        return cfg, Wide()
    if case == "shape":
        return _config(), Wide(last_width=8 if odd else 4)
    if case == "extra_parameter":
        return _config(), Wide(tail=odd)
    if case == "trainable":
        return _config(), Wide(frozen=odd)
    if case == "many_parameters":
        # 700 parameters (three chunks of the digest exchange); entry #450 is named differently on rank 1
        model = torch.nn.Module()
        model.a = _many(450)
        setattr(model, "b_odd" if odd else "b", _many(250))
        return _config(stage=0), model
    raise ValueError(case)


CASES = {
    "gas": ("DeepSpeedConfigError", "config key 'gradient_accumulation_steps': 1 on rank 0, 2 on rank 1"),
    "stage": ("DeepSpeedConfigError", "config key 'zero_optimization.stage': 1 on rank 0, 3 on rank 1"),
    "precision": ("DeepSpeedConfigError", "fp32 on rank 0, bf16 on rank 1"),
    "shape": ("ValueError", "parameter #4: 'layers.2.weight' of shape (4, 4) trainable on rank 0, "
              "'layers.2.weight' of shape (8, 4) trainable on rank 1"),
    "extra_parameter": ("ValueError", "parameter #6: no parameter on rank 0, 'tail.weight' of shape (1, 4) "
                        "trainable on rank 1 (number of parameters: 6 on rank 0, 8 on rank 1)"),
    "trainable": ("ValueError", "parameter #1: 'layers.0.bias' of shape (4,) trainable on rank 0, "
                  "'layers.0.bias' of shape (4,) frozen on rank 1"),
    "many_parameters": ("ValueError", "parameter #450: 'b.0' of shape (2,) trainable on rank 0, 'b_odd.0' of shape "
                        "(2,) trainable on rank 1"),
}


def disagreeing_ranks(case):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.config_utils import DeepSpeedConfigError
    torch.manual_seed(0)
    cfg, model = _case(case, dist.get_rank())
    kind, needle = CASES[case]
    expected = DeepSpeedConfigError if kind == "DeepSpeedConfigError" else ValueError
    with pytest.raises(expected) as info:
        deepspeed.initialize(model=model, config=cfg)
    message = str(info.value)
    assert needle in message, message
    # the peers are still in step: an ordinary engine works afterwards
    engine = deepspeed.initialize(model=Wide(), config=_config())[0]
    engine.destroy()
    return message


@pytest.mark.parametrize("case", sorted(CASES))
def test_disagreeing_ranks_get_the_same_error(case):
    messages = run_distributed(disagreeing_ranks, 2, args=(case, ), timeout=60)
    assert messages[0] == messages[1]


def exchange_sizes(count):
    """The bytes each exchange sends for a model of ``count`` parameters whose ranks agree."""
    import deepspeed
    from deepspeed.runtime.configuration import agreement
    sizes = []
    original = agreement._all_gather_json

    def recording(obj, device):
        import json
        sizes.append(len(json.dumps(obj)))
        return original(obj, device)

    agreement._all_gather_json = recording
    try:
        model = torch.nn.Module()
        model.p = _many(count)
        engine = deepspeed.initialize(model=model, config=_config(stage=0))[0]
        engine.destroy()
    finally:
        agreement._all_gather_json = original
    return sizes


def test_one_small_exchange_whatever_the_model_size():
    small, large = (run_distributed(exchange_sizes, 2, args=(count, ), timeout=60)[0] for count in (3, 5000))
    assert len(small) == len(large) == 1, (small, large)
    # the same few hundred bytes: only the parameter count's digits grow
    assert large[0] - small[0] <= 4 and large[0] < 1000, (small, large)


def single_rank_exchanges_nothing():
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.configuration import agreement
    original = agreement._all_gather_json

    def refuse(obj, device):
        raise AssertionError("world size 1 must not exchange anything")

    agreement._all_gather_json = refuse
    try:
        assert dist.get_world_size() == 1
        deepspeed.initialize(model=Wide(), config=_config())[0].destroy()
    finally:
        agreement._all_gather_json = original
    return True


def test_world_size_one_exchanges_nothing():
    assert run_distributed(single_rank_exchanges_nothing, 1, timeout=60) == [True]
