# SPDX-License-Identifier: Apache-2.0
"""What every ZeRO stage shares: its gradient pipeline, the window interface and one norm/overflow semantics.

A stage is built from a :class:`~deepspeed.runtime.zero.stages.StageConfig` and an
accumulation clock (the engine's :class:`~deepspeed.runtime.engine_parts.accumulation.AccumulationWindow`)
and owns:

* ``pipeline``: the :class:`~deepspeed.runtime.zero.gradients.grad_pipeline.GradPipeline` the backward
  session hands this engine's gradients to, with the stage's geometry and reduction policy
  (stages 0 and 1 reduce in the boundary backward, stages 2 and 3 in every backward; none
  while reduction is deferred);
* the window interface the boundary step calls, the same for every stage:
  ``finish_window``, ``global_grad_norm``, ``found_overflow``, ``scale_grads``,
  ``optimizer_step``, ``zero_window``;
* the accessors behind ``deepspeed.utils.safe_get_*``.

Norm and overflow, one semantics for every stage: the global gradient norm is the square
root of the sum, over every rank's window-gradient partitions, of their squared L2 norms
(one all-reduce for partitioned stages; none for stage 0, whose window gradient is
replicated), each element counted once (a tensor-parallel model's replicated parameters
included: the sum runs over the reduction plan's ``norm_group``); a step *overflows* when that
norm is not finite. Every rank reaches the same verdict.
"""

import contextlib

import torch

import deepspeed.comm as dist
from deepspeed.runtime.precision.overflow import agreed_overflow
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.offload import host_math
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as Kind
from deepspeed.runtime.zero.gradients.grad_pipeline import GradPipeline
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.runtime.zero.gradients.reduction_spec import ReductionPlan


class _Timed:

    __slots__ = ("timer", )

    def __init__(self, timer):
        self.timer = timer

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.stop()
        return False


# Reductions in flight at once during a pass beside the one just launched (stages 1-3 with overlap_comm);
# older ones are completed (folded into the partition, their output freed) as new ones launch, so memory
# stays bounded. Completing one only makes the compute stream wait for it on the device.
MAX_IN_FLIGHT = 1


def fp32_grads(parts):
    """The window gradient as float32 tensors: the partitions themselves, or float32 copies of them."""
    return [p if p.dtype == torch.float32 else p.to(torch.float32) for p in parts]


