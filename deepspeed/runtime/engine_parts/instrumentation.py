# SPDX-License-Identifier: Apache-2.0
"""What the engine reports about training: monitor events, timers, progress, the flops profile, eigenvalues.

:class:`EngineInstrumentation` is built by the engine at construction and called at three places: around
``forward`` (:meth:`~EngineInstrumentation.forward`), around ``backward`` (:meth:`~EngineInstrumentation.backward`)
and around ``step`` (:meth:`~EngineInstrumentation.step`). It owns no training state: it reads the engine's
counters, learning rate, loss scale and gradient norm.

Monitor events, written on global rank 0 at each accumulation boundary (``step`` is ``global_samples``):

====================================== ====================================================== ================
event                                  value                                                  step
====================================== ====================================================== ================
``Train/Samples/train_loss``           sum over the window of what ``engine.backward``        before the update
                                       returned (the mean micro-batch loss with GAS scaling)
``Train/Samples/lr``                   ``get_lr()[0]`` after the update (scheduler stepped)   after the update
``Train/Samples/loss_scale``           the fp16 loss scale after its update (fp16 only)       after the update
``Train/Samples/grad_norm``            ``get_global_grad_norm()`` of the update               after the update
``Train/Eigenvalues/ModelBlockParam_i`` block i's top Hessian eigenvalue (``eigenvalue`` on)  after the update
``Train/Samples/elapsed_time_ms_*``    the window's forward/backward/step times               after the update
                                       (``wall_clock_breakdown`` on)
====================================== ====================================================== ================

"before the update" is ``global_samples`` before the boundary step adds the batch, "after" once it has, as
upstream writes them.
"""

import contextlib
import time

from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.runtime.engine_parts.timers import EngineTimers, ProgressMeter
from deepspeed.utils.logging import log_dist
from deepspeed.utils.timer import BACKWARD_GLOBAL_TIMER, FORWARD_GLOBAL_TIMER, STEP_GLOBAL_TIMER


