# SPDX-License-Identifier: Apache-2.0
"""The gradient pipeline: one object per engine that takes every gradient contribution to a reduced window.

The backward session hands a :class:`GradPipeline` each contribution of a parameter the
engine owns (``contribute(param, grad)``, the factor fixed when the pipeline joined the
session). The pipeline is the same for every ZeRO stage; what differs is its *geometry*
(``reduction.py``): where contributions are staged, which collective reduces a bucket and
where the result is folded (all-reduce into the replicated window gradient for stage 0,
reduce-scatter into the rank's partitions for stages 1 and 2, one reduce-scatter per
parameter unit for stage 3).

Buckets and readiness. The geometry cuts the owned parameters into buckets, fixed at
construction and identical on every rank. In each backward a bucket is *complete* once
every one of its parameters delivered a contribution; its pending gradients are then
copied into its staging in one pass (``grad_ops``), so the Python work per gradient is a
dictionary insert and a counter. Pending gradients are also copied in when they exceed
``flush_numel`` elements, so a bucket that never completes (a parameter unused in this
backward) holds a bounded amount of memory. A *held* bucket (:meth:`GradPipeline.hold`, a
ZeRO-3 leaf module's) completes only when its holder calls :meth:`GradPipeline.release_hold`,
at one point of the backward on every rank, whichever of its parameters delivered.

Passes. A backward that reduces (the stage's policy says when: stages 0 and 1 at the
accumulation boundary, stages 2 and 3 in every backward, neither while reduction is
deferred) runs a *pass*: buckets are launched in index order, each as soon as it and
every lower bucket were launched, at most ``in_flight_limit`` reductions being in flight
beside the newest; the epilogue launches the rest (zero-filled where this rank has
nothing) and waits. Every rank therefore issues the same collectives in the same order.

Exactness rests on linearity (reduce(a) + reduce(b) = reduce(a + b)):

* contributions of a backward that does not reduce stay staged; the next pass, or
  :meth:`finish_window` at the step, reduces them;
* a contribution to a bucket the running pass already launched (a parameter reached
  again by a nested graph task, reentrant checkpointing) goes to a *late* store that a
  second pass reduces after this one, once the ranks agreed that one of them has some.

States. Every bucket carries a :class:`BucketState` and the pipeline a :class:`Phase`;
the hook path checks them, so a contribution in a state where it would corrupt a bucket
raises :class:`PipelineStateError` instead.

On a world of one, reduction is the identity: the geometry stages contributions straight
into the window gradient and launches nothing.
"""

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepspeed.runtime.zero.gradients import transport as transport_mod
from deepspeed.runtime.zero.gradients.profiling import ds_range
from deepspeed.utils.timer import BACKWARD_REDUCE_GLOBAL_TIMER

# Pending (not yet copied-in) gradient elements per bucket before a partial copy-in.
FLUSH_NUMEL = 1 << 22


class PipelineStateError(RuntimeError):
    """A gradient or a call reached the pipeline in a state where it cannot be taken correctly."""


class Phase(enum.Enum):
    IDLE = "idle"  # no backward of this engine is running
    BACKWARD = "backward"  # inside a backward session this pipeline joined


class BucketState(enum.Enum):
    IDLE = "idle"  # nothing staged since the window began or the bucket was last folded
    FILLING = "filling"  # contributions staged or pending, not launched
    IN_FLIGHT = "in_flight"  # its reduction was launched; its staging belongs to the collective
    FOLDED = "folded"  # its reduction is folded into the window gradient; its staging is free


@dataclass(eq=False)
class GradSlot:
    """One owned parameter's place in its bucket."""
    param: torch.Tensor
    bucket: "GradBucket"
    offset: int  # flat staging: element offset in the bucket; rank-major staging: column offset in a row
    numel: int
    shape: torch.Size
    shard: int = 0  # rank-major staging: the parameter's columns (its shard size)
    serial: int = -1  # the pipeline's backward serial that last delivered a contribution


