# SPDX-License-Identifier: Apache-2.0
"""``wall_clock_breakdown`` and the ``steps_per_print`` progress line; no device synchronisation when it is off."""

import logging
import os
import time

import pytest

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.runtime.engine_parts.timers import EngineTimers
from deepspeed.utils.timer import BACKWARD_GLOBAL_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER, OPTIMIZER_ALLGATHER_TIMER
from tests.unit.common import run_distributed
from tests.unit.monitor import training as T

TIMEOUT_S = 90


class _Records(logging.Handler):

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def breakdown_run(root):
    import deepspeed.comm as dist
    from deepspeed.utils.logging import logger
    rank = dist.get_rank()
    handler = _Records()
    logger.addHandler(handler)
    windows = []
    config = T.base_config(wall_clock_breakdown=True,
                           steps_per_print=2,
                           zero_optimization={"stage": 1},
                           csv_monitor={
                               "enabled": True,
                               "output_path": root,
                               "job_name": "job"
                           })
    try:
        engine = T.train_engine(config, 4, rank, after_step=lambda e: windows.append(e.get_wall_clock_timers()))
        engine.destroy()
    finally:
        logger.removeHandler(handler)
    dist.barrier()
    return windows, handler.messages, (T.read_csv_dir(os.path.join(root, "job")) if rank == 0 else None)


def test_wall_clock_breakdown(tmp_path):
    (windows, messages, csv), (_, messages1, _) = run_distributed(breakdown_run,
                                                                  2,
                                                                  args=(str(tmp_path), ),
                                                                  timeout=TIMEOUT_S)
    assert len(windows) == 4
    for window in windows:
        assert {"fwd", "bwd", "bwd_inner", "step"} <= set(window), window
        # the stage times its own phases: the reduction waited for in backward and the step's parts
        assert {"bwd_allreduce", "optimizer_gradients", "optimizer_step", "optimizer_allgather"} <= set(window), window
        assert all(ms > 0 for name, ms in window.items() if name != "bwd_allreduce"), window
        assert window["bwd_inner"] == pytest.approx(window["bwd"] - window.get("bwd_allreduce", 0.0))
    micro = [m for m in messages if m.startswith("time (ms) | fwd_microstep")]
    per_step = [m for m in messages if m.startswith("time (ms) | fwd:")]
    progress = [m for m in messages if m.startswith("step=")]
    assert len(micro) == len(per_step) == len(progress) == 2, messages  # steps 2 and 4
    assert progress[0].startswith("step=2, skipped=0, lr=[") and "samples/s=" in progress[0]
    assert "bwd_inner_microstep" in micro[0] and "step_microstep" in micro[0]
    assert not [m for m in messages1 if m.startswith(("time (ms)", "step="))], "only rank 0 logs"
    # the per-step line is the mean of the windows since the previous line
    logged_fwd = float(per_step[1].split("fwd: ")[1].split()[0])
    assert logged_fwd == pytest.approx((windows[2]["fwd"] + windows[3]["fwd"]) / 2, abs=0.01)
    batch = T.MICRO * T.GAS * T.WORLD
    for event, timer in (("forward", "fwd"), ("backward", "bwd"), ("backward_inner", "bwd_inner"), ("step", "step")):
        header, rows = csv[f"Train_Samples_elapsed_time_ms_{event}.csv"]
        assert [s for s, _ in rows] == [(k + 1) * batch for k in range(4)]
        assert [v for _, v in rows] == pytest.approx([w[timer] for w in windows], rel=1e-6)


def sync_count_run(wall_clock):
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    calls = []
    original = accelerator.synchronize
    accelerator.synchronize = lambda *args, **kwargs: calls.append(1)
    try:
        config = T.base_config(wall_clock_breakdown=wall_clock, steps_per_print=1, zero_optimization={"stage": 2})
        T.train_engine(config, 2, dist.get_rank()).destroy()
    finally:
        del accelerator.synchronize
    assert accelerator.synchronize == original
    return len(calls)


def test_no_device_synchronisation_unless_wall_clock_breakdown():
    assert run_distributed(sync_count_run, 2, args=(False, ), timeout=TIMEOUT_S) == [0, 0]
    assert all(n > 0 for n in run_distributed(sync_count_run, 2, args=(True, ), timeout=TIMEOUT_S))


def test_stage_reduction_time_is_taken_out_of_inner(monkeypatch):
    monkeypatch.setattr(CPU_Accelerator, "use_host_timers", lambda self: True)
    timers = EngineTimers(wall_clock_breakdown=True)
    registry = timers.timers  # what the engine hands to stage.set_timers()
    timers.start(BACKWARD_GLOBAL_TIMER)
    time.sleep(0.02)
    registry(BACKWARD_REDUCE_GLOBAL_TIMER).start()
    time.sleep(0.03)
    registry(BACKWARD_REDUCE_GLOBAL_TIMER).stop()
    timers.stop(BACKWARD_GLOBAL_TIMER)
    registry(OPTIMIZER_ALLGATHER_TIMER).start()
    registry(OPTIMIZER_ALLGATHER_TIMER).stop()
    window = timers.close_window()
    assert window["bwd_allreduce"] >= 29.0
    assert window["bwd_inner"] == pytest.approx(window["bwd"] - window["bwd_allreduce"])
    assert 19.0 <= window["bwd_inner"] < window["bwd"]
    assert OPTIMIZER_ALLGATHER_TIMER in window
    assert timers.close_window()["bwd"] == 0.0, "reading a window resets the timers"


def test_stage_receives_the_registry():
    from deepspeed.runtime.engine_parts.instrumentation import EngineInstrumentation

    class Stage:
        timers = None

        def set_timers(self, timers):
            self.timers = timers

    instruments = EngineInstrumentation.__new__(EngineInstrumentation)
    instruments.timers = EngineTimers(wall_clock_breakdown=False)
    stage = Stage()
    instruments.attach_stage(stage)
    assert stage.timers is instruments.timers.timers
    instruments.attach_stage(object())  # a stage without set_timers is left alone
