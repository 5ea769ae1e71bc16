# SPDX-License-Identifier: Apache-2.0
"""The example job's configs and its ``--offload`` switch (examples/gpt)."""

import importlib.util
import os
import sys

import pytest
import torch

from tests.unit.common import run_distributed

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                           "gpt")
CONFIGS = {
    "ds_config.json": (0, "none", "none"),
    "ds_config_zero2_offload.json": (2, "cpu", "none"),
    "ds_config_zero3_offload.json": (3, "cpu", "cpu"),
}


def _train_module():
    if EXAMPLE_DIR not in sys.path:
        sys.path.insert(0, EXAMPLE_DIR)  # train.py imports its model as `model`
    spec = importlib.util.spec_from_file_location("example_gpt_train", os.path.join(EXAMPLE_DIR, "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_example_configs_parse(name):
    from deepspeed.runtime.config import DeepSpeedConfig
    config = DeepSpeedConfig(os.path.join(EXAMPLE_DIR, name), world_size=2)
    stage, optimizer_device, param_device = CONFIGS[name]
    assert config.zero_optimization_stage == stage
    assert str(config.zero_config.offload_optimizer_device.value) == optimizer_device
    assert str(config.zero_config.offload_param_device.value) == param_device


def test_offload_switch():
    train = _train_module()
    default = os.path.join(EXAMPLE_DIR, "ds_config.json")
    two = train.load_config(default, zero_stage=2, offload=True)["zero_optimization"]
    assert two["offload_optimizer"] == {"device": "cpu", "pin_memory": False} and "offload_param" not in two
    three = train.load_config(default, zero_stage=3, offload=True, cuda=True)["zero_optimization"]
    assert three["offload_optimizer"] == three["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in train.load_config(default)["zero_optimization"]
    with pytest.raises(SystemExit, match="--offload needs ZeRO stage 1, 2 or 3"):
        train.load_config(default, offload=True)


def train_example_config(name):
    import deepspeed
    import deepspeed.comm as dist
    train = _train_module()
    from model import GPT, GPTConfig
    config = train.load_config(os.path.join(EXAMPLE_DIR, name))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    data = train.RepeatingPatternData(64, 16, 0, dist.get_rank())
    losses = []
    try:
        for _ in range(4 * engine.gradient_accumulation_steps()):
            tokens, targets = data.batch(engine.train_micro_batch_size_per_gpu(), engine.device)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.destroy()
    return losses


@pytest.mark.parametrize("name", ["ds_config_zero2_offload.json", "ds_config_zero3_offload.json"])
def test_offload_examples_train(name):
    for losses in run_distributed(train_example_config, 2, args=(name, ), timeout=90):
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
