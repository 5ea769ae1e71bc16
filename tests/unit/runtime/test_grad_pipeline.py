# SPDX-License-Identifier: Apache-2.0
"""The gradient pipeline's states guard its hooks; a boundary step with nothing to step changes nothing."""

import pytest
import torch

from tests.unit.common import run_distributed


def _config(stage, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 0.1,
                "weight_decay": 0.1
            }
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.05,
                "warmup_max_lr": 0.1,
                "warmup_num_steps": 10
            }
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 16,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 50
        },
    }
    cfg.update(extra)
    return cfg


def wrong_state_hooks(stage):
    import deepspeed
    from deepspeed.runtime.zero.gradients.grad_pipeline import BucketState, PipelineStateError
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=ToyNet(), config=_config(stage))[0]
    pipeline = engine._stage.pipeline
    param = pipeline.params[0]
    messages = []
    try:
        # a gradient outside any backward of this engine
        with pytest.raises(PipelineStateError, match="no backward session") as err:
            pipeline.contribute(param, torch.ones(pipeline.slot(param).shape))
        messages.append(str(err.value))

        # a gradient for a bucket whose reduction is in flight, outside a pass: it would race with it
        tokens, targets = make_batch(0, 0)
        loss = lm_loss(engine(tokens), targets)
        original = type(pipeline).contribute

        def corrupting(self, p, g):
            self.slot(p).bucket.state = BucketState.IN_FLIGHT
            self._pass = None
            return original(self, p, g)

        type(pipeline).contribute = corrupting
        try:
            with pytest.raises(PipelineStateError, match="in flight"):
                engine.backward(loss)
        finally:
            type(pipeline).contribute = original
        engine.zero_grad()
        # the engine trains again after zero_grad()
        tokens, targets = make_batch(0, 1)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        assert engine.was_step_applied()
        assert all(b.state is BucketState.IDLE for b in pipeline.buckets)
    finally:
        engine.destroy()
    return messages


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hooks_respect_the_pipeline_state(stage):
    for messages in run_distributed(wrong_state_hooks, 2, args=(stage, ), timeout=60):
        assert "arrived while the pipeline is idle" in messages[0]


def empty_step(stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=ToyNet(), config=_config(stage))[0]
    try:
        tokens, targets = make_batch(0, 0)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()  # one real step: AdamW has moments to move from now on

        def snapshot():
            named = list(engine.module.named_parameters())
            return ({
                n: safe_get_full_fp32_param(p)
                for n, p in named
            }, {
                n: safe_get_full_optimizer_state(p, "exp_avg")
                for n, p in named
            }, engine.global_steps, engine.global_samples, engine.get_lr())

        before = snapshot()
        for _ in range(3):
            engine.step()  # no backward since the last step
            assert not engine.was_step_applied()
        after = snapshot()
        for a, b in zip(before[:2], after[:2]):
            for name in a:
                torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
        assert before[2:] == after[2:], (before[2:], after[2:])
        # the next real step is applied and moves the weights
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == before[2] + 1
        moved = snapshot()[0]
        assert any(not torch.equal(moved[n], after[0][n]) for n in moved)
    finally:
        engine.destroy()
    return True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_backward_changes_nothing(stage):
    assert run_distributed(empty_step, 2, args=(stage, ), timeout=60) == [True, True]


def local_pieces(stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=ToyNet(), config=_config(stage))[0]
    try:
        tokens, targets = make_batch(0, 0)
        engine.backward(lm_loss(engine(tokens, use_aux=True), targets))
        stage_obj = engine._stage
        covered = {}
        for param in stage_obj.params:
            start, length = stage_obj.local_range(param)
            full = safe_get_full_grad(param).reshape(-1)
            torch.testing.assert_close(stage_obj.local_grad(param).reshape(-1)[:length], full[start:start + length])
            value = safe_get_full_fp32_param(param).reshape(-1)
            torch.testing.assert_close(
                stage_obj.local_fp32_param(param).reshape(-1)[:length], value[start:start + length])
            covered[tuple(param.shape) if stage != 3 else tuple(param.ds_shape)] = (start, length, full.numel())
    finally:
        engine.destroy()
    return covered


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_local_range_matches_the_full_gradient(stage):
    """``local_range`` names the piece of each parameter a rank holds; over the ranks the pieces tile it."""
    per_rank = run_distributed(local_pieces, 3, args=(stage, ), timeout=60)
    for key in per_rank[0]:
        pieces = sorted((r[key][0], r[key][1]) for r in per_rank if r[key][1] > 0)
        numel = per_rank[0][key][2]
        if stage == 0:
            assert all(p == (0, numel) for p in pieces)
        else:
            at = 0
            for start, length in pieces:
                assert start == at, (key, pieces)
                at += length
            assert at == numel, (key, pieces)