@dataclass(eq=False)
class GradBucket:
    """A set of parameters staged, reduced and folded together (see the module docstring)."""
    index: int
    slots: list = field(default_factory=list)  # owned trainable parameters, in layout order
    state: BucketState = BucketState.IDLE
    ready: int = 0  # parameters that delivered a contribution in the running backward
    pending: dict = field(default_factory=dict)  # slot -> gradient not yet copied in
    pending_numel: int = 0
    staging: Optional[torch.Tensor] = None  # per-bucket staging, for geometries that allocate it on demand
    held: bool = False  # completes only on release_hold (or at the epilogue), never on its contributions alone
    hold_serial: int = -1  # the backward serial whose hold was released
    spec: Optional[object] = None  # its ReductionSpec: the group it is reduced over, the mean's divisor
    scale: float = 1.0  # what every contribution is multiplied by beside the session factor (the mean's 1/divisor)

    @property
    def expected(self):
        """Readiness that completes the bucket in one backward: every parameter, and the hold if it has one."""
        return len(self.slots) + (1 if self.held else 0)


class _Pass:
    """One reduction pass over every bucket, in index order."""

    __slots__ = ("next", )

    def __init__(self):
        self.next = 0


class GradPipeline:
    """The gradient sink of one engine (see the module docstring).

    ``reduce_now()`` says whether a backward starting now runs a pass; ``gas_fn()`` gives the
    engine's GAS (the session scales by it). With ``average`` the mean's ``1/divisor`` of each
    bucket's :class:`~deepspeed.runtime.zero.gradients.reduction_spec.ReductionSpec` (``1/W`` for a plain
    data-parallel bucket) is folded into its contributions' factor, so that a reduction is a plain
    sum. ``on_bucket_complete(bucket)`` runs when a bucket received every contribution of a
    backward, ``on_backward_end(reduced)`` after each backward's epilogue (``reduced``: it ran a
    pass) or failure.
    """

    def __init__(self,
                 geometry,
                 *,
                 reduce_now,
                 gas_fn,
                 requires_loss_scale,
                 average=True,
                 in_flight_limit=None,
                 on_bucket_complete=None,
                 on_backward_end=None,
                 publishes_grads=False,
                 flush_numel=FLUSH_NUMEL):
        self.geometry = geometry
        self.buckets = geometry.buckets
        self.params = [slot.param for bucket in self.buckets for slot in bucket.slots]
        self._slots = {slot.param: slot for bucket in self.buckets for slot in bucket.slots}
        self._reduce_now = reduce_now
        self._gas_fn = gas_fn
        self.requires_loss_scale = requires_loss_scale
        for bucket in self.buckets:
            spec = bucket.spec if bucket.spec is not None else geometry.spec
            bucket.spec = spec
            bucket.scale = spec.scale(average)
        self._limit = in_flight_limit
        self._on_bucket_complete = on_bucket_complete
        self._on_backward_end = on_backward_end
        self.publishes_grads = publishes_grads
        self._flush_numel = flush_numel
        self._identity = geometry.identity
        self.phase = Phase.IDLE
        self._serial = 0
        self._factor = None
        self._pass = None
        self._flights = deque()
        self._late = {}
        self._late_dirty = False
        self._unreduced = False  # a backward ended without a pass since the last pass
        self.backward_count = 0  # backward calls that reached this pipeline in this window
        self.timers = None  # a timer registry (wall_clock_breakdown): "bwd_allreduce" times the waits on reductions

    # ------------------------------------------------------- session interface
    @property
    def gradient_accumulation_steps(self):
        return self._gas_fn()

    def begin_backward(self, session, factor):
        """This pipeline joins a backward session whose contributions it scales by ``factor``."""
        if self.phase is not Phase.IDLE:
            raise PipelineStateError("a backward session began while another one was still running on this engine "
                                     "(two backward calls at once through one engine are not supported)")
        self.phase = Phase.BACKWARD
        self._serial += 1
        self._factor = factor
        self.backward_count += 1
        for bucket in self.buckets:
            bucket.ready = 0
        if self._reduce_now():
            self._pass = _Pass()

    def contribute(self, param, grad):
        """Take this backward's contribution ``grad`` of ``param`` (``param.grad`` was already cleared)."""
        if self.phase is not Phase.BACKWARD:
            raise PipelineStateError(f"a gradient of a parameter of shape {tuple(param.shape)} arrived while the "
                                     f"pipeline is {self.phase.value}: no backward session of this engine is open")
        slot = self._slots[param]
        bucket = slot.bucket
        state = bucket.state
        run = self._pass
        if state is BucketState.IN_FLIGHT or (run is not None and bucket.index < run.next and not self._identity):
            if run is None:
                raise PipelineStateError(f"a gradient reached bucket {bucket.index}, whose reduction is in flight, "
                                         f"outside of a reduction pass; it would race with the collective")
            self._add_late(slot, grad)
            return
        if slot.serial != self._serial:
            slot.serial = self._serial
            bucket.pending[slot] = grad
            bucket.pending_numel += slot.numel
            bucket.state = BucketState.FILLING
            bucket.ready += 1
            if bucket.ready == bucket.expected:
                self._complete(bucket)
            elif bucket.pending_numel >= self._flush_numel:
                self._flush(bucket)
        else:  # the same parameter again in this backward (a nested graph task)
            previous = bucket.pending.get(slot)
            if previous is None:
                bucket.pending[slot] = grad
                bucket.pending_numel += slot.numel
                bucket.state = BucketState.FILLING
            else:
                bucket.pending[slot] = previous + grad

    def end_backward(self, session):
        """Epilogue of a backward: copy in what is pending; in a pass, launch the rest and wait."""
        reduced = self._pass is not None
        try:
            with ds_range("DS::epilogue"):
                for bucket in self.buckets:
                    if bucket.pending:
                        self._flush(bucket)
                run = self._pass
                if run is not None:
                    timer = self.timers(BACKWARD_REDUCE_GLOBAL_TIMER) if self.timers is not None else None
                    if timer is not None:
                        timer.start()
                    self._launch_until(run, len(self.buckets))
                    self._drain()
                    if timer is not None:
                        timer.stop()
                    self._pass = None
                    self._unreduced = False
                    if session.nested or self._late_dirty:
                        self._reduce_late()
                else:
                    self._unreduced = True
        finally:
            self._pass = None
            self.phase = Phase.IDLE
            if self._on_backward_end is not None:
                self._on_backward_end(reduced)

    def abort_backward(self, session):
        """This backward failed: drop what it left pending and complete the collectives it started."""
        try:
            for bucket in self.buckets:
                bucket.pending.clear()
                bucket.pending_numel = 0
            while self._flights:
                transport_mod.wait(self._flights.popleft()[1].work)
        finally:
            self._pass = None
            self.phase = Phase.IDLE
            if self._on_backward_end is not None:
                self._on_backward_end(False)

    # ----------------------------------------------------------------- holds
    def hold(self, index):
        """Bucket ``index`` completes in a backward only when :meth:`release_hold` says so (or at the epilogue).

        For a bucket whose parameters deliver a data-dependent subset of gradients (a ZeRO-3
        leaf module routing to experts): counting contributions alone would complete it on
        some ranks and not on others, and their collectives would no longer be issued in the
        same order.
        """
        self.buckets[index].held = True

    def release_hold(self, index):
        """The holder of bucket ``index`` is done with the running backward: the bucket completes now.

        Its parameters that delivered nothing in this backward count as delivered (their share
        is zero; a gradient arriving later is added to the bucket as a repeat). Called at the
        same point of the backward on every rank. No-op outside a backward of this engine and
        after the first call in one backward.
        """
        bucket = self.buckets[index]
        if self.phase is not Phase.BACKWARD or not bucket.held or bucket.hold_serial == self._serial:
            return
        bucket.hold_serial = self._serial
        for slot in bucket.slots:
            if slot.serial != self._serial:
                slot.serial = self._serial
                bucket.ready += 1
        bucket.ready += 1
        if bucket.ready == bucket.expected:
            self._complete(bucket)

    # --------------------------------------------------------------- buckets
    def _complete(self, bucket):
        self._flush(bucket)
        if self._on_bucket_complete is not None:
            self._on_bucket_complete(bucket)
        run = self._pass
        if run is not None and bucket.index == run.next:
            self._launch_ready(run)

    def _flush(self, bucket):
        """Copy the pending gradients of ``bucket`` into its staging, times this backward's factor."""
        pending = bucket.pending
        if not pending:
            return
        if len(pending) == len(bucket.slots):
            slots = bucket.slots
            grads = [pending[slot] for slot in slots]
        else:
            slots = [slot for slot in bucket.slots if slot in pending]
            grads = [pending[slot] for slot in slots]
        self.geometry.copy_in(bucket, slots, grads, self._factor * bucket.scale)
        pending.clear()
        bucket.pending_numel = 0
        if self._identity:  # on a world of one the copy-in is the whole reduction
            bucket.state = BucketState.FOLDED

    def _add_late(self, slot, grad):
        self.geometry.add_late(self._late, slot, grad, self._factor * slot.bucket.scale)
        self._late_dirty = True

    # ------------------------------------------------------------- reduction
    def _launch_ready(self, run):
        buckets = self.buckets
        while run.next < len(buckets) and buckets[run.next].ready == buckets[run.next].expected:
            self._launch(buckets[run.next])
            run.next += 1

    def _launch_until(self, run, end):
        while run.next < end:
            self._launch(self.buckets[run.next])
            run.next += 1

    def _launch(self, bucket, own=True, late=None):
        """Start the reduction of ``bucket``: its own staging, or (``own=False``) ``late`` (None: zeros)."""
        if own and bucket.pending:
            self._flush(bucket)
        with ds_range("DS::reduce_launch"):
            flight = self.geometry.launch(bucket, own, late)
        if flight is None:  # nothing to reduce (a world of one, or no trainable parameter)
            if own:
                bucket.state = BucketState.FOLDED
            return
        if own:
            bucket.state = BucketState.IN_FLIGHT
        self._flights.append((bucket, flight, own))
        limit = self._limit
        if limit is not None:
            while len(self._flights) > limit:
                self._finish_oldest()

    def _finish_oldest(self):
        bucket, flight, own = self._flights.popleft()
        with ds_range("DS::fold"):
            transport_mod.wait(flight.work)
            self.geometry.fold(flight)
        if own:
            bucket.state = BucketState.FOLDED

    def _drain(self):
        while self._flights:
            self._finish_oldest()

    def _full_pass(self, late=None):
        """Reduce every bucket, in order: its own staging, or (``late`` given) its late store."""
        for bucket in self.buckets:
            if late is None:
                self._launch(bucket)
            else:
                self._launch(bucket, own=False, late=late.get(bucket.index))
        self._drain()

    def _reduce_late(self):
        # Only a rank whose nested graph task reached a launched bucket holds late data; the
        # ranks agree whether any does, so that all or none run the extra pass.
        dirty = self._late_dirty
        if self.geometry.world_size > 1:
            flag = torch.tensor([1.0 if dirty else 0.0], device=self.geometry.device)
            import deepspeed.comm as dist
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.geometry.group)
            dirty = bool(flag.item() > 0)
        if dirty:
            late, self._late = self._late, {}
            self._full_pass(late)
        self._late = {}
        self._late_dirty = False

    # ------------------------------------------------------ window interface
    def finish_window(self):
        """Reduce whatever the window still holds unreduced; afterwards the window gradient is complete."""
        if self.phase is not Phase.IDLE:
            raise PipelineStateError("finish_window() during a backward of this engine")
        if self._unreduced:
            with ds_range("DS::finish_window"):
                self._full_pass()
            self._unreduced = False

    def zero_window(self):
        """Start a new accumulation window with no gradient."""
        while self._flights:
            transport_mod.wait(self._flights.popleft()[1].work)
        for bucket in self.buckets:
            bucket.pending.clear()
            bucket.pending_numel = 0
            bucket.staging = None
            bucket.state = BucketState.IDLE
        self._late = {}
        self._late_dirty = False
        self._unreduced = False
        self.backward_count = 0
        self.geometry.zero_window()

    def release(self):
        self.zero_window()
        self.geometry.release()

    # ------------------------------------------------------------- accessors
    def slot(self, param):
        return self._slots[param]

    def owns(self, param):
        return param in self._slots
