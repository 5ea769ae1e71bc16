# SPDX-License-Identifier: Apache-2.0
"""The DeepSpeed logger's rank handling, and the wall-clock and throughput timers."""

import logging
import time

import pytest

import deepspeed.utils.logging as ds_logging
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer, ThroughputTimer


class _Collect(logging.Handler):

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def records():
    handler = _Collect()
    ds_logging.logger.addHandler(handler)
    level = ds_logging.logger.level
    ds_logging.logger.setLevel(logging.INFO)
    yield handler.records
    ds_logging.logger.removeHandler(handler)
    ds_logging.logger.setLevel(level)


@pytest.mark.parametrize("rank, ranks, logged", [
    (1, None, True),
    (1, [0], False),
    (1, [0, 1], True),
    (1, [-1], True),
    (0, [0], True),
    (-1, [0], True),
])
def test_log_dist_rank_filter(records, monkeypatch, rank, ranks, logged):
    monkeypatch.setattr(ds_logging, "_global_rank", lambda: rank)
    ds_logging.log_dist("hello", ranks=ranks, level=logging.WARNING)
    assert [r.getMessage() for r in records] == (["hello"] if logged else [])
    if logged:
        assert records[0].levelno == logging.WARNING
        assert records[0].filename == "test_logging_and_timers.py", "the record must point at the caller"


def test_records_carry_the_rank(monkeypatch):
    monkeypatch.setattr(ds_logging, "_global_rank", lambda: 3)
    (handler, ) = [
        h for h in ds_logging.logger.handlers if any(isinstance(f, ds_logging._RankFilter) for f in h.filters)
    ]
    record = ds_logging.logger.makeRecord("DeepSpeed", logging.INFO, "f.py", 1, "msg", (), None)
    assert handler.filter(record)
    assert "[Rank 3]" in handler.format(record) and handler.format(record).endswith("msg")
    assert ds_logging.logger.propagate is False


def test_warning_once(records):
    ds_logging.warning_once("only once %d", 7)
    ds_logging.logger.warning_once("only once %d", 7)
    ds_logging.warning_once("another")
    assert [r.getMessage() for r in records] == ["only once 7", "another"]


def test_should_log_le(records):
    ds_logging.set_log_level_from_string("warning")
    assert not ds_logging.should_log_le("info")
    assert ds_logging.should_log_le("warning") and ds_logging.should_log_le("ERROR")
    with pytest.raises(ValueError):
        ds_logging.should_log_le("loud")
    assert ds_logging.get_current_level() == logging.WARNING


def test_print_rank_0(capsys, monkeypatch):
    monkeypatch.setattr(ds_logging, "_global_rank", lambda: 1)
    ds_logging.print_rank_0("from rank 1")
    monkeypatch.setattr(ds_logging, "_global_rank", lambda: 0)
    ds_logging.print_rank_0("from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"


@pytest.mark.parametrize("host_timers", [True, False], ids=["host_clock", "events"])
def test_wall_clock_timer(monkeypatch, records, host_timers):
    monkeypatch.setattr(CPU_Accelerator, "use_host_timers", lambda self: host_timers)
    timers = SynchronizedWallClockTimer()
    timer = timers("fwd")
    assert timers.has_timer("fwd") and timers("fwd") is timer and not timers.has_timer("bwd")
    for _ in range(2):
        timer.start()
        time.sleep(0.03)
        timer.stop(record=True)
    elapsed = timer.elapsed(reset=False)
    assert 55.0 <= elapsed < 5000.0
    assert 27.0 <= timer.mean() <= elapsed
    assert timer.elapsed() == pytest.approx(elapsed)
    assert timer.elapsed() == 0.0, "elapsed(reset=True) must have reset the timer"

    timer.start()
    time.sleep(0.02)
    timers.log(["fwd", "missing"], normalizer=2.0)
    (record, ) = records
    logged_ms = float(record.getMessage().split("fwd: ")[1].split()[0])
    assert 9.0 <= logged_ms < 2500.0
    assert timer.started_, "log() on a running timer keeps it running"
    timer.stop()
    with pytest.raises(AssertionError):
        timer.stop()


def test_noop_timer():
    timers = NoopTimer()
    timers("x").start()
    timers("x").stop(record=True)
    assert timers("x").elapsed() == 0.0 and not timers.has_timer("x") and timers.get_timers() == {}


def test_throughput_timer():
    reports = []
    timer = ThroughputTimer(None, batch_size=4, start_step=1, steps_per_output=2, logging_fn=reports.append)
    assert timer.avg_samples_per_sec() == float("-inf")
    step_s = 0.02
    for _ in range(4):  # one untimed warm-up step, then three timed global steps of two micro-steps
        for micro in range(2):
            timer.start()
            time.sleep(step_s / 2)
            timer.stop(global_step=micro == 1)
    assert timer.global_step_count == 4 and timer.micro_step_count == 8
    rate = timer.avg_samples_per_sec()
    assert 4 / (step_s * 20) < rate <= 4 / step_s
    assert len(reports) == 2 and "global_step=4" in reports[1]


def test_throughput_timer_disabled():
    timer = ThroughputTimer({"enabled": False}, batch_size=4)
    timer.start()
    timer.stop(global_step=True)
    assert timer.global_step_count == 0


@pytest.mark.parametrize("values,fraction,expected", [([3.0, 1.0, 2.0], 0.1, 2.0), ([], 0.2, 0.0),
                                                      ([5.0, 1.0, 2.0, 3.0, 4.0], 0.2, 3.0),
                                                      ([float(v) for v in range(15)], 0.1, 7.0),
                                                      ([1.0, 9.0], 0.5, 5.0)])
def test_trim_mean(values, fraction, expected):
    """Upstream's ``deepspeed.utils.timer.trim_mean``: ``round(n * fraction)`` values cut at each end (written out:
    15 values at 0.1 lose two at each end), the argument left as it was."""
    from deepspeed.utils.timer import trim_mean
    before = list(values)
    kept = sorted(values)[int(round(len(values) * fraction)):len(values) - int(round(len(values) * fraction))]
    assert trim_mean(values, fraction) == expected == (sum(kept or values) / len(kept or values) if values else 0.0)
    assert values == before
    with pytest.raises(ValueError, match="fraction"):
        trim_mean(values, 1.5)


def test_engine_log_level_is_the_configs():
    from types import SimpleNamespace
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.config import DeepSpeedConfig
    for given in ("ERROR", "info", None):
        config = DeepSpeedConfig({"train_batch_size": 1, **({"log_level": given} if given else {})})
        assert DeepSpeedEngine.log_level(SimpleNamespace(_config=config)) == given
