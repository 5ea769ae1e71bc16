# SPDX-License-Identifier: Apache-2.0
"""Requests that used to be replaced by a lesser behaviour behind a warning: each is now refused with an error naming
the key (on every rank, at ``initialize``) or honoured (tested against its reference elsewhere: the disk tier on every
offloaded step in ``tests/unit/swap_tensor/test_disk_tier_paths.py``). docs/compatibility.md lists every warning and
its outcome."""

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigError
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from tests.unit.common import run_distributed
from tests.unit.sweep.run import build_mlp

WIDTHS = [5, 3, 2]


@pytest.mark.parametrize("schedule", [
    lambda opt: WarmupLR(opt, warmup_type="cosine"),
    lambda opt: WarmupDecayLR(opt, total_num_steps=10, warmup_type="exp"),
    lambda opt: WarmupCosineLR(opt, total_num_steps=10, warmup_type="Linear"),
])
def test_unknown_warmup_type_refused(schedule):
    """Formerly: a warning, and the log warm-up instead of the one asked for."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear'"):
        schedule(optimizer)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_param_below_stage3_refused(stage):
    """Formerly: a warning, and the parameters stayed on the device."""
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
    with pytest.raises(DeepSpeedConfigError,
                       match=r"zero_optimization.offload_param.*requires 'zero_optimization.stage' 3"):
        DeepSpeedConfig(config)
    config["zero_optimization"]["offload_param"]["device"] = "none"  # asks for nothing: accepted
    DeepSpeedConfig(config)


def _initialize_error(config, client):
    import deepspeed
    import deepspeed.comm as dist
    model = build_mlp(WIDTHS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if client else None
    try:
        deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except (NotImplementedError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"rank {dist.get_rank()}: initialize accepted {config}")


def _every_rank(config, client=False):
    texts = run_distributed(_initialize_error, 2, args=(config, client), timeout=120)
    assert texts[0] == texts[1], texts
    return texts[0]


def test_downgrades_refused_on_every_rank():
    """Formerly warnings: partial offload without the pipelined step (the whole state stayed on the host); a leaf
    module name that names no module (nothing was made a leaf); an offload_param section on ZeRO-2."""
    base = {"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False}
    ratio = dict(base, zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    text = _every_rank(ratio, client=True)
    assert "offload_optimizer.ratio < 1" in text and "pipelined host step" in text and "DeepSpeedCPUAdam" in text
    leaf = dict(base,
                optimizer={
                    "type": "AdamW",
                    "params": {
                        "lr": 1e-3
                    }
                },
                zero_optimization={
                    "stage": 3,
                    "leaf_module": {
                        "names": ["0", "encoder.block"]
                    }
                })
    text = _every_rank(leaf)
    assert "zero_optimization.leaf_module.names" in text and "encoder.block" in text
    z2 = dict(base,
              optimizer={
                  "type": "AdamW",
                  "params": {
                      "lr": 1e-3
                  }
              },
              zero_optimization={
                  "stage": 2,
                  "offload_param": {
                      "device": "cpu"
                  }
              })
    assert "requires 'zero_optimization.stage' 3" in _every_rank(z2)