class EngineInstrumentation:
    """The engine's monitor, timers, progress line, flops profiler and eigenvalue monitor.

    Construction checks the configuration of all of them on every rank (a collective when a monitor is enabled,
    see :class:`MonitorMaster`) and configures the comms logger, so a bad setup raises the same error on every rank
    before training. The engine must be constructed as far as ``module`` and ``_config``.
    """

    def __init__(self, engine):
        import deepspeed.comm as dist
        self.engine = engine
        cfg = engine._config
        dist.configure(deepspeed_config=cfg)
        self.eigenvalue = self._build_eigenvalue(engine, cfg)
        self.flops_profiler = None
        self.flops_profiler_config = cfg.flops_profiler_config
        if self.flops_profiler_config.enabled:
            from deepspeed.profiling.flops_profiler import FlopsProfiler
            self.flops_profiler = FlopsProfiler(engine.module, engine, self.flops_profiler_config.recompute_fwd_factor)
        self.timers = EngineTimers(cfg.wall_clock_breakdown, cfg.memory_breakdown)
        self.progress = ProgressMeter()
        self.monitor = MonitorMaster(cfg.monitor_config)
        self._window_loss = None
        self._boundaries = 0
        self._block_eigenvalues = None
        self._eigenvalue_window_done = False
        self._profile = None  # timings of the window the flops profiler is profiling

    @staticmethod
    def _build_eigenvalue(engine, cfg):
        ev = cfg.eigenvalue_config
        if not ev.enabled:
            return None
        if not cfg.managed_gradient_accumulation:
            raise NotImplementedError("config key 'eigenvalue.enabled' is not supported with "
                                      "'managed_gradient_accumulation': false (the eigenvalue is computed in the "
                                      "backward of the boundary micro-step); see docs/compatibility.md")
        from deepspeed.runtime.eigenvalue import Eigenvalue
        eigenvalue = Eigenvalue(verbose=ev.verbose,
                                max_iter=ev.max_iter,
                                tol=ev.tol,
                                stability=ev.stability,
                                gas_boundary_resolution=ev.gas_boundary_resolution,
                                layer_name=ev.layer_name,
                                layer_num=ev.layer_num)
        eigenvalue.get_blocks(engine.module)  # a layer_name/layer_num that does not fit the model raises here
        return eigenvalue

    def attach_stage(self, stage):
        """Hand the timer registry to a ZeRO stage that can time its reductions and step phases."""
        if stage is not None and hasattr(stage, "set_timers"):
            stage.set_timers(self.timers.timers)

    # --------------------------------------------------------------- forward
    def _profiling_now(self):
        profiler = self.flops_profiler
        engine = self.engine
        return (profiler is not None and engine.global_rank == 0
                and engine.global_steps == self.flops_profiler_config.profile_step)

    @contextlib.contextmanager
    def forward(self):
        self.progress.started()
        profiling = self._profiling_now()
        if profiling and self._profile is None:
            _synchronize()
            self._profile = dict(start=time.perf_counter(), bwd=0.0, step=0.0)
        self.timers.start(FORWARD_GLOBAL_TIMER)
        if profiling:
            self.flops_profiler.start_profile()
        try:
            yield
        finally:
            if profiling:
                self.flops_profiler.stop_profile()
            self.timers.stop(FORWARD_GLOBAL_TIMER)

    # -------------------------------------------------------------- backward
    @contextlib.contextmanager
    def backward(self, loss):
        """Around ``engine.backward(loss)``; at a due boundary the eigenvalues are computed from ``loss`` first."""
        if self._eigenvalue_due():
            self._block_eigenvalues = self.eigenvalue.compute_block_eigenvalues(self.engine.module, loss=loss)
            self._eigenvalue_window_done = True
        profile = self._profile
        if profile is not None:
            _synchronize()
            start = time.perf_counter()
        self.timers.start(BACKWARD_GLOBAL_TIMER)
        try:
            yield
        finally:
            self.timers.stop(BACKWARD_GLOBAL_TIMER)
            if profile is not None:
                _synchronize()
                profile["bwd"] += time.perf_counter() - start

    def _eigenvalue_due(self):
        return (self.eigenvalue is not None and not self._eigenvalue_window_done
                and self.engine.is_gradient_accumulation_boundary()
                and (self._boundaries + 1) % self.eigenvalue.gas_boundary_resolution == 0)

    def record_loss(self, loss):
        """Add what ``engine.backward`` returned to the window's training loss (rank 0, monitor on)."""
        if self.monitor.monitors:
            loss = loss.detach().float().mean()
            self._window_loss = loss if self._window_loss is None else self._window_loss + loss

    # ------------------------------------------------------------------ step
    @contextlib.contextmanager
    def step(self, boundary):
        """Around ``engine.step()``; ``boundary``: whether this call applies the optimizer."""
        engine = self.engine
        profile = self._profile
        if boundary and self._window_loss is not None:
            self.monitor.write_events([("Train/Samples/train_loss", self._window_loss, engine.global_samples)])
        if profile is not None:
            _synchronize()
            start = time.perf_counter()
        self.timers.start(STEP_GLOBAL_TIMER)
        try:
            yield
        finally:
            self.timers.stop(STEP_GLOBAL_TIMER)
            self.timers.micro_step()
        if profile is not None:
            _synchronize()
            profile["step"] += time.perf_counter() - start
        if boundary:
            self._after_boundary(profile)

    def _after_boundary(self, profile):
        engine = self.engine
        self._boundaries += 1
        self._window_loss = None
        window = self.timers.close_window()
        if self.monitor.monitors:
            self.monitor.write_events(self._boundary_events(window))
        self._block_eigenvalues = None
        self._eigenvalue_window_done = False
        spp = engine.steps_per_print()
        if spp and engine.global_steps % spp == 0:
            self._log_progress()
            self.timers.log()
        if profile is not None:
            self._profile = None
            self._report_profile(profile)

    def _boundary_events(self, window):
        engine = self.engine
        step = engine.global_samples
        events = []
        lr = engine.get_lr()
        if lr:
            events.append(("Train/Samples/lr", lr[0], step))
        if engine.fp16_enabled():
            events.append(("Train/Samples/loss_scale", engine.get_loss_scale(), step))
        norm = engine.get_global_grad_norm()
        if norm is not None:
            events.append(("Train/Samples/grad_norm", norm, step))
        for index, value in enumerate(self._block_eigenvalues or ()):
            events.append((f"Train/Eigenvalues/ModelBlockParam_{index}", value, step))
        if window:
            events += self.timers.monitor_events(step)
        return events

    def _log_progress(self):
        engine = self.engine
        rate = self.progress.samples_per_second(engine.global_samples)
        if engine.global_rank != 0:
            return
        groups = engine.basic_optimizer.param_groups if engine.basic_optimizer is not None else []
        mom = [group.get("betas", group.get("momentum")) for group in groups]
        line = f"step={engine.global_steps}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, mom={mom}"
        if engine.fp16_enabled():
            line += f", loss_scale={engine.get_loss_scale()}"
        line += f", samples/s={rate:.2f}"
        log_dist(line, ranks=[0])

    def _report_profile(self, profile):
        cfg = self.flops_profiler_config
        _synchronize()
        profiler = self.flops_profiler
        profiler.step_latencies = dict(bwd=profile["bwd"],
                                       step=profile["step"],
                                       iter=time.perf_counter() - profile["start"])
        profiler.print_model_profile(profile_step=cfg.profile_step,
                                     module_depth=cfg.module_depth,
                                     top_modules=cfg.top_modules,
                                     detailed=cfg.detailed,
                                     output_file=cfg.output_file)
        profiler.end_profile()

    def close(self):
        self.monitor.close()
        if self.flops_profiler is not None:
            self.flops_profiler.end_profile()


def _synchronize():
    from deepspeed.accelerator import get_accelerator
    get_accelerator().synchronize()
