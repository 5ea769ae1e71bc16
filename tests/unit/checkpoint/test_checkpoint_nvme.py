# SPDX-License-Identifier: Apache-2.0
"""Checkpoints with NVMe offload: any devices (none, cpu, nvme) for parameters and optimizer state save, and load
onto any other combination (and another stage), exactly.

An engine of the saving combination trains 2 steps, saves, and trains 2 more; an engine of the loading combination
(its own swap folders) loads the checkpoint: the loss of a probe batch right after loading is the saving engine's
right after saving, bit for bit (upstream's check), and its next 2 steps' losses are the continued run's, bit for bit
(every combination steps with the host Adam op: ``DS_NATIVE_CPU_ADAM=1``). The checkpoint folder holds no swap file,
and a destroyed engine leaves none in its swap folder: the swap files are a cache, never the checkpoint.
"""

import os

import pytest
import torch

from deepspeed.ops.adam import host_adam
from tests.unit.common import run_distributed
from tests.unit.sweep.run import build_mlp, make_batch, mse

pytestmark = pytest.mark.skipif(host_adam.host_adam_op() is None, reason="the host Adam op cannot be built here")

WIDTHS = [7, 13, 1, 5]


def _config(stage, param_dev, opt_dev, folder):
    zero = {"stage": stage, "reduce_bucket_size": 16, "sub_group_size": 9}
    if opt_dev != "none":
        zero["offload_optimizer"] = {"device": opt_dev, "pin_memory": False}
        if opt_dev == "nvme":
            zero["offload_optimizer"].update(nvme_path=os.path.join(folder, "optimizer"), buffer_count=3)
    if param_dev != "none":
        zero["offload_param"] = {"device": param_dev}
        if param_dev == "nvme":
            zero["offload_param"].update(nvme_path=os.path.join(folder, "param"),
                                         buffer_count=2,
                                         buffer_size=7,
                                         max_in_cpu=0)
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=20, stage3_param_persistence_threshold=3)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "steps_per_print": float("inf"),
        "bf16": {
            "enabled": True
        },
        "zero_optimization": zero,
    }


def _engine(stage, param_dev, opt_dev, folder):
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    for sub in ("optimizer", "param"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    torch.manual_seed(0)
    model = build_mlp(WIDTHS)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, param_dev, opt_dev, folder))[0]


def _train(engine, rank, start, steps):
    losses = []
    for step in range(start, start + steps):
        for micro in range(2):
            x, y = make_batch(WIDTHS, rank, step * 2 + micro, dtype=torch.bfloat16)
            loss = mse(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _probe(engine, rank):
    with torch.no_grad():
        x, y = make_batch(WIDTHS, rank, 1000, dtype=torch.bfloat16)
        return mse(engine(x), y).item()


def _swap_files(folder):
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(".tensor.swp")]


def _save_then_load(save, load, tmp):
    """The worker: ``save``/``load`` are ``(stage, param device, optimizer device)``."""
    import deepspeed.comm as dist
    rank = dist.get_rank()
    os.environ["DS_NATIVE_CPU_ADAM"] = "1"
    try:
        ckpt = os.path.join(tmp, "ckpt")
        saver = _engine(*save, os.path.join(tmp, f"save{rank}"))
        _train(saver, rank, 0, 2)
        saver.save_checkpoint(ckpt, tag="t")
        probe = _probe(saver, rank)
        continued = _train(saver, rank, 2, 2)
        saver.destroy()
        assert not _swap_files(os.path.join(tmp, f"save{rank}")), "swap files left by a destroyed engine"
        assert not _swap_files(ckpt), "swap files in the checkpoint"
        loader = _engine(*load, os.path.join(tmp, f"load{rank}"))
        loader.load_checkpoint(ckpt, tag="t")
        assert _probe(loader, rank) == probe, f"rank {rank}: the loss right after loading differs"
        resumed = _train(loader, rank, 2, 2)
        assert resumed == continued, f"rank {rank}: {resumed} != {continued}"
        loader.destroy()
    finally:
        os.environ.pop("DS_NATIVE_CPU_ADAM", None)


# DS_FULL_MATRIX=1 runs every pair; by default, a sample that still saves and loads each device (none, cpu, nvme) for
# each of parameters and optimizer, each stage, a change of stage, and world 2
FULL = os.environ.get("DS_FULL_MATRIX") == "1"
PAIRS = [
    # (world, saved (stage, offload_param, offload_optimizer), loaded (...), in the default sample)
    (1, (3, "nvme", "nvme"), (3, "cpu", "cpu"), True),
    (1, (3, "cpu", "cpu"), (3, "nvme", "nvme"), False),
    (1, (3, "none", "none"), (3, "nvme", "nvme"), True),
    (1, (3, "nvme", "nvme"), (3, "none", "none"), False),
    (1, (3, "nvme", "none"), (3, "cpu", "nvme"), False),
    (1, (3, "cpu", "nvme"), (3, "nvme", "cpu"), True),
    (1, (2, "none", "nvme"), (2, "none", "cpu"), False),
    (1, (1, "none", "cpu"), (1, "none", "nvme"), True),
    (1, (2, "none", "nvme"), (3, "nvme", "nvme"), True),
    (2, (3, "nvme", "nvme"), (3, "cpu", "cpu"), False),
    (2, (1, "none", "nvme"), (2, "none", "none"), True),
]
PAIRS = [(w, s, l) for w, s, l, sampled in PAIRS if FULL or sampled]


@pytest.mark.parametrize("world,save,load",
                         PAIRS,
                         ids=[f"w{w}-z{s[0]}{s[1]}{s[2]}-to-z{l[0]}{l[1]}{l[2]}" for w, s, l in PAIRS])
def test_checkpoint_device_combinations(world, save, load, tmp_path):
    run_distributed(_save_then_load, world, args=(save, load, str(tmp_path)), timeout=180)
