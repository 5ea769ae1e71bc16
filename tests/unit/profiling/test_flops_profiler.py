# SPDX-License-Identifier: Apache-2.0
"""The flops profiler: a Linear layer of a batch costs 2 x in x out x batch flops; the engine reports its
``profile_step`` on rank 0 only, with the achieved FLOP/s of the step."""

import os

import pytest
import torch

from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from tests.unit.common import run_distributed

TIMEOUT_S = 90
SIZES = (6, 10, 4, 3)  # in -> hidden -> hidden -> out
BATCH = 5


def linear_stack():
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def expected_layer_flops(batch):
    return [2 * fan_in * fan_out * batch for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:])]


def test_get_model_profile_of_a_linear_stack(capsys):
    model = linear_stack()
    flops, macs, params = get_model_profile(model, input_shape=(BATCH, SIZES[0]), as_string=False, print_profile=True)
    assert flops == sum(expected_layer_flops(BATCH)) and macs == flops // 2
    assert params == sum(p.numel() for p in model.parameters())
    out = capsys.readouterr().out
    assert "DeepSpeed Flops Profiler" in out and "(0): Linear(" in out and "in_features=6" in out
    as_strings = get_model_profile(model, args=[torch.zeros(BATCH, SIZES[0])], print_profile=False)
    assert as_strings[0].endswith("FLOPS") and as_strings[1].endswith("MACs")


def test_per_module_flops_params_and_calls():
    model = linear_stack()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    model(torch.randn(BATCH, SIZES[0]))
    model(torch.randn(2 * BATCH, SIZES[0]))  # results accumulate over profiled forwards
    profiler.stop_profile()
    model(torch.randn(BATCH, SIZES[0])).sum().backward()  # not profiled
    records = profiler.module_profiles()
    for index, (flops_a, flops_b) in enumerate(zip(expected_layer_flops(BATCH), expected_layer_flops(2 * BATCH))):
        record = records[str(2 * index)]
        assert record.module_type == "Linear" and record.calls == 2 and record.depth == 1
        assert record.flops == flops_a + flops_b
        fan_in, fan_out = SIZES[index], SIZES[index + 1]
        assert record.params == fan_in * fan_out + fan_out
        assert record.latency_s > 0
    assert records["1"].flops == 0  # ReLU: no flops in torch's formulas
    assert records[""].flops == profiler.get_total_flops() == sum(expected_layer_flops(3 * BATCH))
    profiler.end_profile()
    assert profiler.module_profiles() == {}


def test_a_module_used_twice_counts_both_calls():

    class Twice(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.layer(self.layer(x))

    model = Twice()
    flops, _, _ = get_model_profile(model, input_shape=(3, 4), as_string=False, print_profile=False)
    assert flops == 2 * (2 * 4 * 4 * 3)


def engine_profile_run(root, gas, profile_step):
    import deepspeed
    import deepspeed.comm as dist
    rank = dist.get_rank()
    output_file = os.path.join(root, f"profile_rank{rank}.txt")
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.01
            }
        },
        "zero_optimization": {
            "stage": 1
        },
        "flops_profiler": {
            "enabled": True,
            "profile_step": profile_step,
            "module_depth": 1,
            "top_modules": 2,
            "output_file": output_file
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=linear_stack(), config=config)
    for _ in range(profile_step + 2):
        for _ in range(gas):
            engine.backward(engine(torch.randn(BATCH, SIZES[0])).square().mean())
            engine.step()
    profile = engine.flops_profiler.last_profile
    engine.destroy()
    dist.barrier()
    text = open(output_file).read() if os.path.exists(output_file) else None
    return profile, text


@pytest.mark.parametrize("gas, profile_step", [(1, 1), (2, 0)])
def test_engine_profiles_its_profile_step_on_rank0(tmp_path, gas, profile_step):
    (profile, text), (profile1, text1) = run_distributed(engine_profile_run,
                                                         2,
                                                         args=(str(tmp_path), gas, profile_step),
                                                         timeout=TIMEOUT_S)
    assert profile1 is None and text1 is None, "only rank 0 profiles"
    assert profile["step"] == profile_step and profile["forward_calls"] == gas
    layer_flops = [gas * f for f in expected_layer_flops(BATCH)]
    assert [profile["modules"][str(2 * i)].flops for i in range(len(layer_flops))] == layer_flops
    assert profile["fwd_flops"] == sum(layer_flops) and profile["bwd_flops"] == 2 * sum(layer_flops)
    assert profile["micro_batch_size"] == BATCH and profile["world_size"] == 2
    iteration = profile["iter_latency_s"]
    assert iteration >= profile["fwd_latency_s"] + profile["bwd_latency_s"] + profile["step_latency_s"] > 0
    assert profile["flops_per_s"] == pytest.approx(3 * sum(layer_flops) / iteration)
    assert f"Profile Summary at step {profile_step}" in text and "achieved TFLOP/s per GPU" in text
    assert "(0): Linear(" in text and "Top 2 modules" in text
