# SPDX-License-Identifier: Apache-2.0
"""Behaviours upstream documents and its tests expect: ignore_unused_parameters, checkpoint.tag_validation,
OneCycle's step sizes, step()/no_sync()/coalesce_grad_reduction() nesting, buffer dtypes under bf16."""

import logging

import pytest
import torch

from tests.unit.common import run_distributed


class TwoBranch(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(3, 2)
        self.spare = torch.nn.Linear(3, 2)

    def forward(self, x, use_spare=False):
        out = self.used(x)
        return out + self.spare(x) if use_spare else out


def _config(stage, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # yapf: disable
    cfg["zero_optimization"].update(extra)
    return cfg


def unused_worker(stage, ignore, spare_on):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.engine_parts.unused_parameters import UnusedParametersError
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=TwoBranch(), config=_config(stage, ignore_unused_parameters=ignore))[0]
    x = torch.randn(2, 3)
    engine.backward(engine(x, use_spare=dist.get_rank() in spare_on).sum())
    try:
        engine.step()
        outcome = "stepped"
    except UnusedParametersError as err:
        assert isinstance(err, AssertionError) and "ignore_unused_parameters" in str(err)
        outcome = str(err)
    engine.destroy()
    return outcome


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_parameter_raises_on_every_rank(stage):
    outcomes = run_distributed(unused_worker, 2, args=(stage, False, ()), timeout=90)
    assert all("spare.weight" in o and "spare.bias" in o and "ranks 0, 1" in o for o in outcomes), outcomes
    assert "used.weight" not in outcomes[0]


def test_unused_parameter_on_one_rank_raises_on_both():
    outcomes = run_distributed(unused_worker, 2, args=(2, False, (0, )), timeout=90)
    assert all("spare.weight (rank 1)" in o for o in outcomes), outcomes


@pytest.mark.parametrize("stage", [1, 3])
def test_unused_parameter_ignored_by_default(stage):
    assert run_distributed(unused_worker, 2, args=(stage, True, ()), timeout=90) == ["stepped"] * 2


def tag_worker(mode, tmp):
    import os

    import deepspeed
    import deepspeed.comm as dist
    records = []

    class Keep(logging.Handler):

        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("DeepSpeed").addHandler(handler)
    try:
        cfg = _config(1)
        cfg["checkpoint"] = {"tag_validation": mode}
        engine = deepspeed.initialize(model=TwoBranch(), config=cfg)[0]
        tag = f"tag-{dist.get_rank()}"
        try:
            engine.save_checkpoint(tmp, tag=tag)
            result = "saved" if os.path.isdir(os.path.join(tmp, tag)) else "missing"
        except AssertionError as err:
            result = "raised: " + str(err)
        engine.destroy()
    finally:
        logging.getLogger("DeepSpeed").removeHandler(handler)
    warned = any("not consistent across ranks" in r for r in records)
    return result, warned


@pytest.mark.parametrize("mode,expected", [("WARN", ("saved", True)), ("IGNORE", ("saved", False))])
def test_tag_validation_warn_and_ignore(tmp_path, mode, expected):
    assert run_distributed(tag_worker, 2, args=(mode, str(tmp_path)), timeout=90) == [expected] * 2


def test_tag_validation_fail(tmp_path):
    results = run_distributed(tag_worker, 2, args=("FAIL", str(tmp_path)), timeout=90)
    assert all(r.startswith("raised") and "tag-0" in r and "tag-1" in r for r, _ in results), results
    assert not (tmp_path / "tag-0").exists()


def test_unknown_tag_validation_is_a_config_error():
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    with pytest.raises(DeepSpeedConfigError, match="tag_validation"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "foo"}})


@pytest.mark.parametrize("first,second", [(0, None), (-5, None), (10, -1)])
def test_one_cycle_rejects_non_positive_step_sizes(first, second):
    from deepspeed.runtime.lr_schedules import OneCycle
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match="step_size"):
        OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=first, cycle_second_step_size=second)
    OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10, cycle_second_step_size=0)


