# SPDX-License-Identifier: Apache-2.0
"""ZeRO-1 accumulates a window's gradient in one staging buffer of the model's size: it exists only from the
window's first contribution until the boundary's backward has reduced every bucket, so between steps (where RL
trainers generate) that memory is free. Checked at worlds 2 and 3 (a parameter smaller than the world), GAS 3 with a
micro-step that leaves a layer unused, and with ``no_sync``: the buffer is there during the window and gone after
each step, and training equals plain torch (AdamW, clipping) on the same global batch."""

import pytest
import torch

from tests.unit.common import run_distributed

T = 120
LR, CLIP, STEPS, GAS = 3e-2, 0.5, 3, 3


class _Net(torch.nn.Module):
    """Odd widths, a 1-wide layer, a layer skipped on the last micro-step of a window."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 1)
        self.c = torch.nn.Linear(1, 3)
        self.skip = torch.nn.Linear(3, 3)

    def forward(self, x, use_skip=True):
        h = self.c(self.b(torch.tanh(self.a(x))))
        return (self.skip(h) if use_skip else h).square().mean()


def _data(world):
    g = torch.Generator().manual_seed(11)
    return [[[torch.randn(2, 5, generator=g) for _ in range(world)] for _ in range(GAS)] for _ in range(STEPS)]


def _reference(world):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for window in _data(world):
        opt.zero_grad()
        for micro, xs in enumerate(window):
            for x in xs:
                (model(x, use_skip=micro != GAS - 1) / (world * GAS)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _staging_cell(no_sync):
    import deepspeed
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": 1,
            "reduce_bucket_size": 20
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "weight_decay": 0.1,
                "torch_adam": True
            }
        }
    }
    engine = deepspeed.initialize(model=_Net(), config=config)[0]
    geometry = engine._stage.geometry
    held = []
    try:
        for window in _data(world):
            for micro, xs in enumerate(window):
                loss = engine(xs[rank], use_skip=micro != GAS - 1)
                if no_sync and micro == 0:
                    with engine.no_sync():
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                staging = geometry._persistent
                held.append(staging is not None and staging.numel() == engine._stage.layout.numel)
                engine.step()
            held.append(geometry._persistent is not None)  # after the boundary's step: must be gone
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        engine.destroy()
    want = _reference(world)
    bad = [n for n in want if not torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-6)]
    # held after each micro-step's backward (the boundary's reduces and folds every bucket in its backward), then
    # after the step
    expected = ([True] * (GAS - 1) + [False, False]) * STEPS
    return bad + ([f"staging held {held}, expected {expected}"] if held != expected else [])


@pytest.mark.parametrize("world, no_sync", [(2, False), (3, True)])
def test_stage1_staging_lives_only_within_the_window(world, no_sync):
    assert run_distributed(_staging_cell, world, args=(no_sync, ), timeout=T) == [[]] * world
