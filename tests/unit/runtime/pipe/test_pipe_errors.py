# SPDX-License-Identifier: Apache-2.0
"""Bad input raises the same clear error on every rank before any stage waits on another, and training goes on
afterwards; a stage that fails in the middle of a batch makes the others fail within the configured wait."""

import time

import torch

from tests.unit.common import run_distributed
from tests.unit.harness import get_pool

WAIT_S = 3.0


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)]


def _cfg(**extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**6,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        }
    }
    cfg.update(extra)
    return cfg


def _batches(n, t=3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(2, t, 4, generator=g), torch.randn(2, t, 2, generator=g)) for _ in range(n)]


def _bad_inputs():
    import deepspeed
    from deepspeed.pipe import PipelineModule
    loss = torch.nn.functional.mse_loss
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except BaseException as exc:  # the same type and message are expected on every rank
            out[name] = f"{type(exc).__name__}: {exc}"

    attempt("stages-not-dividing", lambda: PipelineModule(_layers(), num_stages=3, loss_fn=loss))
    attempt("fewer-layers", lambda: PipelineModule(_layers()[:1], num_stages=2, loss_fn=loss))
    model = PipelineModule(_layers(), num_stages=2, loss_fn=loss, partition_method="uniform")
    attempt("batch-identity", lambda: deepspeed.initialize(model=model, config=_cfg(train_batch_size=6)))
    attempt(
        "zero3-zero-bubble", lambda: deepspeed.initialize(
            model=model, config=_cfg(zero_optimization={"stage": 3}, pipeline={"schedule": "zero_bubble"})))
    attempt(
        "interleaved-gas", lambda: deepspeed.initialize(
            model=model, config=_cfg(gradient_accumulation_steps=3, pipeline={"schedule": "interleaved_1f1b"})))
    attempt("unknown-key", lambda: deepspeed.initialize(model=model, config=_cfg(pipeline={"stagez": 2})))
    engine, *_ = deepspeed.initialize(model=model, config=_cfg())
    attempt("forward", lambda: engine(torch.ones(2, 4)))
    attempt("runs-out", lambda: engine.train_batch(iter(_batches(1))))
    attempt("no-labels", lambda: engine.train_batch(iter([(x, None) for x, _ in _batches(2)])))
    attempt("not-a-pair", lambda: engine.train_batch(iter([x for x, _ in _batches(2)])))
    # without dynamic_shape: micro-batches of another length are an error on both stages, before any payload moves
    mixed = _batches(1, t=3) + _batches(1, t=5)
    attempt("shape-changed", lambda: engine.train_batch(iter(mixed)))
    # the engine still trains: a good batch, then (after reset_activation_shape) one of another length
    first = float(engine.train_batch(iter(_batches(2))))
    engine.reset_activation_shape()
    second = float(engine.train_batch(iter(_batches(2, t=5))))
    engine.destroy()
    return out, first, second


def test_bad_input_raises_on_every_rank_and_training_goes_on():
    results = run_distributed(_bad_inputs, 2, timeout=180)
    (errors0, first0, second0), (errors1, first1, second1) = results
    expected = {
        "stages-not-dividing": "must divide distributed world size",
        "fewer-layers": "cannot be cut into 2 pipeline stages",
        "batch-identity": "train_batch_size",
        "zero3-zero-bubble": "ZeRO stage 3",
        "interleaved-gas": "multiple of 2",
        "unknown-key": "pipeline.stagez",
        "forward": "Only train_batch() is accessible",
        "runs-out": "ran out after 1 of the batch's 2 micro-batches",
        "no-labels": "has no labels",
        "not-a-pair": "not an (inputs, labels) pair",
        "shape-changed": "changed shape or dtype without dynamic_shape",
    }
    for name, needle in expected.items():
        assert needle in errors0[name], (name, errors0[name])
        assert errors0[name].split(":")[0] == errors1[name].split(":")[0], (name, errors0[name], errors1[name])
    # a data error names the stage that could not draw, on both ranks
    assert "rank 0 (stage 0)" in errors1["runs-out"] and "rank 1 (stage 1)" in errors0["runs-out"]
    assert first0 == first1 and second0 == second1 and first0 > 0 and second0 > 0


class _FailsOnce(torch.nn.Module):
    """A layer that raises in its forward at micro-batch ``when`` (counted on its rank)."""

    def __init__(self, when):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.when, self.calls = when, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            raise ValueError("bad activation in the middle stage")
        return self.fc(x)


def _middle_stage_fails():
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm import PeerFailureError
    from deepspeed.pipe import PipelineModule
    dist.set_failure_timeout(WAIT_S)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), _FailsOnce(when=3), torch.nn.Linear(4, 2)]
    model = PipelineModule(layers, num_stages=3, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=model, config=_cfg())
    started = time.monotonic()
    try:
        for _ in range(3):
            engine.train_batch(iter(_batches(2)))
        return "finished", 0.0
    except PeerFailureError as exc:
        return f"peer: {exc}", time.monotonic() - started
    except ValueError as exc:
        return f"own: {exc}", time.monotonic() - started
    finally:
        dist.set_failure_timeout(None)


def test_a_failing_stage_stops_the_others_in_bounded_time():
    try:
        results = run_distributed(_middle_stage_fails, 3, timeout=120)
    finally:
        get_pool(3).kill()  # the group was aborted: a fresh pool for the next test
    assert results[1][0].startswith("own: bad activation"), results
    for rank in (0, 2):
        message, waited = results[rank]
        assert message.startswith("peer:") and "rank 1" in message and "bad activation" in message, results
        assert waited < WAIT_S + 30, results
