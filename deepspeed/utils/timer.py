# SPDX-License-Identifier: Apache-2.0
"""Wall-clock timers for ``wall_clock_breakdown`` and throughput reporting.

``SynchronizedWallClockTimer`` keeps named timers. On a device that runs
asynchronously (CUDA) each start/stop pair records device events, so stopping a
timer does not block the host; the events are resolved when the elapsed time is
read. Elsewhere (CPU) a timer reads the host clock. Times are reported in
milliseconds.
"""

import time

from deepspeed.accelerator import get_accelerator
from deepspeed.utils.comms_logging import trim_mean  # noqa: F401  (upstream's home of the name)
from deepspeed.utils.logging import log_dist, logger

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"


class _Timer:
    """One named timer accumulating the time between ``start()`` and ``stop()`` calls."""

    def __init__(self, name):
        self.name_ = name
        self.started_ = False
        self._accelerator = get_accelerator()
        self._use_events = not self._accelerator.use_host_timers()
        self._pending = []  # (start, end) event pairs not yet resolved
        self._start = None
        self._elapsed_ms = 0.0
        self._records = []

    def start(self):
        assert not self.started_, f"timer {self.name_} has already been started"
        if self._use_events:
            self._start = self._accelerator.Event(enable_timing=True)
            self._start.record()
        else:
            self._accelerator.synchronize()
            self._start = time.perf_counter()
        self.started_ = True

    def stop(self, reset=False, record=False):
        """Stop the timer; ``reset`` drops earlier intervals, ``record`` keeps this one for ``mean()``."""
        assert self.started_, f"timer {self.name_} is not started"
        if self._use_events:
            end = self._accelerator.Event(enable_timing=True)
            end.record()
            interval = (self._start, end)
        else:
            self._accelerator.synchronize()
            interval = (time.perf_counter() - self._start) * 1000.0
        if reset:
            self.reset()
        if self._use_events:
            self._pending.append(interval)
        else:
            self._elapsed_ms += interval
        if record:
            self._records.append(interval)
        self.started_ = False

    def _resolve(self):
        for start, end in self._pending:
            end.synchronize()
            self._elapsed_ms += start.elapsed_time(end)
        self._pending = []
        self._records = [r if isinstance(r, float) else r[0].elapsed_time(r[1]) for r in self._records]

    def reset(self, records=False):
        """Drop the accumulated time (and, with ``records``, the intervals kept for ``mean()``)."""
        self.started_ = False
        self._pending = []
        self._elapsed_ms = 0.0
        if records:
            self._records = []

    def elapsed(self, reset=True):
        """Accumulated milliseconds (a running timer is stopped, read and restarted)."""
        running = self.started_
        if running:
            self.stop()
        self._resolve()
        elapsed_ms = self._elapsed_ms
        if reset:
            self.reset()
        if running:
            self.start()
        return elapsed_ms

    def mean(self):
        """Mean milliseconds over the intervals stopped with ``record=True``."""
        self._resolve()
        return sum(self._records) / len(self._records) if self._records else 0.0


class SynchronizedWallClockTimer:
    """A registry of named timers: ``timers(name).start()`` / ``.stop()`` / ``timers.log([names])``."""

    Timer = _Timer

    def __init__(self):
        self.timers = {}

    def get_timers(self):
        return self.timers

    def __call__(self, name):
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def has_timer(self, name):
        return name in self.timers

    @staticmethod
    def memory_usage():
        accelerator = get_accelerator()
        gib = 1024**3
        return (f" | mem_allocated: {accelerator.memory_allocated() / gib:.4f} GB"
                f" | max_mem_allocated: {accelerator.max_memory_allocated() / gib:.4f} GB")

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None):
        """Log each named timer's elapsed milliseconds divided by ``normalizer`` on ``ranks`` (default rank 0)."""
        assert normalizer > 0.0, "normalizer must be positive"
        parts = [
            f"{name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}" for name in names
            if name in self.timers
        ]
        message = "time (ms) | " + " | ".join(parts)
        if memory_breakdown:
            message += self.memory_usage()
        log_dist(message, ranks=ranks or [0])

    def get_mean(self, names, normalizer=1.0, reset=True):
        """{name: mean recorded milliseconds / normalizer} for the named timers that exist."""
        assert normalizer > 0.0, "normalizer must be positive"
        means = {}
        for name in names:
            if name in self.timers:
                means[name] = self.timers[name].mean() / normalizer
                if reset:
                    self.timers[name].reset(records=True)
        return means


class NoopTimer:
    """The timer registry used when ``wall_clock_breakdown`` is off: every operation does nothing."""

    class Timer:

        def start(self):
            pass

        def reset(self, **kwargs):
            pass

        def stop(self, **kwargs):
            pass

        def elapsed(self, **kwargs):
            return 0.0

        def mean(self):
            return 0.0

    def __init__(self):
        self.timer = self.Timer()

    def __call__(self, name):
        return self.timer

    def get_timers(self):
        return {}

    def has_timer(self, name):
        return False

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None):
        pass

    def get_mean(self, names, normalizer=1.0, reset=True):
        return {}


def _config_flag(config, key, default):
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


class ThroughputTimer:
    """Samples per second over training steps, skipping the first ``start_step`` (warm-up) steps.

    Call ``start()`` before and ``stop(global_step=...)`` after each micro-step; the
    time of micro-steps that begin once ``start_step`` global steps have completed is
    accumulated. ``config`` may be None, a dict or an object with ``enabled`` and
    ``synchronized``.
    """

    def __init__(self, config, batch_size, start_step=2, steps_per_output=None, monitor_memory=False, logging_fn=None):
        self.enabled = _config_flag(config, "enabled", True)
        self.synchronized = _config_flag(config, "synchronized", True)
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False

    def update_epoch_count(self):
        self.epoch_count += 1
        self.micro_step_count = 0

    def _synchronize(self):
        if self.synchronized:
            get_accelerator().synchronize()

    def start(self):
        if not self.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self._synchronize()
            self.start_time = time.time()

    def stop(self, global_step=False, report_speed=True):
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self._synchronize()
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            self.start_time = 0.0
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    self._report()
                self.step_elapsed_time = 0.0

    def _report(self):
        message = (
            f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}, "
            f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={self.batch_size / self.step_elapsed_time if self.step_elapsed_time else 0.0}")
        if self.monitor_memory:
            message += SynchronizedWallClockTimer.memory_usage()
        self.logging(message)

    def avg_samples_per_sec(self):
        """Samples per second over the timed global steps; ``-inf`` before any was timed."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")


# Timers a ZeRO stage may run on the registry the engine hands it (``stage.set_timers(timers)``): the time of the
# gradient reduction it does in backward or at the boundary, and of the phases of its optimizer step.
OPTIMIZER_ALLGATHER_TIMER = "optimizer_allgather"
OPTIMIZER_GRADIENTS_TIMER = "optimizer_gradients"
OPTIMIZER_STEP_TIMER = "optimizer_step"
