# SPDX-License-Identifier: Apache-2.0
"""Reduction overlaps backward: buckets (units) are launched as they complete, not all at the epilogue.

Exactness never depends on this (the epilogue reduces whatever is left), so the contract
tests cannot see it; without it, stages 1-3 hold a whole fp32 gradient of staging and
lose their overlap. Counted here: buckets already launched when the epilogue starts.
"""

import pytest
import torch

from tests.unit.common import run_distributed


def launched_before_epilogue(stage):
    import deepspeed
    from deepspeed.runtime.zero.gradients.grad_pipeline import BucketState
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 16,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 50
        }
    }
    engine = deepspeed.initialize(model=ToyNet(), config=cfg)[0]
    pipeline = engine._stage.pipeline
    seen = []
    original = type(pipeline).end_backward

    def end_backward(self, session):
        launched = sum(1 for b in self.buckets if b.state in (BucketState.IN_FLIGHT, BucketState.FOLDED))
        seen.append((launched, len(self.buckets)))
        return original(self, session)

    type(pipeline).end_backward = end_backward
    try:
        tokens, targets = make_batch(0, 0)
        engine.backward(lm_loss(engine(tokens, use_aux=True), targets))  # GAS 1: the boundary; every param used
    finally:
        type(pipeline).end_backward = original
        engine.destroy()
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_buckets_launch_during_backward(stage):
    (launched, total), = run_distributed(launched_before_epilogue, 2, args=(stage, ), timeout=60)[0]
    assert total >= 3 and launched >= 1, (launched, total)
