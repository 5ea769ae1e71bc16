# SPDX-License-Identifier: Apache-2.0
"""The audit does not disturb training, and bad calls raise the same error on every rank.

* Training with an audit at every boundary (a model with dropout, so the random generators
  matter) ends with the same weights, bit for bit, and the same generator state as the same
  training without audits, on stages 0-3.
* Errors: an audit with no backward in the window, a different number of micro-batches on
  one rank, a loss function that does not return a scalar or raises, bad arguments, an
  engine without an optimizer; after each the engine still trains and the model is as it was.
* fp16: an overflowing window gradient is reported as skipped, not as a mismatch.
"""

import pytest
import torch

from tests.unit.common import run_distributed

GAS = 2


def _model():
    from tests.unit.contract.models import ToyNet

    class DropNet(ToyNet):

        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, tokens):
            return self.head(self.drop(self.body(self.emb(tokens))))

    torch.manual_seed(0)
    return DropNet()


def _engine(stage, dtype="fp32", model=None, optimizer=True):
    import deepspeed
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1e9,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 64,
            "stage3_param_persistence_threshold": 0
        }
    }
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01}}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return deepspeed.initialize(model=model or _model(), config=config)[0]


def _loss(engine, batch):
    from tests.unit.contract.models import lm_loss
    return lm_loss(engine(batch[0]), batch[1])


def train(stage, audit):
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from tests.unit.contract.models import make_batch
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # the dropout masks differ by rank, as in a real job
    engine = _engine(stage)
    reports = []
    try:
        for step in range(3):
            batches = [make_batch(rank, step * GAS + t) for t in range(GAS)]
            for t, batch in enumerate(batches):
                engine.backward(_loss(engine, batch))
                if t == GAS - 1 and audit:
                    reports.append(engine.audit_gradients(_loss, batches).max_rel_error)
                engine.step()
        weights = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
        return weights, torch.get_rng_state(), torch.rand(4), reports
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_is_the_same_with_and_without_audits(stage):
    plain = run_distributed(train, 2, args=(stage, False), timeout=90)
    audited = run_distributed(train, 2, args=(stage, True), timeout=90)
    assert audited[0][3] and audited[0][3] == audited[1][3]  # audits ran, with one report on every rank
    for rank in range(2):
        for a, b in zip(plain[rank][0], audited[rank][0]):
            assert torch.equal(a, b), "an audit changed the training's weights"
        assert torch.equal(plain[rank][1], audited[rank][1]), "an audit changed the random generator's state"
        assert torch.equal(plain[rank][2], audited[rank][2])


def _catch(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the test compares the error's type and message on every rank
        return type(err).__name__, str(err)
    return None


def errors(stage):
    import deepspeed.comm as dist
    from tests.unit.audit.harness import assert_same, snapshot
    from tests.unit.contract.models import make_batch
    rank = dist.get_rank()
    engine = _engine(stage, model=_plain_model())
    out = {}
    try:
        batches = [make_batch(rank, t) for t in range(GAS)]
        out["no_backward"] = _catch(engine.audit_gradients, _loss, batches)
        for t, batch in enumerate(batches):
            engine.backward(_loss(engine, batch))
            if t < GAS - 1:
                engine.step()
        before = snapshot(engine)
        out["count"] = _catch(engine.audit_gradients, _loss, batches[:1] if rank == 1 else batches)
        out["empty"] = _catch(engine.audit_gradients, _loss, [])
        out["not_scalar"] = _catch(engine.audit_gradients, lambda e, b: e(b[0]), batches)
        out["raises"] = _catch(engine.audit_gradients, lambda e, b: 1 / 0, batches)
        out["not_callable"] = _catch(engine.audit_gradients, "loss", batches)
        out["directions"] = _catch(engine.audit_gradients, _loss, batches, directions=0)
        out["tolerance"] = _catch(engine.audit_gradients, _loss, batches, tolerance=-1.0)
        out["group_by"] = _catch(engine.audit_gradients, _loss, batches, group_by="module")
        assert_same(before, snapshot(engine), f"rank {rank}")
        assert engine.audit_gradients(_loss, batches).ok  # the engine audits and trains on
        engine.step()
        assert engine.was_step_applied()
    finally:
        engine.destroy()
    bare = _engine(stage, model=_plain_model(), optimizer=False)
    try:
        out["no_optimizer"] = _catch(bare.audit_gradients, _loss, batches)
    finally:
        bare.destroy()
    return out


def _plain_model():
    from tests.unit.contract.models import ToyNet
    torch.manual_seed(0)
    return ToyNet()


EXPECTED_ERRORS = {
    "no_backward": ("RuntimeError", "no backward reached this engine"),
    "count": ("ValueError", "passed [2, 1] micro-batches"),
    "empty": ("ValueError", "micro_batches is empty"),
    "not_scalar": ("TypeError", "must return a scalar tensor"),
    "raises": ("ZeroDivisionError", "division by zero"),
    "not_callable": ("TypeError", "loss_fn must be a callable"),
    "directions": ("ValueError", "directions must be an integer"),
    "tolerance": ("ValueError", "tolerance must be a positive number"),
    "group_by": ("TypeError", "group_by must be None or a callable"),
    "no_optimizer": ("RuntimeError", "needs an engine with an optimizer"),
}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bad_calls_raise_on_every_rank(stage):
    per_rank = run_distributed(errors, 2, args=(stage, ), timeout=90)
    assert per_rank[0] == per_rank[1]
    for case, (kind, needle) in EXPECTED_ERRORS.items():
        got = per_rank[0][case]
        assert got is not None and got[0] == kind and needle in got[1], (case, got)


def overflow(stage):
    import deepspeed.comm as dist
    from deepspeed.utils import safe_set_full_grad
    from tests.unit.audit.harness import report_tuple
    from tests.unit.contract.models import make_batch
    rank = dist.get_rank()
    engine = _engine(stage, dtype="fp16", model=_plain_model())
    try:
        batches = [make_batch(rank, t) for t in range(GAS)]
        for t, batch in enumerate(batches):
            engine.backward(_loss(engine, batch))
            if t < GAS - 1:
                engine.step()
        param = next(iter(engine.module.parameters()))
        shape = tuple(getattr(param, "ds_shape", param.shape))
        safe_set_full_grad(param, torch.full(shape, float("inf")))
        report = engine.audit_gradients(_loss, batches)
        engine.step()
        return report_tuple(report), engine.was_step_applied()
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_overflow_is_skipped_not_a_mismatch(stage):
    per_rank = run_distributed(overflow, 2, args=(stage, ), timeout=60)
    assert per_rank[0] == per_rank[1]
    (ok, _, rel, _, _, skipped), applied = per_rank[0]
    assert ok and rel == () and "overflowed" in skipped
    assert not applied