class ZeroStage:
    """Base of the stage classes (see the module docstring)."""

    stage = None
    publishes_grads = False  # stage 0 with fp32 parameters: reduced gradients appear as param.grad

    def __init__(self, config, optimizer, clock, *, device, group, reduction=None):
        self.config = config
        # Per parameter: the group its gradient is reduced and partitioned over, and the mean's divisor.
        self.reduction = reduction if reduction is not None else ReductionPlan.single(group)
        self.optimizer = optimizer
        self.clock = clock
        self.device = torch.device(device)
        self.group = group
        if dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world_size, self.rank = 1, 0
        self.timers = None
        self._norm = None
        self.geometry = None
        self.pipeline = None

    def _build_pipeline(self, geometry, *, reduce_in_every_backward, in_flight_limit, **callbacks):
        clock = self.clock
        if reduce_in_every_backward:

            def reduce_now():
                return not clock.deferred()
        else:

            def reduce_now():
                return clock.at_boundary() and not clock.deferred()

        self.geometry = geometry
        self.pipeline = GradPipeline(geometry,
                                     reduce_now=reduce_now,
                                     gas_fn=clock.gradient_accumulation_steps,
                                     requires_loss_scale=self.config.requires_loss_scale,
                                     average=self.config.average,
                                     in_flight_limit=in_flight_limit,
                                     publishes_grads=self.publishes_grads,
                                     **callbacks)
        return self.pipeline

    def _geometry_args(self, part_device=None):
        """The keyword arguments every geometry takes, from the stage config."""
        cfg = self.config
        return dict(device=self.device,
                    group=self.group,
                    reduction=self.reduction,
                    comm_dtype=cfg.comm_dtype,
                    accum_dtype=cfg.accum_dtype,
                    part_device=part_device,
                    pin_memory=cfg.pin_memory)

    def _in_flight_limit(self):
        return MAX_IN_FLIGHT if self.config.overlap_comm else 0

    @property
    def params(self):
        """The trainable parameters this stage owns (their gradients go to ``pipeline``)."""
        return self.pipeline.params

    def set_timers(self, timers):
        """Time this stage's phases on ``timers`` (a ``SynchronizedWallClockTimer`` registry, or its no-op)."""
        self.timers = timers
        self.pipeline.timers = timers

    def timed(self, name):
        """A context timing ``name`` on the stage's timers (a no-op context without them)."""
        return _Timed(self.timers(name)) if self.timers is not None else contextlib.nullcontext()

    # ------------------------------------------------------------ the window
    def after_forward(self):
        """The engine's forward returned (stage 3 ends its first-forward trace)."""

    def compiled(self):
        """The module was just compiled (torch.compile is loaded): hooks compiled code must not trace are re-marked."""

    def empty_partition_cache(self):
        """Free gathered copies of partitioned parameters that nothing uses (stage 3; nothing to free otherwise)."""

    def window_is_empty(self):
        """No backward reached this engine since the window began."""
        return self.pipeline.backward_count == 0

    zenflow = None  # ZenFlow's step (``runtime/zenflow``) on stages 1-3 when the config enables it

    def finish_window(self):
        """Complete every reduction of the window; the window gradient is then final. In this order: the buckets,
        then the tensor-parallel replicas the geometry keeps partial, then ZenFlow's reads of the final gradient."""
        self._norm = None
        self.pipeline.finish_window()
        self.geometry.reduce_replicas()
        if self.zenflow is not None:
            self.zenflow.before_step()

    def global_grad_norm(self):
        """The window gradient's global L2 norm, a 0-dim float32 tensor on the device (cached until zeroed)."""
        if self._norm is None:
            with ds_range("DS::grad_norm"):
                sq = torch.zeros((), dtype=torch.float32, device=self.device)
                by_device = {}
                for part in self.geometry.partitions():
                    by_device.setdefault(part.device, []).append(part)
                for device, parts in by_device.items():
                    if device.type == "cpu" and sum(p.numel() for p in parts) >= host_math.PARALLEL_MIN:
                        # host partitions (offload): reduced on every core, not by one torch call
                        partial = host_math.sum_of_squares(parts)
                        sq = sq + torch.tensor(partial, dtype=torch.float32, device=self.device)
                    else:
                        sq = sq + grad_ops.partial_sq_norm(parts, device=self.device)
                for param in self.norm_excluded:  # copies another rank counts (tied pipeline weights)
                    piece = self.local_grad(param)
                    if piece is not None and piece.numel():
                        sq = sq - piece.detach().float().pow(2).sum().to(self.device)
                sq = sq + self._extra_sq_norm()
                group, size = self._norm_group()
                if not self.geometry.replicated and size > 1:
                    dist.all_reduce(sq, group=group)
                if self.norm_group is not None:  # the other pipeline stages' parameters
                    dist.all_reduce(sq, group=self.norm_group)
                self._norm = sq.clamp(min=0).sqrt()
        return self._norm

    def _norm_group(self):
        """``(group, size)`` over which the partitions' squared norms add up to the global one: the reduction plan's
        ``norm_group`` (a tensor-parallel model: the stage's data x tensor-parallel ranks), else the stage's group."""
        if self.reduction.norm_size:
            return self.reduction.norm_group, self.reduction.norm_size
        return self.group, self.world_size

    def _extra_sq_norm(self):
        """A correction to the sum of the partitions' squared norms (stage 3: pieces held on several ranks)."""
        return 0.0

    speculative = None  # a SpeculativeStep (offload_optimizer.super_offload, stages 1-3), or None
    # Pipeline parallelism: the norm is the whole model's. ``norm_group`` sums the squared norm over the other
    # stages; ``norm_excluded`` are parameters whose gradient another stage counts (tied copies).
    norm_group = None
    norm_excluded = ()

    def found_overflow(self):
        """Whether the window gradient holds a NaN or an infinity on any rank (the same answer on every rank)."""
        # The norm is summed over the reduction group, which holds every rank the window gradient spans (expert
        # groups lie inside it), so the finding is already agreed (precision/overflow.py).
        overflow = agreed_overflow(not bool(torch.isfinite(self.global_grad_norm()).item()))
        if overflow and self.speculative is not None:
            self.speculative.overflow()
        return overflow

    @property
    def speculative_stats(self):
        """The counters of the speculative step (``super_offload``), or None without it."""
        return self.speculative.stats if self.speculative is not None else None

    def scale_grads(self, coef):
        """Multiply the window gradient by ``coef`` (a 0-dim device tensor; clipping).

        With an offloaded step that applies the coefficient as it reads the gradient (``host_step.fuses_clip``,
        a float32 window) the coefficient is kept for the step instead: the same products, no host pass. ZenFlow
        applies the coefficient to what each of its parts reads.
        """
        if self.zenflow is not None:
            self.zenflow.set_clip(coef)
            return
        host_step = getattr(self, "host_step", None)
        if host_step is not None and host_step.fuses_clip and self.config.accum_dtype == torch.float32:
            self._step_grad_scale = float(coef)
            return
        with ds_range("DS::clip"):
            by_device = {}
            for part in self.geometry.partitions():
                by_device.setdefault(part.device, []).append(part)
            for device, parts in by_device.items():
                if device.type == "cpu":  # host partitions: the value is read anyway; a coefficient of 1 skips a pass
                    value = float(coef)
                    if value != 1.0:
                        grad_ops.scale_(parts, value)
                    continue
                grad_ops.scale_(parts, coef.to(device) if torch.is_tensor(coef) else coef)

    def optimizer_step(self):
        raise NotImplementedError

    _step_grad_scale = 1.0  # a clipping coefficient the offloaded step applies (see scale_grads)

    def _take_grad_scale(self):
        scale, self._step_grad_scale = self._step_grad_scale, 1.0
        return scale

    def zero_window(self):
        if self.speculative is not None:
            self.speculative.new_window()
        self._step_grad_scale = 1.0
        self._norm = None
        self.pipeline.zero_window()

    def release(self):
        self.pipeline.release()

    def checkpoint(self):
        """This stage's checkpoint export and import: a
        :class:`~deepspeed.runtime.checkpoint.stage_checkpoint.StageCheckpoint` (what the checkpoint code calls)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint support")

    def set_epoch_length(self, steps):
        """The training data's epoch length in optimizer steps (ZenFlow's "epoch" selection strategy reads it)."""
        if self.zenflow is not None:
            self.zenflow.set_steps_per_epoch(steps)

    def extra_state(self):
        """State a checkpoint keeps beside the masters and the inner optimizer (ZenFlow's), or None."""
        return self.zenflow.export_state() if self.zenflow is not None else None

    def load_extra_state(self, state):
        """Restore :meth:`extra_state` after the masters and optimizer were loaded (collective; None: the checkpoint
        has none, and ZenFlow starts afresh)."""
        if self.zenflow is not None:
            if state is None:
                self.zenflow.reset()
            else:
                self.zenflow.import_state(state)

    def _masters_current(self):
        """Before the fp32 masters or the optimizer state are read: wait for anything still updating them (the
        stages add their own; here a speculative step not yet decided is undone)."""
        if self.speculative is not None:
            self.speculative.before_read()

    # ------------------------------------------------------------ state table
    def state_table(self):
        """``{OffloadStateTypeEnum: [tensors]}``: the tensors of this stage's state on its device now (what
        ``engine.offload_states`` moves; the engine adds the module's parameters). Host-tier state
        (``offload_optimizer``) is not listed: it is on the host already."""
        grads, buffers = self.geometry.state_tensors()
        table = {kind: [] for kind in Kind}
        table[Kind.lp_grads] = grads
        table[Kind.contiguous_grad_buffer] = buffers
        if not self.config.offload_optimizer:
            table[Kind.hp_params] = self._master_tensors()
            table[Kind.optim_states] = [
                value for state in self.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
            ]
        return table

    def _master_tensors(self):
        return list(self.masters)

    def host_kinds(self):
        """The kinds this stage keeps on the host by configuration (``offload_optimizer``, ``offload_param``)."""
        kinds = set()
        if self.config.offload_optimizer:
            kinds |= {Kind.hp_params, Kind.optim_states, Kind.lp_grads}
        if self.config.offload_param:
            kinds.add(Kind.lp_params)
        return kinds

    def offload_unsupported(self):
        """Why this stage's state cannot be moved off the device and back, or None."""
        host_step = getattr(self, "host_step", None)
        reasons = [(self.zenflow is not None, "ZenFlow (zero_optimization.zenflow)"),
                   (self.speculative is not None, "offload_optimizer.super_offload"),
                   (host_step is not None and host_step.share is not None, "offload_optimizer.ratio < 1"),
                   (host_step is not None and host_step.swap is not None, "offload_optimizer.device 'nvme'"),
                   (getattr(self, "param_tier", None) is not None, "offload_param.device 'nvme'")]
        for bad, what in reasons:
            if bad:
                return what
        return None

    def before_offload(self, include):
        """Complete whatever still reads or writes the state (an overlapped step) before it moves."""
        self._masters_current()
        host_step = getattr(self, "host_step", None)
        if host_step is not None:
            host_step.finish()
        self.geometry.settle()

    def after_offload(self, offloaded):
        """The kinds in ``offloaded`` are on the host now."""

    def after_reload(self):
        """The state is back on the device."""

    # ------------------------------------------------------------- accessors
    def params_modified(self, param):
        """``param``'s stored value was rewritten outside the engine (ZeRO-3 ``GatheredParameters``)."""

    def local_range(self, param):
        """``(start, length)``: this rank holds elements ``[start, start + length)`` of ``param``'s flat view; they
        are the first ``length`` elements of ``local_grad(param).reshape(-1)`` and of ``local_fp32_param(param)``
        (stage 0: the whole parameter; stage 3: the shard, padded past ``length``)."""
        return 0, self.pipeline.slot(param).numel

    def local_grad(self, param):
        """This rank's piece of the window gradient of ``param`` (stage 0: the whole gradient, shaped)."""
        return self.full_grad(param)

    def local_fp32_param(self, param):
        """This rank's piece of the fp32 value of ``param`` (stage 0: the whole value, shaped)."""
        return self.fp32_param(param)


def global_rank():
    """This process's rank in the default group (0 without one): what names its swap folders."""
    return dist.get_rank() if dist.is_initialized() else 0


def trainable_groups(optimizer):
    """Per optimizer param group, its trainable parameters (each parameter once, in the first group naming it)."""
    seen = set()
    groups = []
    for param_group in optimizer.param_groups:
        trainable = []
        for p in param_group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                trainable.append(p)
        groups.append(trainable)
    return groups
