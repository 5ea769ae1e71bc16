# SPDX-License-Identifier: Apache-2.0
"""The audit's directions and numbers, against plain torch.

* :class:`DirectionStream` gives every element one value whatever range asks for it (ranges
  of a parameter drawn piecewise tile the values of the whole parameter exactly);
* on 2 ranks and stages 0-3, each direction's ``gradient_projection`` equals ``<g, d> / |d|``
  computed in plain torch from the contract's reference gradient and the same direction
  built whole, and ``directional_derivative`` (from the engine's forward passes) equals it
  up to the central difference's truncation.
"""

import math

import pytest
import torch

from deepspeed.runtime.audit.directions import DirectionStream, mix_seed
from tests.unit.common import run_distributed


def test_pieces_tile_the_whole_parameter():
    stream = DirectionStream(seed=7, chunk=10)
    numel = 37
    whole = stream.full(2, 5, numel)
    assert whole.shape == (numel, ) and whole.dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        start = int(torch.randint(0, numel, (1, ), generator=gen))
        length = int(torch.randint(0, numel - start + 1, (1, ), generator=gen))
        got = torch.cat([v for _, v in stream.pieces(2, 5, numel, start, length, "cpu")] or [torch.empty(0)])
        assert torch.equal(got, whole[start:start + length]), (start, length)
        offsets = [o for o, _ in stream.pieces(2, 5, numel, start, length, "cpu")]
        assert offsets == sorted(offsets)


def test_directions_differ_and_repeat():
    a = DirectionStream(seed=1).full(0, 0, 1000)
    assert torch.equal(a, DirectionStream(seed=1).full(0, 0, 1000))
    for other in (DirectionStream(seed=2).full(0, 0, 1000), DirectionStream(seed=1).full(1, 0, 1000),
                  DirectionStream(seed=1).full(0, 1, 1000)):
        assert not torch.equal(a, other)
    big = DirectionStream(seed=3, chunk=256).full(0, 0, 4096)
    assert abs(float(big.mean())) < 0.1 and abs(float(big.std()) - 1.0) < 0.1
    # chunks of one parameter are not copies of each other
    assert not torch.equal(big[:256], big[256:512])
    assert mix_seed(1, 2, 3) != mix_seed(1, 3, 2) and 0 <= mix_seed(1, 2, 3) < 2**63


def test_a_range_outside_the_parameter_is_an_error():
    with pytest.raises(ValueError, match="outside"):
        list(DirectionStream(0).pieces(0, 0, 10, 5, 6, "cpu"))


def projections(stage):
    """Worker: the audit's numbers for one window of the plain shape, and the same computed in plain torch."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.audit.report import relative_step
    from tests.unit.contract.models import ToyNet, lm_loss, make_batch
    from tests.unit.contract.runner import Reference, make_config
    from tests.unit.contract.shapes import SHAPES

    rank, world, gas = dist.get_rank(), dist.get_world_size(), 2
    torch.manual_seed(0)
    model = ToyNet()
    ref = Reference([model], torch.float32, [gas], world, 1.0)
    cell = dict(stage=stage, dtype="fp32", zero_extra={"stage3_param_persistence_threshold": 0})
    engine = deepspeed.initialize(model=model, config=make_config(cell, gas, SHAPES["plain"]))[0]
    try:
        batches = [make_batch(rank, t) for t in range(gas)]
        for t, (tokens, targets) in enumerate(batches):
            engine.backward(lm_loss(engine(tokens), targets))
            ref.micro_step(SHAPES["plain"], t)
            if t < gas - 1:
                engine.step()
        report = engine.audit_gradients(lambda e, b: lm_loss(e(b[0]), b[1]), batches, seed=11)
    finally:
        engine.destroy()

    # Plain torch: the same directions, built whole, and the reference window gradient.
    named = list(ref.models[0].named_parameters())
    values = [p.detach().float() for _, p in named]
    numel = sum(v.numel() for v in values)
    rms = math.sqrt(sum(float(v.double().square().sum()) for v in values) / numel)
    step = relative_step("fp32") * rms
    stream = DirectionStream(11)
    expected = []
    for k in range(len(report.directions)):
        dot = sq = 0.0
        for i, ((name, _), value) in enumerate(zip(named, values)):
            v = stream.full(k, i, value.numel()).view(value.shape)
            d = torch.add(value, v, alpha=step) - torch.add(value, v, alpha=-step)
            dot += float((ref.accum[0][name].double() * d.double()).sum())
            sq += float(d.double().square().sum())
        expected.append(dot / math.sqrt(sq))
    got = [(d.gradient_projection, d.directional_derivative) for d in report.directions]
    return got, expected, report.ok


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_numbers_match_plain_torch(stage):
    per_rank = run_distributed(projections, 2, args=(stage, ), timeout=60)
    got, expected, ok = per_rank[0]
    assert per_rank[1] == per_rank[0]
    assert ok
    for (projection, derivative), want in zip(got, expected):
        assert projection == pytest.approx(want, rel=1e-5, abs=1e-9)
        assert derivative == pytest.approx(want, rel=1e-2, abs=1e-6)


def test_the_forwards_precision_picks_the_defaults(monkeypatch):
    from deepspeed.runtime.audit.report import PRECISIONS, compute_precision, default_tolerance, relative_step
    assert [compute_precision(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == ["fp32", "fp16", "bf16"]
    assert default_tolerance("fp32") < default_tolerance("fp16") < default_tolerance("bf16")
    assert all(relative_step(p) > 0 for p in PRECISIONS)
    # fp32 weights on CUDA: the float32 matmul precision decides; convolutions follow cudnn's tf32 switch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # The tf32 switches are properties of torch's backend modules: set and restore them by hand (monkeypatch's
    # undo deletes attributes it did not find in the instance's __dict__, which these modules refuse).
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    linear, conv = torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Conv1d(1, 1, 1))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compute_precision(torch.float32, linear) == "fp32"
        assert compute_precision(torch.float32, conv) == "tf32"
        assert compute_precision(torch.bfloat16, conv) == "bf16"
        torch.set_float32_matmul_precision("high")
        assert compute_precision(torch.float32, linear) == "tf32"
        torch.set_float32_matmul_precision("medium")
        assert compute_precision(torch.float32, linear) == "bf16"
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
