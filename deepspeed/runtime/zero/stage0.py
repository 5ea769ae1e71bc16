# SPDX-License-Identifier: Apache-2.0
"""ZeRO stage 0: replicated gradients, all-reduced in fixed-order buckets.

``ReplicatedGradients`` is the gradient sink of a stage-0 engine: the backward
session hands it every contribution, already paired with its factor, and it keeps
the gradient of one accumulation window in a flat buffer (``acc``), in the
accumulation dtype (fp32 by default).

Reduction. Outside the boundary micro-step, contributions are only added locally.
In a backward that reduces (the boundary micro-step, unless reduction is deferred by
``no_sync``, ``coalesce_grad_reduction`` or unmanaged accumulation) a *pass* runs:
each bucket is all-reduced as soon as all its parameters delivered their
contribution and every lower-numbered bucket was launched; the epilogue launches
what is left, in order, and waits. Every rank therefore issues the same all-reduces
in the same order, even when a parameter is unused on one rank only.

Reduction is linear, which keeps every other case exact:

* contributions that arrive after a pass over ``acc`` (a second backward at the
  boundary, a backward before ``step`` after the boundary) go to ``delta``, which a
  later pass reduces and adds into ``acc``;
* a contribution arriving for a bucket that was already launched in the running
  pass (a parameter reached again from a reentrant-checkpoint graph task) goes to
  ``late``, reduced once the pass is over (the ranks agree first whether any has
  such data, so no rank waits alone).

The 1/W of the mean is folded into the contribution factor, so a reduction is a
plain sum.
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.grad_buffer import FlatLayout

LOCAL, REDUCED = "local", "reduced"


class _Pass:
    """One reduction pass over a buffer, in bucket order."""

    def __init__(self, buffer, serial, num_buckets):
        self.buffer = buffer
        self.serial = serial
        self.next_launch = 0
        self.ready = [0] * num_buckets
        self.works = []


class ReplicatedGradients:
    """Gradient sink of a stage-0 engine (see the module docstring for the contract)."""

    def __init__(self, params, *, accum_dtype, device, bucket_numel, group, average, comm_dtype, gas_fn,
                 reduce_in_backward_fn, requires_loss_scale, publish_grads):
        self.layout = FlatLayout(params, bucket_numel)
        self.params = self.layout.params
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._dp_factor = 1.0 / self.world_size if average else 1.0
        self._comm_dtype = comm_dtype if comm_dtype is not None and comm_dtype != accum_dtype else None
        self._gas_fn = gas_fn
        self._reduce_in_backward = reduce_in_backward_fn
        self.requires_loss_scale = requires_loss_scale
        self._publish = publish_grads
        self.acc = self.layout.new_buffer(accum_dtype, device)
        self._acc_views = {p: self.layout.view(self.acc, p) for p in self.params}
        self._delta = None
        self._late = None
        self._slots = self.layout.slots
        self._bucket_sizes = [len(b.params) for b in self.layout.buckets]
        self.state = LOCAL
        self._delta_dirty = False
        self._late_dirty = False
        self._pass = None
        self._serial = 0
        self._published = False

    # ------------------------------------------------------- session interface
    @property
    def gradient_accumulation_steps(self):
        return self._gas_fn()

    def begin_backward(self, session):
        self.unpublish_grads()
        self._serial += 1
        if self._reduce_in_backward():
            self._pass = _Pass(self.acc if self.state == LOCAL else self._delta_buffer(), self._serial,
                               len(self.layout.buckets))
            if self.state == LOCAL:
                self.state = REDUCED
            else:
                self._delta_dirty = False  # the pass takes the pending delta with it

    def on_grad(self, param, grad, factor):
        slot = self._slots[param]
        factor = factor * self._dp_factor
        run = self._pass
        if run is None:
            if self.state == LOCAL:
                self._acc_views[param].add_(grad, alpha=factor)
            else:
                self.layout.view(self._delta_buffer(), param).add_(grad, alpha=factor)
                self._delta_dirty = True
            return
        bucket = slot.bucket
        if bucket < run.next_launch:
            self.layout.view(self._late_buffer(), param).add_(grad, alpha=factor)
            self._late_dirty = True
            return
        if run.buffer is self.acc:
            self._acc_views[param].add_(grad, alpha=factor)
        else:
            self.layout.view(run.buffer, param).add_(grad, alpha=factor)
        if slot.fired_serial != run.serial:
            slot.fired_serial = run.serial
            run.ready[bucket] += 1
            if bucket == run.next_launch and run.ready[bucket] == self._bucket_sizes[bucket]:
                self._launch_ready(run)

    def end_backward(self, session):
        run = self._pass
        if run is not None:
            self._pass = None
            self._launch_all(run)
            self._wait(run)
            if session.nested or self._late_dirty:
                self._reduce_late()
            if self._publish:
                self.publish_grads()

    def abort_backward(self, session):
        run = self._pass
        self._pass = None
        if run is not None:
            for work, _, _ in run.works:
                if work is not None:
                    work.wait()

    # ------------------------------------------------------------- reduction
    def _launch_ready(self, run):
        buckets = self.layout.buckets
        while run.next_launch < len(buckets) and run.ready[run.next_launch] == self._bucket_sizes[run.next_launch]:
            self._launch(run, buckets[run.next_launch])
            run.next_launch += 1

    def _launch_all(self, run):
        buckets = self.layout.buckets
        while run.next_launch < len(buckets):
            self._launch(run, buckets[run.next_launch])
            run.next_launch += 1

    def _launch(self, run, bucket):
        if self.world_size == 1:
            return
        view = self.layout.bucket_view(run.buffer, bucket)
        if self._comm_dtype is not None:
            staged = view.to(self._comm_dtype)
            run.works.append((dist.all_reduce(staged, group=self.group, async_op=True), view, staged))
        else:
            run.works.append((dist.all_reduce(view, group=self.group, async_op=True), None, None))

    def _wait(self, run):
        for work, view, staged in run.works:
            work.wait()
            if staged is not None:
                view.copy_(staged)
        run.works = []
        if run.buffer is not self.acc:
            self.acc.add_(run.buffer)
            run.buffer.zero_()

    def _full_pass(self, buffer):
        run = _Pass(buffer, -1, len(self.layout.buckets))
        self._launch_all(run)
        self._wait(run)

    def _reduce_late(self):
        # Only ranks that ran a reentrant graph task can hold late contributions; agree
        # on whether any rank does, so that all or none run the extra pass.
        flag = torch.tensor([1.0 if self._late_dirty else 0.0], device=self.acc.device)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() > 0:
            self._full_pass(self._late_buffer())
        self._late_dirty = False

    def _delta_buffer(self):
        if self._delta is None:
            self._delta = torch.zeros_like(self.acc)
        return self._delta

    def _late_buffer(self):
        if self._late is None:
            self._late = torch.zeros_like(self.acc)
        return self._late

    # ------------------------------------------------------ engine interface
    def finish_window(self):
        """Complete every reduction of this window; afterwards ``acc`` holds the reduced gradient."""
        if self._pass is not None:  # a backward whose epilogue never ran
            run, self._pass = self._pass, None
            self._launch_all(run)
            self._wait(run)
        if self.state == LOCAL:
            self._full_pass(self.acc)
            self.state = REDUCED
        elif self._delta_dirty:
            self._full_pass(self._delta)
            self._delta_dirty = False
        if self._late_dirty:
            self._reduce_late()

    def zero_window(self):
        """Start a new accumulation window with no gradient."""
        self.abort_backward(None)
        self.unpublish_grads()
        self.acc.zero_()
        for buffer in (self._delta, self._late):
            if buffer is not None:
                buffer.zero_()
        self.state = LOCAL
        self._delta_dirty = False
        self._late_dirty = False

    def grad_view(self, param):
        """The window's gradient of ``param`` (reduced once ``finish_window`` ran), shaped like it."""
        return self._acc_views[param]

    def publish_grads(self):
        """Expose the reduced gradient as ``param.grad`` (views of ``acc``; fp32 parameters only)."""
        for param, view in self._acc_views.items():
            param.grad = view
        self._published = True

    def unpublish_grads(self):
        if self._published:
            self._published = False
            for param in self.params:
                param.grad = None

    def release(self):
        self.unpublish_grads()
        self.acc = None
        self._acc_views = {}
        self._delta = self._late = None


