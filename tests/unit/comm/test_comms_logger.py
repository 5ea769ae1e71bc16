# SPDX-License-Identifier: Apache-2.0
"""The comms logger: what a ZeRO-2 step communicates, counted and sized from the model's layout; bandwidths."""

import pytest
import torch

from deepspeed.utils.comms_logging import CommsLogger, calc_bw_log, convert_size, trim_mean
from tests.unit.common import run_distributed

TIMEOUT_S = 90
LAYERS, WIDTH, MICRO, GAS, STEPS = 3, 8, 4, 2, 2
FP32 = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def zero2_run(prof_ops):
    import deepspeed
    import deepspeed.comm as dist
    layer = WIDTH * WIDTH + WIDTH
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        # one bucket per layer: the layout cuts buckets of at most reduce_bucket_size elements
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": layer
        },
        "comms_logger": {
            "enabled": True,
            "prof_all": prof_ops is None,
            "prof_ops": prof_ops or []
        },
    }
    logger = dist.comms_logger
    logger.reset_data()  # the worker process may have logged in an earlier test
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    at_init = logger.get_raw_data()
    logger.reset_data()
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        for _ in range(GAS):
            engine.backward(engine(torch.randn(MICRO, WIDTH, generator=gen)).square().mean())
            engine.step()
    counts = {
        name: {
            size: record[0]
            for size, record in by_size.items()
        }
        for name, by_size in logger.comms_dict.items()
    }
    summary = dist.log_summary(return_dict=True)
    engine.destroy()
    dist.configure(enabled=False)
    return at_init, counts, summary


def test_zero2_step_collectives_are_counted():
    world = 2
    at_init, counts, summary = run_distributed(zero2_run, world, args=(None, ), timeout=TIMEOUT_S)[0]
    layer = WIDTH * WIDTH + WIDTH
    # initialize broadcasts every parameter from rank 0
    assert sum(at_init["broadcast"][s][0] for s in at_init["broadcast"]) == 2 * LAYERS
    assert set(at_init["broadcast"]) == {WIDTH * WIDTH * FP32, WIDTH * FP32}
    # stage 2 reduce-scatters every bucket (one per layer, padded to the world size) in every backward
    padded = -(-layer // world) * world
    assert counts["reduce_scatter_tensor"] == {padded * FP32: LAYERS * GAS * STEPS}
    # after each optimizer step, each bucket's updated chunk (this rank's 1/world of it) is all-gathered
    assert counts["all_gather_into_tensor"] == {padded // world * FP32: LAYERS * STEPS}
    # the global norm: one fp32 scalar summed over the ranks per step
    assert counts["all_reduce"] == {FP32: STEPS}
    records = summary["summary"]["reduce_scatter_tensor"][padded * FP32]
    assert records["count"] == LAYERS * GAS * STEPS and records["msg_size_bytes"] == padded * FP32
    assert records["total_latency_ms"] > 0 and records["busbw_avg_gbps"] == pytest.approx(
        records["tput_avg_gbps"] * (world - 1) / world, rel=0.3)
    assert summary["metadata"]["world_size"] == world


def test_prof_ops_selects_collectives():
    at_init, counts, _ = run_distributed(zero2_run, 2, args=(["all_gather_into_tensor"], ), timeout=TIMEOUT_S)[0]
    assert set(counts) == {"all_gather_into_tensor"} and at_init == {}


@pytest.mark.parametrize("op, size, ms, world, algbw, busbw", [
    ("all_reduce", 1000, 1.0, 4, 2 * 1000 * 8 / 1e6, 2 * 1000 * 8 / 1e6 * 3 / 4),
    ("all_gather_into_tensor", 1000, 2.0, 4, 4 * 1000 / 2.0 * 8 / 1e6, 4 * 1000 / 2.0 * 8 / 1e6 * 3 / 4),
    ("reduce_scatter_tensor", 4000, 2.0, 4, 4000 / 2.0 * 8 / 1e6, 4000 / 2.0 * 8 / 1e6 * 3 / 4),
    ("broadcast", 500, 0.5, 8, 500 / 0.5 * 8 / 1e6, 500 / 0.5 * 8 / 1e6),
])
def test_bandwidth_rules(op, size, ms, world, algbw, busbw):
    # bytes/ms * 8 bits / 1e6 = Gbit/s
    assert calc_bw_log(op, size, ms, world_size=world) == pytest.approx((algbw, busbw))


def test_records_and_summary(capsys):
    logger = CommsLogger()
    for latency in (1.0, 2.0, 3.0):
        logger.append("all_reduce", "all_reduce", latency, 1024)
    logger.append("all_reduce", "all_reduce", 5.0, 2048)
    assert logger.get_total_operations() == 4 and logger.get_operation_names() == ["all_reduce"]
    summary = logger.get_operation_summary("all_reduce")
    assert summary[1024]["count"] == 3 and summary[1024]["total_latency_ms"] == 6.0
    assert summary[1024]["avg_latency_ms"] == pytest.approx(2.0) and summary[2048]["msg_size_str"] == "2.0 KB"
    logger.log_all(print_log=True)
    out = capsys.readouterr().out
    assert "Comm. Op" in out and "all_reduce" in out and "1.0 KB" in out
    assert convert_size(0) == "0B" and convert_size(1536) == "1.5 KB"
    assert trim_mean([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0]) == 1.0
