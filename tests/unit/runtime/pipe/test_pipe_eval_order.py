# SPDX-License-Identifier: Apache-2.0
"""Evaluation and training in any order: ``eval_batch`` before, between and after ``train_batch`` calls, with
its own micro-batch count, at 2-4 stages, with and without ``dynamic_shape``. Every evaluation loss equals
plain torch's forward of the same micro-batches on the parameters of that moment, and every training step
equals plain torch's (``pipe_cases.Reference``), so an evaluation can neither break nor change training.

A stage's activations carry ``requires_grad`` in training and not in evaluation; the shape check compares
what a transfer's buffers depend on (count, dtypes and shapes), and when it raises it names what differs."""

import pytest
import torch

from tests.unit.common import run_distributed
from tests.unit.runtime.pipe.pipe_cases import Reference, batches, build_layers, config_of, loss_fn_of

W = [16, 8, 8, 8, 4]


def _reference_eval(reference, micro_batches):
    with torch.no_grad():
        return sum(float(reference.loss_fn(reference.forward(x), y)) for x, y in micro_batches) / len(micro_batches)


def _run(case, plan):
    """Run ``plan`` (a list of ``("train", None)`` / ``("eval", micro_batch_count)``) on the pipeline and on the
    reference; returns the largest relative loss difference and the pairs compared."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    layers = build_layers(case)
    reference = Reference(case, layers)
    model = PipelineModule(layers,
                           num_stages=case["stages"],
                           loss_fn=loss_fn_of(case),
                           dynamic_shape=case.get("dynamic_shape", False))
    engine, *_ = deepspeed.initialize(model=model, config=config_of(case))
    data = iter(batches(case, 64))
    worst, pairs = 0.0, []
    for kind, count in plan:
        if kind == "train":
            window = [next(data) for _ in range(case["gas"])]
            got = float(engine.train_batch(iter(window)))
            want = reference.step(window)
        else:
            window = [next(data) for _ in range(count)]
            got = float(engine.eval_batch(iter(window), num_micro_batches=count))
            want = _reference_eval(reference, window)
        pairs.append((kind, got, want))
        worst = max(worst, abs(got - want) / max(1e-6, abs(want)))
    engine.destroy()
    return worst, pairs


PLANS = {
    "eval-then-train": [("eval", 2), ("train", None), ("train", None)],
    "train-eval-train": [("train", None), ("eval", 2), ("train", None), ("eval", 2)],
    "eval-other-count": [("eval", 3), ("train", None), ("eval", 1), ("train", None)],
}
CASES = [
    ("eval-then-train", dict(world=2, stages=2, gas=2, widths=W)),
    ("train-eval-train", dict(world=3, stages=3, gas=2, widths=W, zero=1, optimizer="adam")),
    ("eval-other-count", dict(world=4, stages=4, gas=2, widths=W)),
    ("eval-then-train", dict(world=3, stages=3, gas=3, widths=W, dynamic_shape=True)),
    ("eval-other-count", dict(world=2, stages=2, gas=2, widths=W, dynamic_shape=True, zero=2)),
]


@pytest.mark.parametrize("plan,case",
                         CASES,
                         ids=[f"{p}-pp{c['stages']}{'-dyn' if c.get('dynamic_shape') else ''}" for p, c in CASES])
def test_eval_and_train_in_any_order(plan, case):
    results = run_distributed(_run, case["world"], args=(case, PLANS[plan]), timeout=180)
    for rank, (worst, pairs) in enumerate(results):
        assert worst < 1e-5, (plan, rank, pairs)


def _changing_width(case):
    """A first stage whose output width changes between two batches, without ``dynamic_shape``."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.p2p import PipelineShapeError
    layers = build_layers(case)
    model = PipelineModule(layers, num_stages=case["stages"], loss_fn=loss_fn_of(case))
    engine, *_ = deepspeed.initialize(model=model, config=config_of(case))
    g = torch.Generator().manual_seed(3)
    window = [(torch.randn(2, 16, generator=g), torch.randn(2, 4, generator=g)) for _ in range(case["gas"])]
    engine.train_batch(iter(window))
    wider = [(torch.randn(3, 16, generator=g), torch.randn(3, 4, generator=g)) for _ in range(case["gas"])]
    try:
        engine.eval_batch(iter(wider))
    except PipelineShapeError as err:
        return str(err)
    finally:
        engine.destroy()
    return None


def test_shape_error_names_what_differs():
    case = dict(world=2, stages=2, gas=2, widths=W)
    for message in run_distributed(_changing_width, 2, args=(case, ), timeout=120):
        assert message is not None
        assert "tensor 0" in message and "shape [3, 8]" in message and "[2, 8]" in message, message