class Stage0:
    """What the engine's optimizer sees of stage 0: replicated gradients, and fp32 masters for 16-bit models.

    Step interface shared by every stage: ``finish_window``, ``found_overflow``,
    ``global_grad_norm``, ``scale_grads``, ``optimizer_step``, ``zero_window``, plus the
    accessors behind ``deepspeed.utils.safe_get_*``.
    """

    stage = 0

    def __init__(self, params, inner_optimizer, *, accum_dtype, device, bucket_numel, group, average, comm_dtype,
                 gas_fn, reduce_in_backward_fn, requires_loss_scale):
        from deepspeed.runtime.precision.master_params import MasterParams
        params = list(params)
        low_precision = any(p.dtype != torch.float32 for p in params)
        self.grads = ReplicatedGradients(params,
                                         accum_dtype=accum_dtype,
                                         device=device,
                                         bucket_numel=bucket_numel,
                                         group=group,
                                         average=average,
                                         comm_dtype=comm_dtype,
                                         gas_fn=gas_fn,
                                         reduce_in_backward_fn=reduce_in_backward_fn,
                                         requires_loss_scale=requires_loss_scale,
                                         publish_grads=not low_precision and accum_dtype == torch.float32)
        self.masters = MasterParams(params, self.grads.grad_view) if low_precision else None
        if self.masters is not None and inner_optimizer is not None:
            self.masters.swap_into(inner_optimizer.param_groups)
        self.group = group

    # ------------------------------------------------------------------ step
    def finish_window(self):
        self.grads.finish_window()

    def found_overflow(self):
        # The buffer is already all-reduced, so every rank computes the same answer.
        return not bool(torch.isfinite(self.grads.acc).all().item())

    def global_grad_norm(self):
        return torch.linalg.vector_norm(self.grads.acc, 2.0, dtype=torch.float32)

    def scale_grads(self, coef):
        self.grads.acc.mul_(coef)

    def optimizer_step(self, inner):
        if self.masters is None:
            self.grads.publish_grads()
            inner.step()
        else:
            inner.step()
            self.masters.copy_to_model()

    def zero_window(self):
        self.grads.zero_window()

    def release(self):
        self.grads.release()

    # ------------------------------------------------------------- accessors
    def full_grad(self, param):
        return self.grads.grad_view(param)

    def set_full_grad(self, param, value):
        self.grads.grad_view(param).copy_(value)

    def fp32_param(self, param):
        master = self.masters.master_of(param) if self.masters is not None else None
        return master if master is not None else param

    def set_fp32_param(self, param, value):
        with torch.no_grad():
            master = self.fp32_param(param)
            master.copy_(value)
            if master is not param:
                param.copy_(master)

    def optimizer_state(self, inner, param, key):
        state = inner.state.get(self.fp32_param(param), {})
        return state.get(key)

    def set_optimizer_state(self, inner, param, key, value):
        state = self.optimizer_state(inner, param, key)
        if state is None:
            raise KeyError(f"optimizer state '{key}' does not exist for this parameter yet")
        with torch.no_grad():
            state.copy_(value)
