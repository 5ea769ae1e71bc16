# SPDX-License-Identifier: Apache-2.0
"""ZeRO stages 1 and 2: partitioned fp32 masters and optimizer state; stage 2 partitions gradients too.

Both stages use the flat, rank-divisible layout of :mod:`partition_layout`: rank ``r``
owns chunk ``r`` of every bucket, and its fp32 gradient partition, fp32 master
partition and optimizer state are the concatenation of its chunks (per param group).

``PartitionedGradients`` is the gradient sink the backward session talks to. A
contribution is added, with its factor, into a full-size *staging* bucket; a
reduction *pass* reduce-scatters each bucket, in bucket order, into the rank's
fp32 gradient partition (``grad_parts``), then clears the staging:

* stage 1 keeps one persistent full-size staging buffer and runs a pass only in the
  backward of the boundary micro-step (or at ``step()``);
* stage 2 allocates staging per bucket on demand and runs a pass in *every* backward,
  freeing each bucket once it is reduced: between backward calls no full gradient
  is kept.

The same rules as stage 0 keep every case exact (see ``stage0.py``): buckets launch
in fixed order once complete, the epilogue launches the rest (zero-filled where a
rank has nothing), contributions to an already-launched bucket go to a ``late``
buffer reduced after the ranks agree one of them holds some, and ``finish_window``
reduces whatever a deferred backward (``no_sync``, ``coalesce_grad_reduction``,
unmanaged accumulation) left staged.

``PartitionedStage`` is the step side: the model's trainable parameters become views
of one flat 16-bit (or fp32) buffer; the inner optimizer steps the fp32 master
partitions (on the CPU with ``offload_optimizer``), and the updated partitions are
all-gathered back into the model, bucket by bucket.
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.partition_layout import PartitionedLayout
from deepspeed.runtime.zero.partitioned_step import (PartitionedStepMixin, host_buffer, master_partition,
                                                     point_optimizer_at)

# Reductions in flight at once during a pass beside the one just launched; older ones are
# completed (folded into the partition, their output freed) as new ones launch, so memory
# stays bounded. Completing one only makes the compute stream wait for it on the device.
MAX_IN_FLIGHT = 1


class _Pass:

    def __init__(self, serial, num_buckets):
        self.serial = serial
        self.next_launch = 0
        self.works = []


class PartitionedGradients:
    """Gradient sink of a stage 1/2 engine (see the module docstring)."""

    def __init__(self, layout, *, stage, accum_dtype, device, part_device, pin_memory, group, average, comm_dtype,
                 gas_fn, reduce_now_fn, requires_loss_scale, overlap_comm, use_reduce_scatter):
        self.layout = layout
        self.params = layout.params
        self.stage = stage
        self.group = group
        self.world_size = layout.world_size
        self.device = device
        self._dtype = accum_dtype
        self._dp_factor = 1.0 / self.world_size if average else 1.0
        self._comm_dtype = comm_dtype if comm_dtype is not None and comm_dtype != accum_dtype else None
        self._gas_fn = gas_fn
        self._reduce_in_backward = reduce_now_fn  # stage 1: at the boundary; stage 2: unless deferred
        self.requires_loss_scale = requires_loss_scale
        self._overlap = overlap_comm
        self._use_reduce_scatter = use_reduce_scatter
        self.grad_parts = []
        for numel in layout.group_part_numel:
            self.grad_parts.append(host_buffer(torch.zeros(numel, dtype=accum_dtype, device=part_device), pin_memory))
        self.acc = torch.zeros(layout.numel, dtype=accum_dtype, device=device) if stage == 1 else None
        self._staging = {}  # stage 2: bucket index -> full-size bucket tensor
        self._late = {}
        self._bucket_sizes = [sum(1 for p in b.params if p.requires_grad) for b in layout.buckets]
        self._ready = [0] * len(layout.buckets)
        self._pass = None
        self._serial = 0
        self._pending = False  # staged contributions no pass has taken yet
        self._late_dirty = False

    # ------------------------------------------------------- session interface
    @property
    def gradient_accumulation_steps(self):
        return self._gas_fn()

    def begin_backward(self, session):
        self._serial += 1
        self._ready = [0] * len(self.layout.buckets)
        if self._reduce_in_backward():
            self._pass = _Pass(self._serial, len(self.layout.buckets))
            self._pending = False  # the pass takes everything staged so far

    def on_grad(self, param, grad, factor):
        slot = self.layout.slots[param]
        factor = factor * self._dp_factor
        run = self._pass
        bucket = slot.bucket
        if run is not None and bucket < run.next_launch:
            self._accumulate(self._late, slot, grad, factor)
            self._late_dirty = True
            return
        self._accumulate(None, slot, grad, factor)
        if run is None:
            self._pending = True
        if slot.fired_serial != self._serial:
            slot.fired_serial = self._serial
            self._ready[bucket] += 1
            if self._ready[bucket] == self._bucket_sizes[bucket]:
                self._bucket_complete(bucket, run)

    def _bucket_complete(self, bucket, run):
        """Every parameter of ``bucket`` delivered its gradient in this backward."""
        if run is not None and bucket == run.next_launch:
            self._launch_ready(run)

    def end_backward(self, session):
        run = self._pass
        if run is None:
            return
        self._pass = None
        self._launch_all(run, self._take_staged)
        self._wait(run)
        if session.nested or self._late_dirty:
            self._reduce_late()

    def abort_backward(self, session):
        run, self._pass = self._pass, None
        if run is not None:
            for work, *_ in run.works:
                if work is not None:
                    work.wait()
            run.works = []

    # ------------------------------------------------------------ staging
    def _bucket_buffer(self, store, bucket_index):
        buf = store.get(bucket_index)
        if buf is None:
            bucket = self.layout.buckets[bucket_index]
            buf = store[bucket_index] = torch.zeros(bucket.padded, dtype=self._dtype, device=self.device)
        return buf

    def _accumulate(self, store, slot, grad, factor):
        """Add ``factor * grad`` into the staging (``store`` None) or late bucket of the parameter at ``slot``."""
        if store is None and self.acc is not None:
            target = self.acc.narrow(0, slot.offset, slot.numel)
        else:
            buf = self._bucket_buffer(self._staging if store is None else store, slot.bucket)
            target = buf.narrow(0, slot.offset - self.layout.buckets[slot.bucket].start, slot.numel)
        target.view(slot.shape).add_(grad, alpha=factor)

    def _fold(self, bucket, out):
        """Add a reduced chunk of ``bucket`` into this rank's gradient partition."""
        part = self.layout.bucket_part(self.grad_parts[bucket.group], bucket)
        # A device-to-host copy must be blocking: the host add reads it at once.
        part.add_(out.to(part.device) if out.device != part.device else out)

    def _take_staged(self, bucket):
        if self.acc is not None:
            return self.layout.bucket_full(self.acc, bucket), True
        return self._staging.pop(bucket.index, None), False

    def _take_late(self, bucket):
        return self._late.pop(bucket.index, None), False

    # ------------------------------------------------------------ reduction
    def _launch_ready(self, run):
        buckets = self.layout.buckets
        while run.next_launch < len(buckets) and self._ready[run.next_launch] == self._bucket_sizes[run.next_launch]:
            self._launch(run, buckets[run.next_launch], *self._take_staged(buckets[run.next_launch]))
            run.next_launch += 1

    def _launch_all(self, run, take):
        buckets = self.layout.buckets
        while run.next_launch < len(buckets):
            self._launch(run, buckets[run.next_launch], *take(buckets[run.next_launch]))
            run.next_launch += 1

    def _launch(self, run, bucket, staged, reusable):
        """Reduce-scatter one full bucket; ``reusable``: the staging is kept (zeroed) after the reduction."""
        if self._bucket_sizes[bucket.index] == 0:  # nothing trainable (frozen): the same on every rank
            return
        if staged is None:
            staged = torch.zeros(bucket.padded, dtype=self._dtype, device=self.device)
        send = staged.to(self._comm_dtype) if self._comm_dtype is not None else staged
        if self.world_size == 1:
            out, work = send, None
        elif self._use_reduce_scatter:
            out = torch.empty(bucket.chunk, dtype=send.dtype, device=send.device)
            work = dist.reduce_scatter_tensor(out, send, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(send, group=self.group, async_op=True)
            out = send.narrow(0, self.layout.rank * bucket.chunk, bucket.chunk)
        # Only a reusable staging (stage 1's persistent buffer) is kept, to be zeroed after the
        # reduction; a per-bucket staging is dropped now: the process group keeps it alive until
        # the collective is done, and the memory of a full gradient never accumulates.
        run.works.append((work, bucket, out, staged if reusable else None))
        limit = MAX_IN_FLIGHT if self._overlap else 0
        while len(run.works) > limit:
            self._complete(run.works.pop(0))

    def _complete(self, entry):
        work, bucket, out, reusable_staging = entry
        if work is not None:
            work.wait()
        self._fold(bucket, out)
        if reusable_staging is not None:
            reusable_staging.zero_()

    def _wait(self, run):
        for entry in run.works:
            self._complete(entry)
        run.works = []

    def _full_pass(self, take):
        run = _Pass(-1, len(self.layout.buckets))
        self._launch_all(run, take)
        self._wait(run)

    def _reduce_late(self):
        flag = torch.tensor([1.0 if self._late_dirty else 0.0], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() > 0:
            self._full_pass(self._take_late)
        self._late = {}
        self._late_dirty = False

    # ------------------------------------------------------ engine interface
    def finish_window(self):
        """Reduce whatever is still staged; afterwards ``grad_parts`` hold the window's reduced gradient."""
        if self._pass is not None:
            run, self._pass = self._pass, None
            self._launch_all(run, self._take_staged)
            self._wait(run)
        if self._pending:
            self._full_pass(self._take_staged)
            self._pending = False
        if self._late_dirty:
            self._reduce_late()

    def zero_window(self):
        self.abort_backward(None)
        for part in self.grad_parts:
            part.zero_()
        if self.acc is not None:
            self.acc.zero_()
        self._staging = {}
        self._late = {}
        self._pending = False
        self._late_dirty = False

    def unpublish_grads(self):
        pass

    def release(self):
        self.grad_parts = []
        self.acc = None
        self._staging = {}
        self._late = {}


class PartitionedStage(PartitionedStepMixin):
    """Step side of stages 1 and 2 (see the module docstring); same interface as ``Stage0``."""

    def __init__(self,
                 module,
                 inner_optimizer,
                 *,
                 stage,
                 accum_dtype,
                 device,
                 bucket_numel,
                 group,
                 average,
                 comm_dtype,
                 gas_fn,
                 reduce_now_fn,
                 requires_loss_scale,
                 overlap_comm,
                 use_reduce_scatter,
                 offload_device=None,
                 pin_memory=False):
        self.stage = stage
        self.group = group
        self.device = device
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        seen = set()
        groups = []
        for param_group in inner_optimizer.param_groups:
            trainable = []
            for p in param_group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    trainable.append(p)
            groups.append(trainable)
        self.layout = layout = PartitionedLayout(groups, list(module.parameters()), bucket_numel, world, rank)
        dtypes = {p.dtype for p in layout.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO stage {stage} needs one dtype for all trainable parameters, found {dtypes}")
        model_dtype = dtypes.pop() if dtypes else torch.float32
        self.part_device = torch.device(offload_device) if offload_device else device

        # The model's trainable parameters become views of one flat buffer, so that the
        # all-gather after the step writes straight into them.
        self.flat_params = torch.zeros(layout.numel, dtype=model_dtype, device=device)
        with torch.no_grad():
            for p in layout.params:
                view = layout.full_view(self.flat_params, p)
                view.copy_(p.data)
                p.data = view

        self.grads = PartitionedGradients(layout,
                                          stage=stage,
                                          accum_dtype=accum_dtype,
                                          device=device,
                                          part_device=self.part_device,
                                          pin_memory=pin_memory,
                                          group=group,
                                          average=average,
                                          comm_dtype=comm_dtype,
                                          gas_fn=gas_fn,
                                          reduce_now_fn=reduce_now_fn,
                                          requires_loss_scale=requires_loss_scale,
                                          overlap_comm=overlap_comm,
                                          use_reduce_scatter=use_reduce_scatter)
        self.masters = []
        for g, numel in enumerate(layout.group_part_numel):
            master = torch.zeros(numel, dtype=torch.float32, device=self.part_device)
            for bucket in layout.buckets:
                if bucket.group == g:
                    layout.bucket_part(master, bucket).copy_(layout.bucket_own_chunk_full(self.flat_params, bucket))
            self.masters.append(master_partition(master, self.grads.grad_parts[g], pin_memory))
        point_optimizer_at(inner_optimizer, self.masters, [bool(g) for g in groups])

    # ------------------------------------------------------------------ step
    def optimizer_step(self, inner):
        inner.step()
        self._all_gather_params()

    @torch.no_grad()
    def _all_gather_params(self):
        layout = self.layout
        works = []
        for bucket in layout.buckets:
            send = layout.bucket_part(self.masters[bucket.group].data, bucket)
            send = send.to(device=self.device, dtype=self.flat_params.dtype, non_blocking=True)
            out = layout.bucket_full(self.flat_params, bucket)
            if layout.world_size == 1:
                out.copy_(send)
            else:
                works.append(dist.all_gather_into_tensor(out, send, group=self.group, async_op=True))
        for work in works:
            work.wait()

    # ------------------------------------------------------------- accessors
    def _gather(self, part_buffer, param):
        """Collective: the full value of ``param`` from every rank's partition buffer (fp32)."""
        layout = self.layout
        slot = layout.slots[param]
        bucket = layout.buckets[slot.bucket]
        chunk = layout.bucket_part(part_buffer, bucket).to(self.device, torch.float32)
        if layout.world_size == 1:
            full = chunk
        else:
            full = torch.empty(bucket.padded, dtype=torch.float32, device=self.device)
            dist.all_gather_into_tensor(full, chunk.contiguous(), group=self.group)
        return full.narrow(0, slot.offset - bucket.start, slot.numel).view(slot.shape)

    def _local(self, part_buffer, param):
        owned = self.layout.owned_ranges(param)
        if owned is None:
            return torch.empty(0, dtype=part_buffer.dtype, device=part_buffer.device)
        _, length, offset = owned
        return part_buffer.narrow(0, offset, length)

    def _write(self, part_buffer, param, value):
        owned = self.layout.owned_ranges(param)
        if owned is not None:
            start, length, offset = owned
            src = value.reshape(-1).narrow(0, start, length)
            part_buffer.narrow(0, offset, length).copy_(src)

    def full_grad(self, param):
        return self._gather(self.grads.grad_parts[self.layout.slots[param].group], param)

    def set_full_grad(self, param, value):
        self._write(self.grads.grad_parts[self.layout.slots[param].group], param, value)

    def local_grad(self, param):
        return self._local(self.grads.grad_parts[self.layout.slots[param].group], param)

    def fp32_param(self, param):
        return self._gather(self.masters[self.layout.slots[param].group].data, param)

    def local_fp32_param(self, param):
        return self._local(self.masters[self.layout.slots[param].group].data, param)

    def set_fp32_param(self, param, value):
        with torch.no_grad():
            self._write(self.masters[self.layout.slots[param].group].data, param, value)
            param.copy_(value)

    def optimizer_state(self, inner, param, key):
        master = self.masters[self.layout.slots[param].group]
        value = inner.state.get(master, {}).get(key)
        if isinstance(value, torch.Tensor) and value.numel() == master.numel():
            return self._gather(value, param)
        return value

    def set_optimizer_state(self, inner, param, key, value):
        master = self.masters[self.layout.slots[param].group]
        state = inner.state.get(master, {}).get(key)
        if not isinstance(state, torch.Tensor) or state.numel() != master.numel():
            raise KeyError(f"optimizer state '{key}' does not exist for this parameter yet")
        with torch.no_grad():
            self._write(state, param, value.to(state.dtype))
