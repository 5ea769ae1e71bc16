# SPDX-License-Identifier: Apache-2.0
"""``wall_clock_breakdown``: where an optimizer step's time goes, and the ``steps_per_print`` progress line.

The engine times, on the registry of :class:`~deepspeed.utils.timer.SynchronizedWallClockTimer`:

    fwd     each engine.forward            bwd   each engine.backward (the whole call)
    step    each engine.step() call

and hands the registry to its ZeRO stage (``stage.set_timers(timers)``, where the stage has it), which may time:

    bwd_allreduce        gradient reduction it waits for, in backward or at the boundary
    optimizer_gradients  unscaling, norm and clipping of the boundary step
    optimizer_step       the inner optimizer's step
    optimizer_allgather  the all-gather of updated parameters

At every accumulation boundary :meth:`EngineTimers.close_window` reads each timer once (resetting it), which
gives the window's milliseconds; ``bwd_inner = bwd - bwd_allreduce`` is derived there, so it is the backward time
not spent waiting for reductions (with reduction overlapped, inner is about the whole backward). Every
``steps_per_print`` optimizer steps rank 0 logs two lines, as upstream names the timers: the mean per micro-step
(``fwd_microstep``, ``bwd_microstep``, ``bwd_inner_microstep``, ``bwd_allreduce_microstep``, ``step_microstep``)
and the mean per optimizer step (``fwd``, ``bwd``, ``bwd_inner``, ``bwd_allreduce``, ``step`` and the stage's).

Off (the default) the registry is a :class:`~deepspeed.utils.timer.NoopTimer` and nothing synchronises the device.
On CUDA the timers record events; reading them at the boundary waits for the step's work to finish, once per
optimizer step.
"""

import time

from deepspeed.utils.logging import log_dist
from deepspeed.utils.timer import (BACKWARD_GLOBAL_TIMER, BACKWARD_INNER_GLOBAL_TIMER, BACKWARD_INNER_MICRO_TIMER,
                                   BACKWARD_MICRO_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER, BACKWARD_REDUCE_MICRO_TIMER,
                                   FORWARD_GLOBAL_TIMER, FORWARD_MICRO_TIMER, OPTIMIZER_ALLGATHER_TIMER,
                                   OPTIMIZER_GRADIENTS_TIMER, OPTIMIZER_STEP_TIMER, STEP_GLOBAL_TIMER,
                                   STEP_MICRO_TIMER, NoopTimer, SynchronizedWallClockTimer)

# (per-step name, per-micro-step name) in the order they are printed; None: not reported per micro-step.
REPORTED = (
    (FORWARD_GLOBAL_TIMER, FORWARD_MICRO_TIMER),
    (BACKWARD_GLOBAL_TIMER, BACKWARD_MICRO_TIMER),
    (BACKWARD_INNER_GLOBAL_TIMER, BACKWARD_INNER_MICRO_TIMER),
    (BACKWARD_REDUCE_GLOBAL_TIMER, BACKWARD_REDUCE_MICRO_TIMER),
    (STEP_GLOBAL_TIMER, STEP_MICRO_TIMER),
    (OPTIMIZER_GRADIENTS_TIMER, None),
    (OPTIMIZER_STEP_TIMER, None),
    (OPTIMIZER_ALLGATHER_TIMER, None),
)

# Monitor events of the window's times (upstream's names), written when the monitor is on.
MONITOR_EVENTS = (
    ("Train/Samples/elapsed_time_ms_forward", FORWARD_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_backward", BACKWARD_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_backward_inner", BACKWARD_INNER_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_backward_allreduce", BACKWARD_REDUCE_GLOBAL_TIMER),
    ("Train/Samples/elapsed_time_ms_step", STEP_GLOBAL_TIMER),
)


class EngineTimers:
    """The timer registry of one engine and the bookkeeping of its report (see the module docstring)."""

    def __init__(self, wall_clock_breakdown, memory_breakdown=False):
        self.enabled = bool(wall_clock_breakdown)
        self.memory_breakdown = bool(memory_breakdown)
        self.timers = SynchronizedWallClockTimer() if self.enabled else NoopTimer()
        self.window = {}  # the last closed window's milliseconds, by name
        self._interval = {}
        self._interval_steps = 0
        self._interval_micro_steps = 0
        self._window_micro_steps = 0

    def start(self, name):
        if self.enabled:
            self.timers(name).start()

    def stop(self, name):
        if self.enabled:
            self.timers(name).stop()

    def micro_step(self):
        """Count one engine.step() call (a micro-step)."""
        self._window_micro_steps += 1

    def close_window(self):
        """At a boundary: read and reset every timer; returns ``{name: ms}`` of the window (empty when off)."""
        if not self.enabled:
            return {}
        window = {}
        for name in list(self.timers.get_timers()):
            window[name] = self.timers(name).elapsed(reset=True)
        if BACKWARD_GLOBAL_TIMER in window:
            window[BACKWARD_INNER_GLOBAL_TIMER] = max(
                0.0, window[BACKWARD_GLOBAL_TIMER] - window.get(BACKWARD_REDUCE_GLOBAL_TIMER, 0.0))
        for name, ms in window.items():
            self._interval[name] = self._interval.get(name, 0.0) + ms
        self._interval_steps += 1
        self._interval_micro_steps += self._window_micro_steps
        self._window_micro_steps = 0
        self.window = window
        return window

    def monitor_events(self, step):
        """The window's times as monitor events at ``step``."""
        return [(event, self.window[name], step) for event, name in MONITOR_EVENTS if name in self.window]

    def log(self):
        """Log the interval's means on rank 0 and start a new interval."""
        if not self.enabled or self._interval_steps == 0:
            return
        micro = max(self._interval_micro_steps, 1)
        per_micro = [(micro_name, self._interval[name] / micro) for name, micro_name in REPORTED
                     if micro_name is not None and name in self._interval]
        per_step = [(name, self._interval[name] / self._interval_steps) for name, _ in REPORTED
                    if name in self._interval]
        for parts in (per_micro, per_step):
            if parts:
                message = "time (ms) | " + " | ".join(f"{name}: {ms:.2f}" for name, ms in parts)
                if self.memory_breakdown:
                    message += SynchronizedWallClockTimer.memory_usage()
                log_dist(message, ranks=[0])
        self._interval = {}
        self._interval_steps = 0
        self._interval_micro_steps = 0


class ProgressMeter:
    """Samples per second between two progress lines, from the host clock (it never synchronises the device: over
    an interval of many steps the host runs at most one step's queued work ahead of it)."""

    def __init__(self):
        self._since = None
        self._samples = 0

    def started(self):
        """Start the first interval, at the first forward (setup time is not training time)."""
        if self._since is None:
            self._since = time.perf_counter()

    def samples_per_second(self, samples_now):
        now = time.perf_counter()
        since = self._since if self._since is not None else now
        elapsed = now - since
        rate = (samples_now - self._samples) / elapsed if elapsed > 0 else float("nan")
        self._since, self._samples = now, samples_now
        return rate
