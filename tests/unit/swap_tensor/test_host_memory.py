# SPDX-License-Identifier: Apache-2.0
"""What NVMe offload keeps in host memory (docs/offload.md, "What stays in host memory"): between steps the fp32
masters, the optimizer state and ZeRO-3's 16-bit shards are on disk only (their host tensors are empty); the rings
of page-locked buffers grow only to what is in use at once."""

import os

import torch

from deepspeed.runtime.zero.offload.transfers import DONE, PinnedRing
from tests.unit.common import run_distributed
from tests.unit.sweep.run import build_mlp, make_batch, mse


class _Copy:
    """A transfer that completes when told."""

    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished

    def synchronize(self):
        self.finished = True


def test_pinned_ring_grows_only_while_buffers_are_busy():
    ring = PinnedRing(4, 8, torch.float32, pin_memory=False)
    for _ in range(10):  # every use completes before the next take: one buffer
        index, view = ring.take(8)
        ring.used_by(index, DONE)
    assert len(ring.buffers) == 1
    copies = []
    for _ in range(6):  # nothing completes: up to the count, then the oldest is waited for
        index, view = ring.take(5)
        assert view.numel() == 5
        copy = _Copy()
        ring.used_by(index, copy)
        copies.append((index, copy))
    assert len(ring.buffers) == 4
    assert copies[0][1].finished and copies[1][1].finished  # taken again: their copies were waited for
    busy = [i for i, c in copies[2:] if not c.finished]
    assert len(set(busy)) == len(busy), "a buffer was handed out while still in use"


def _between_steps(folder):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    torch.manual_seed(0)
    widths = [9, 40, 1, 12]
    model = build_mlp(widths)
    zero = {
        "stage": 3,
        "sub_group_size": 16,
        "stage3_prefetch_bucket_size": 30,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": folder,
            "buffer_count": 3
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": folder,
            "buffer_count": 2,
            "buffer_size": 16,
            "max_in_cpu": 0
        },
    }
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {
            "enabled": True
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-3
            }
        },
        "zero_optimization": zero
    }
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    try:
        for micro in range(4):
            x, y = make_batch(widths, rank, micro, dtype=torch.bfloat16)
            engine.backward(mse(engine(x), y))
            engine.step()
        stage = engine._stage
        stage.host_step.finish()
        assert all(m.data.numel() == 0 for m in stage.masters), "fp32 masters held in host memory"
        for m in stage.masters:
            held = [k for k, v in engine.optimizer.state[m].items() if torch.is_tensor(v) and v.dim() > 0]
            assert not held, f"optimizer state {held} held in host memory"
        assert all(s is None for s in stage.shards), "16-bit shards held in host memory"
        cache = stage.param_tier.store.nbytes() + stage.host_step.swap.store.nbytes()
        partition = sum(stage.host_step.group_numel)
        # the caches: 2 parameter pages (2 bytes an element) and 3 optimizer pages (12 bytes), 16 elements each
        assert cache <= (2 * 2 + 3 * 12) * 16 + 5 * 3 * 4096, (cache, partition)
    finally:
        engine.destroy()


def test_state_is_on_disk_between_steps(tmp_path):
    os.makedirs(tmp_path / "nvme")
    run_distributed(_between_steps, 2, args=(str(tmp_path / "nvme"), ), timeout=120)
