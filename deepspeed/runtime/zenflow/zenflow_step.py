# SPDX-License-Identifier: Apache-2.0
"""ZenFlow: stall-free offload. Important columns step on the device every step; the rest step on the host, later.

:class:`ZenFlowStep` replaces the optimizer step of a ZeRO stage with ``offload_optimizer`` when
``zero_optimization.zenflow`` is set (ZeRO 1/2 and 3; what differs between them is in
``stage_io.py``). The backward, the reduction into host partitions, the global norm, the fp16
overflow check and clipping stay the stage's and the engine's (the loss scale enters through the
backward session, like everywhere else); ZenFlow decides what the step does with the gradient
``g_t`` and its clipping coefficient ``c_t``.

A ZenFlow step is one ``engine.step()``, so one micro-batch: as in upstream DeepSpeed, the engine
accumulates over one micro-batch under ZenFlow and the host window takes the place of gradient
accumulation (``config.accumulation_steps``). The algorithm, per applied step ``t`` (an overflowed
step is skipped whole, by the engine, and does not count):

1. warm-up (``t < full_warm_up_rounds``): a plain offloaded step of everything;
2. selection, at ``t = full_warm_up_rounds`` and at every multiple of ``select_interval`` (steps,
   or epochs of steps): the top ``max(1, int(topk_ratio * C))`` columns of every weight of ``C``
   columns by the L1 norm of their gradient in ``g_t``
   (:class:`~deepspeed.runtime.zenflow.selection.ColumnSelection`); a pending host step is applied
   and the device part's values are written back into the fp32 masters first, the new selection's
   values are read from them, and its Adam moments and step count start at zero;
3. the *device part* (the selected columns and every parameter of fewer than two dimensions)
   takes one Adam step with ``c_t * g_t`` of its elements, every step, on the GPU: it is exact
   every step;
4. ``c_t * g_t`` is added into the window sum (``host_window.py``): on the device when the stage keeps its
   gradient partitions there (ZeRO 1/2 without ``zenflow.offload``: nothing moves to the host per step), else
   on the host, on an accumulation thread;
5. a window closes at step ``t`` when ``(t + 1 - full_warm_up_rounds)`` is a multiple of
   ``update_interval`` (or by the "auto" rule below), and before every selection: the host optimizer
   steps every master with the mean ``(1/n) sum c_t g_t`` of its ``n`` steps (``window_update``:
   one plain Adam step by default, upstream's arithmetic; or as far as the window's ``n`` steps
   would move them, see ``host_window.py``); its values reach the model's 16-bit parameters,
   except the selected columns, which keep the device part's. Without ``overlap_step`` that
   happens at once (the host step blocks); with it, the step runs on the worker thread during the
   next window and its values are applied when that window closes (upstream's), or earlier at a
   selection, or ``overlap_apply_after`` steps after the launch when that is a number.

The model's 16-bit parameters therefore hold, at every step, the device part's values for the
selected columns and the last applied host values for the others. On ``W > 1`` ranks every step
ends by publishing the rank's part (``stage_io.py``).

"auto" update interval: per selectable weight, each step compares the mean squared gradient of
its unselected elements, summed over the open window, with the mean over the window of the mean
squared gradient of its selected elements; the window closes once the share of weights whose
unselected sum caught up reaches ``auto_ratio`` (weights whose columns are all selected do not
count). The quantities are reduced over ranks, so every rank decides alike.

Expert parameters (``deepspeed.moe``, AutoEP) are partitioned over their expert-data-parallel group
(their ``ReductionSpec``) and differ by expert-parallel rank: their column norms and "auto" sums are
reduced over that group (``selection.py``), so the ranks holding an expert select alike from its
global-mean gradient, and the "auto" rule counts each expert once over the data-parallel group. The
norm, clipping and non-finite verdict stay the stage's (its partitions cover every expert once).

Threads: the training thread keeps ``pt_reserved_cores_perc`` of the cores (torch's intra-op
threads), the host worker takes the rest.

Work per ``engine.step()`` (``counts`` here and in ``HostWindow.counts``; tests count it): one device-part
step and one accumulation; with host partitions also one copy of the selected gradient to the device; one host
step per closed window, which overlaps the next window's steps (``overlap_step``).
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zenflow.config import resolve_schedule
from deepspeed.runtime.zenflow.device_part import DevicePart, check_adam
from deepspeed.runtime.zenflow.host_window import HostWindow
from deepspeed.runtime.zenflow.selection import ColumnSelection
from deepspeed.runtime.zenflow.zenflow_utils import _split_affinity
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.offload.host_worker import host_cores
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.offload.transfers import DONE, HostTransfers, pinned

STATE_VERSION = 3  # 3: columns selected, steps counted per engine.step()


class ZenFlowStep:
    """ZenFlow's optimizer step for a ZeRO stage with ``offload_optimizer``; ``io`` is the stage's
    :mod:`~deepspeed.runtime.zenflow.stage_io` object."""

    def __init__(self, stage, cfg, io):
        self.stage = stage
        self.cfg = cfg
        self.io = io
        check_adam(stage.optimizer)
        if stage.host_step is None:
            raise ValueError("zero_optimization.zenflow needs offload_optimizer.device \"cpu\"")
        self.schedule = resolve_schedule(cfg)
        pin = stage.config.pin_memory
        self.selection = ColumnSelection(io.weights(),
                                         io.pieces(),
                                         io.num_groups,
                                         cfg.topk_ratio,
                                         stage.device,
                                         stage.group,
                                         group_of=io.group_of,
                                         blocks_of=io.blocks_of)
        self.device_part = DevicePart(stage.device, cfg.offload, pin_memory=pin)
        worker_cores, main_cores = _split_affinity(range(host_cores()), cfg.pt_reserved_cores_perc)
        self.main_threads = len(main_cores)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.main_threads)
        # ZeRO 1/2 without zenflow.offload: the stage keeps its gradient partitions on the device, and the window
        # sums there (host_window.py); otherwise the partitions are on the host, in two sets (_swap_parts)
        self.on_device = bool(getattr(io, "window_on_device", False))
        self.window = HostWindow(stage.host_step,
                                 threads=len(worker_cores),
                                 update=cfg.window_update,
                                 device=stage.device if self.on_device else None,
                                 pin_memory=pin)
        self.part_sets = None
        if not self.on_device:
            parts = list(stage.geometry.grad_parts)
            self.part_sets = [parts, [pinned(torch.zeros_like(p), pin) for p in parts]]
        self.part_busy = [DONE, DONE]
        self.active = 0
        for master in stage.masters:
            master.grad = None  # ZenFlow gives the masters their gradient for each host step
        self.transfers = HostTransfers(stage.device)
        self._grad_staging = None  # host path: pinned host buffers of the selected gradient
        self._gathered = None  # device path: device buffers of the selected gradient
        self._raw_selected = None  # this step's selected gradient before clipping (the "auto" rule reads it)
        self._grad_copy = DONE
        self.counts = dict(steps=0, selected_grad_copies=0)  # selected gradients copied host to device
        self.steps = 0  # applied ZenFlow steps (engine.step() calls)
        self.selected_at = None  # step of the last selection
        self.coef = 1.0
        self.pending_apply = False
        self.launched_at = None  # step that launched the pending host step (overlap_step)
        self._auto = None

    def set_steps_per_epoch(self, steps):
        """The training data's epoch length in ZenFlow steps (the "epoch" selection strategy counts in it)."""
        self.schedule = resolve_schedule(self.cfg, steps)

    def _selection_due(self):
        return self.window.count == 0 and self.schedule.selects(self.steps, self.selected_at is not None)

    def before_step(self):
        """The step's reductions are complete: start moving what the step needs (offloaded device part)."""
        if self.steps >= self.schedule.warm_up and not self._selection_due():
            self.device_part.prefetch()

    def set_clip(self, coef):
        """The clipping coefficient of this step (applied to both parts; not to the partitions in place)."""
        self.coef = float(coef)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self):
        """The ZenFlow step of the gradient in the stage's partitions (see the module docstring)."""
        stage = self.stage
        parts = stage.geometry.partitions()
        coef, self.coef = self.coef, 1.0
        with ds_range("DS::zenflow_step"):
            if self.steps < self.schedule.warm_up:
                self.io.full_step(parts, coef)
            else:
                if self._selection_due():
                    self._select(parts)
                grads = self._selected_grads(parts)
                closes = self._window_closes(parts)
                if coef != 1.0:
                    grad_ops.scale_(grads, coef)
                values = self.device_part.step(grads, stage.optimizer.param_groups)
                added = self.window.accumulate(parts, coef)
                if not self.on_device:
                    self._swap_parts(added)
                if closes:
                    self._close_window()
                elif self._apply_due():
                    if self.window.launched is not None:  # None: resumed from a checkpoint, nothing in flight
                        self.window.launched.synchronize()
                    self._apply()
                self.io.before_write()
                self.selection.scatter(values, self.io.targets(), at="target")
                self.io.publish()
        self.steps += 1
        self.counts["steps"] += 1

    def _select(self, parts):
        with ds_range("DS::zenflow_select"):
            self.window.wait()  # nothing in flight reads or writes the masters now
            if self.pending_apply:
                self._apply()
                if self.device_part.values:  # the previous selection's columns keep their device values
                    self.io.before_write()
                    self.selection.scatter(self.device_part.host_values(), self.io.targets(), at="target")
            self.sync_masters()
            self.selection.select(parts)
            masters = [m.data for m in self.stage.masters]
            self.device_part.reset(self.selection.gather(masters, self.selection.new_buffers()))
            self.selected_at = self.steps
            self._auto = None

    def _selected_grads(self, parts):
        """``g_t`` of the selected elements, in device buffers the caller may scale: gathered on the device from
        device partitions, or on the host and copied asynchronously."""
        sizes = list(self.selection.numel)
        device = self.stage.device
        if self.on_device:
            if self._gathered is None or [b.numel() for b in self._gathered] != sizes:
                self._gathered = self.selection.new_buffers(device=device)
            grads = self.selection.gather(parts, self._gathered)
            self._raw_selected = grads  # read by the auto rule before the caller scales them
            return grads
        self._grad_copy.synchronize()  # the staging buffers are rewritten below
        if self._grad_staging is None or [b.numel() for b in self._grad_staging] != sizes:
            self._grad_staging = self.selection.new_buffers(pin_memory=self.stage.config.pin_memory)
        host = self.selection.gather(parts, self._grad_staging)
        self._raw_selected = host
        grads = [torch.empty(h.numel(), dtype=torch.float32, device=device) for h in host]
        self._grad_copy = self.transfers.copy_many(list(zip(grads, host)))
        self._grad_copy.wait_stream()
        self.counts["selected_grad_copies"] += 1
        return grads

    def _swap_parts(self, busy):
        """The worker reads the partitions just handed to it; the next step's gradient goes to the other set."""
        self.part_busy[self.active] = busy
        other = 1 - self.active
        with ds_range("DS::zenflow_wait"):
            self.part_busy[other].synchronize()
        self.stage.geometry.use_partitions(self.part_sets[other])
        self.active = other

    def _close_window(self):
        with ds_range("DS::zenflow_host_step"):
            if self.cfg.overlap_step:
                if self.pending_apply:
                    if self.window.launched is not None:  # the previous window's host step (not this accumulation)
                        with ds_range("DS::zenflow_wait"):
                            self.window.launched.synchronize()
                    self._apply()
                self.window.launch()
                self.pending_apply = True
                self.launched_at = self.steps
            else:
                self.window.launch()
                self.window.wait()
                self._apply()
        self._auto = None

    def _apply_due(self):
        """Overlap: whether the pending host step is applied at this step (``overlap_apply_after`` steps after its
        launch; "window": only when the next window closes)."""
        after = self.cfg.overlap_apply_after
        if not self.pending_apply or after == "window" or self.launched_at is None:
            return False
        return self.steps - self.launched_at >= after

    def _apply(self):
        """The last host step's 16-bit values into this rank's part of the model (the device part's columns are
        written over them by the caller)."""
        self.io.apply_host()
        self.pending_apply = False

    # ------------------------------------------------------------ auto window
    def _window_closes(self, parts):
        if self.schedule.closes(self.steps):
            return True
        if self.schedule.update_every is not None:
            return False
        return self._auto_closes(parts)

    def _auto_closes(self, parts):
        selection = self.selection
        sums = selection.reduce_by_group(selection.weight_sums(parts, self._raw_selected),
                                         selection.weight_sum_entries)
        n_weights = len(selection.weights)
        if self._auto is None:
            self._auto = dict(non=torch.zeros(n_weights, dtype=torch.float64),
                              crit=torch.zeros(n_weights, dtype=torch.float64),
                              n=0)
        auto = self._auto
        auto["n"] += 1
        counts = torch.zeros(2 * max(len(selection.groups), 1), dtype=torch.float64)  # per group: counted, caught
        for i, weight in enumerate(selection.weights):
            if weight.k >= weight.cols:
                continue
            total, selected = float(sums[i]), float(sums[n_weights + i])
            auto["crit"][i] += selected / (weight.k * weight.rows)
            auto["non"][i] += max(total - selected, 0.0) / ((weight.cols - weight.k) * weight.rows)
            counts[2 * weight.reduce] += 1
            if auto["non"][i] >= auto["crit"][i] / auto["n"]:
                counts[2 * weight.reduce + 1] += 1
        counted, caught = self._count_weights(counts)
        return counted == 0 or caught >= self.schedule.auto_ratio * counted

    def _count_weights(self, counts):
        """``(counted, caught)`` over the whole model from this rank's per-group counts. Expert weights differ by
        expert-parallel rank: their counts are summed over the data-parallel group, where each expert is counted
        once per rank of its expert-data-parallel group (divided out), so every rank takes the same decision, the
        one a rank holding every expert takes."""
        groups = self.selection.groups
        if len(groups) > 1 and dist.is_initialized() and dist.get_world_size(self.stage.group) > 1:
            reduced = counts.to(torch.float32).to(self.stage.device)
            dist.all_reduce(reduced, group=self.stage.group)
            sizes = torch.tensor([float(size) for _, size in groups for _ in range(2)], dtype=torch.float64)
            counts = torch.round(reduced.double().cpu() / sizes)
        return float(counts[0::2].sum()), float(counts[1::2].sum())

    # ----------------------------------------------------- masters, checkpoints
    def sync_masters(self):
        """Write the device part's values into the fp32 masters (they are stale there while selected)."""
        self.window.wait()
        if self.device_part.values:
            self.selection.scatter(self.device_part.host_values(), [m.data for m in self.stage.masters])

    @torch.no_grad()
    def masters_changed(self):
        """The masters were written from outside (``safe_set_full_fp32_param``): the device part reads its values
        again (its moments stay)."""
        if self.device_part.values:
            values = self.selection.gather([m.data for m in self.stage.masters], self.selection.new_buffers())
            self.device_part.host_values()  # no copy home is in flight
            self.device_part._fetched = None
            for home, value in zip(self.device_part.values, values):
                home.copy_(value)

    def export_state(self):
        """ZenFlow's state beside the stage's (masters and inner optimizer, saved by the checkpoint code)."""
        self.sync_masters()
        return dict(version=STATE_VERSION,
                    steps=self.steps,
                    selected_at=self.selected_at,
                    window_count=self.window.count,
                    acc=[a.detach().to("cpu", copy=True) for a in self.window.acc] if self.window.count else None,
                    pending_apply=self.pending_apply,
                    launched_at=self.launched_at,
                    columns=self.selection.state(),
                    device=self.device_part.state(),
                    own16=self.io.own16(),
                    auto=None if self._auto is None else dict(self._auto))

    @torch.no_grad()
    def import_state(self, state):
        """Resume from :meth:`export_state`, after the stage's masters and optimizer were loaded (collective)."""
        if not state or state.get("version") != STATE_VERSION:
            self.reset()
            return
        self.window.wait()
        self.steps = int(state["steps"])
        self.selected_at = state["selected_at"]
        self.window.count = int(state["window_count"])
        if state["acc"] is not None:
            for a, saved in zip(self.window.acc, state["acc"]):
                a.copy_(saved)
        self.pending_apply = bool(state["pending_apply"])
        self.launched_at = state.get("launched_at")
        self.selection.set_columns(state["columns"])
        masters = [m.data for m in self.stage.masters]
        device = state["device"]
        if self.selected_at is not None:
            values = self.selection.gather(masters, self.selection.new_buffers())
            self.device_part.load(values, device["exp_avg"], device["exp_avg_sq"], device["steps"])
        self._auto = state["auto"]
        self.stage.host_step.fresh = False
        self.io.load_own16(state["own16"])

    def reset(self):
        """Start over from the masters as they are (a checkpoint of another layout, or without ZenFlow state)."""
        self.window.wait()
        self.window.count = 0
        self.pending_apply = False
        self.launched_at = None
        self.selection.set_columns({})
        self.device_part = DevicePart(self.stage.device, self.cfg.offload, pin_memory=self.stage.config.pin_memory)
        self.selected_at = None
        self.steps = max(self.steps, self.schedule.warm_up)
        self._auto = None

    def close(self):
        self.window.close()
        torch.set_num_threads(self._threads_before)