def nesting_worker(stage):
    import deepspeed
    engine = deepspeed.initialize(model=TwoBranch(), config=_config(stage))[0]
    x = torch.randn(2, 3)
    errors = []

    def expect(fn, words):
        try:
            fn()
        except AssertionError as err:
            errors.append(words in str(err))
        else:
            errors.append(False)

    def step_in(context):
        with context():
            engine.backward(engine(x).sum())
            engine.step()

    def nested(outer, inner):
        with outer():
            with inner():
                pass

    if stage < 2:
        expect(lambda: step_in(engine.no_sync), "illegal to call Engine.step() inside no_sync")
        expect(lambda: nested(engine.no_sync, engine.no_sync), "reentry")
        expect(lambda: nested(engine.coalesce_grad_reduction, engine.no_sync), "reentry")
        expect(lambda: nested(engine.no_sync, engine.coalesce_grad_reduction), "cannot be nested")
    expect(lambda: step_in(engine.coalesce_grad_reduction), "illegal to call Engine.step() inside no_sync")
    expect(lambda: nested(engine.coalesce_grad_reduction, engine.coalesce_grad_reduction), "cannot be nested")
    # the engine still trains after the refused calls
    engine.zero_grad()
    engine.backward(engine(x).sum())
    engine.step()
    applied = engine.was_step_applied()
    engine.destroy()
    return all(errors) and applied


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_step_and_nesting_inside_no_sync_are_errors(stage):
    assert run_distributed(nesting_worker, 1, args=(stage, ), timeout=60) == [True]


class WithBuffers(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 4))
        self.register_buffer("positions", torch.arange(4))

    def forward(self, x):
        return self.proj(x * self.inv_freq.to(x.dtype))


def buffer_worker(precision, buffer_dtype, stage):
    import deepspeed
    cfg = _config(stage)
    cfg[precision] = {"enabled": True}
    if buffer_dtype:
        cfg["data_types"] = {"buffer_dtype": buffer_dtype}
    torch.manual_seed(0)
    engine = deepspeed.initialize(model=WithBuffers(), config=cfg)[0]
    dtypes = (engine.module.proj.weight.dtype, engine.module.inv_freq.dtype, engine.module.positions.dtype)
    values = engine.module.inv_freq.float()
    engine.backward(engine(torch.randn(2, 4).to(dtypes[0])).float().sum())
    engine.step()
    engine.destroy()
    return [str(d) for d in dtypes], bool(torch.allclose(values, torch.linspace(0.1, 1.0, 4), atol=1e-2))


@pytest.mark.parametrize("precision,buffer_dtype,stage,expected", [
    ("bf16", None, 0, ["torch.bfloat16", "torch.float32", "torch.int64"]),
    ("bf16", None, 3, ["torch.bfloat16", "torch.float32", "torch.int64"]),
    ("fp16", None, 1, ["torch.float16", "torch.float32", "torch.int64"]),
    ("bf16", "bf16", 0, ["torch.bfloat16", "torch.bfloat16", "torch.int64"]),
    ("bf16", "fp16", 2, ["torch.bfloat16", "torch.float16", "torch.int64"]),
])
def test_buffers_keep_their_dtype_unless_buffer_dtype(precision, buffer_dtype, stage, expected):
    assert run_distributed(buffer_worker, 1, args=(precision, buffer_dtype, stage), timeout=60) == [(expected, True)]


def _initialize_from_deepscale_config(path):
    import argparse

    import deepspeed
    args = argparse.Namespace(deepscale_config=path, local_rank=0)
    model = torch.nn.Linear(3, 2)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    x = torch.ones(1, 3)
    engine.backward(engine(x).sum())
    engine.step()
    result = (engine.train_micro_batch_size_per_gpu(), type(engine.basic_optimizer).__name__)
    engine.destroy()
    return result


def test_deprecated_deepscale_config_argument(tmp_path):
    """Upstream still reads ``args.deepscale_config`` (the old name of ``args.deepspeed_config``)."""
    import json
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "SGD",
                "params": {
                    "lr": 0.1
                }
            }
        }))
    assert run_distributed(_initialize_from_deepscale_config, 2, args=(str(path), ), timeout=60) == [(1, "SGD")] * 2
