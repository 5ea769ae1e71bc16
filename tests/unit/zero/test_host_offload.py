# SPDX-License-Identifier: Apache-2.0
"""The host side of offload, piece by piece: the folder, the worker, the parallel reductions, the config keys.

On a machine without CUDA the device-to-host copies are plain copies, but the ordering logic (first
fold copies, later folds add on the worker thread through a bounded ring, settle, lazy zeroing) is
the one the GPU runs; ``tests/gpu/test_offload_paths.py`` checks the stream path against the plain
one on a GPU.
"""

import pytest
import torch

from deepspeed.runtime.zero.offload import host_math
from deepspeed.runtime.zero.offload.host_fold import HostFolder
from deepspeed.runtime.zero.offload.host_worker import HostWorker


def test_folder_copies_first_adds_after_and_zeroes_unwritten_pieces():
    part = torch.full((10, ), 123.0)  # stale values of a previous window
    pieces = [part.narrow(0, 0, 4), part.narrow(0, 4, 3), part.narrow(0, 7, 3)]
    folder = HostFolder("cpu", ring_count=2, ring_numel=2, threads=2)  # chunks split over a tiny ring
    for piece in pieces:
        folder.register(piece)
    a, b = torch.arange(4.0), torch.arange(3.0) + 10
    folder.fold(pieces[0], a)
    folder.fold(pieces[1], b)
    folder.fold(pieces[0], a)  # a second contribution to the same piece adds
    a.fill_(-1.0)  # the caller may reuse its chunk as soon as fold returns
    folder.settle()
    torch.testing.assert_close(part[:4], 2 * torch.arange(4.0))
    torch.testing.assert_close(part[4:7], torch.arange(3.0) + 10)
    torch.testing.assert_close(part[7:], torch.zeros(3))  # never folded in this window: zero, not stale
    folder.new_window()
    folder.fold(pieces[1], torch.ones(3))
    folder.settle()
    torch.testing.assert_close(part, torch.cat([torch.zeros(4), torch.ones(3), torch.zeros(3)]))
    folder.close()


def test_folder_converts_dtypes():
    part = torch.zeros(6)
    folder = HostFolder("cpu", threads=1)
    folder.register(part)
    chunk = torch.tensor([1.5, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    folder.fold(part, chunk)
    folder.fold(part, chunk)
    folder.settle()
    torch.testing.assert_close(part, 2 * chunk.float())
    folder.close()


def test_worker_runs_in_order_and_reports_errors():
    worker = HostWorker("test", threads=1)
    seen = []
    tasks = [worker.submit(lambda i=i: seen.append(i)) for i in range(5)]
    tasks[-1].synchronize()
    assert seen == list(range(5))
    worker.submit(lambda: 1 / 0)
    after = worker.submit(lambda: seen.append("after"))
    with pytest.raises(ZeroDivisionError):
        worker.drain()
    assert after.done() and seen[-1] == "after"  # later tasks still ran
    worker.close()


def test_parallel_reductions_match_torch(monkeypatch):
    monkeypatch.setattr(host_math, "PARALLEL_MIN", 1000)
    monkeypatch.setattr(host_math, "CHUNK", 777)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5000, generator=gen), torch.randn(3, 900, generator=gen)]
    expected = sum(float(t.double().pow(2).sum()) for t in tensors)
    assert abs(host_math.sum_of_squares(tensors) - expected) <= 1e-5 * expected
    block = torch.randn(40, 50, generator=gen)
    out = torch.empty(40)
    host_math.row_sq_norms(block, out)
    torch.testing.assert_close(out, block.pow(2).sum(1))
    tensors[0][1234] = float("inf")
    assert host_math.sum_of_squares(tensors) == float("inf")
    tensors[0][1234] = float("nan")
    assert host_math.sum_of_squares(tensors) != host_math.sum_of_squares(tensors)  # nan


def test_offload_keys_reach_the_stage_config():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.stages import StageConfig
    cfg = DeepSpeedConfig({
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "cpu",
                "pin_memory": True,
                "ratio": 0.25,
                "cpuadam_cores_perc": 0.5
            },
            "offload_param": {
                "device": "cpu",
                "pin_memory": True,
                "buffer_count": 3,
                "buffer_size": 1000
            }
        }
    })
    stage = StageConfig.from_ds_config(cfg, torch.bfloat16)
    assert stage.offload_optimizer == "cpu" and stage.offload_param == "cpu" and stage.pin_memory
    assert stage.cpu_cores_perc == 0.5 and stage.offload_ratio == 0.25
    assert stage.param_pin_memory and stage.param_buffer_count == 3 and stage.param_buffer_numel == 1000


@pytest.mark.parametrize("name", ["ds_config_zero2_cpu_offload", "ds_config_zero3_cpu_offload", "ds_config_zenflow"])
def test_example_configs_parse(name):
    import os
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.stages import StageConfig
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    cfg = DeepSpeedConfig(os.path.join(root, "examples", "offload", f"{name}.json"))
    stage = StageConfig.from_ds_config(cfg, torch.bfloat16)
    assert stage.offload_optimizer == "cpu" and stage.pin_memory
    assert (stage.zenflow is not None) == (name == "ds_config_zenflow")
