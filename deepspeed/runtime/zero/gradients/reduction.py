# SPDX-License-Identifier: Apache-2.0
"""Geometries of the gradient pipeline: where a bucket is staged, how it is reduced, where it is folded.

A geometry gives :class:`~deepspeed.runtime.zero.gradients.grad_pipeline.GradPipeline` its buckets
and five operations; the pipeline decides *when* (readiness, order, bounds), the geometry
*where* and *how*:

``copy_in(bucket, slots, grads, factor)``
    add ``factor * grad`` of each slot into the bucket's staging (or, on a world of one,
    straight into the window gradient);
``add_late(store, slot, grad, factor)``
    the same into a bucket-shaped tensor of ``store`` (the late store of a pass);
``launch(bucket, own, late)``
    start reducing the bucket's own staging (``own``) or ``late`` (None: zeros); returns a
    :class:`Flight`, or None when there is nothing to reduce;
``fold(flight)``
    after the collective completed, add the result into the window gradient;
``partitions()``
    this rank's window gradient tensors (what the step's norm, clipping and optimizer read).

Three geometries, one per kind of stage:

* :class:`ReplicatedGeometry` (stage 0): the window gradient is one flat buffer ``acc``
  replicated on every rank; a bucket is all-reduced in place while ``acc`` holds only
  unreduced values there, and through a ``delta`` buffer added in afterwards;
* :class:`PartitionGeometry` (stages 1, 2): flat buckets padded to a multiple of ``W`` are
  reduce-scattered into the rank's fp32 (accumulation-dtype) partitions; staging is one
  persistent full-size buffer (stage 1) or allocated per bucket and dropped at launch
  (stage 2);
* :class:`UnitGeometry` (stage 3): a parameter unit is staged rank-major (row ``r`` holds
  every parameter's shard ``r``) and reduce-scattered into the rank's shards. Units are reduced
  over the dense group only; the shards of a tensor-parallel model's replicated parameters
  (the same shard on every tensor-parallel rank) are then summed over the tensor-parallel group
  once per window, by :meth:`UnitGeometry.reduce_replicas` (unit boundaries may differ between
  tensor-parallel ranks, whose cut parameters differ in size; the replicated shards do not).

Each bucket carries the :class:`~deepspeed.runtime.zero.gradients.reduction_spec.ReductionSpec` of its
parameters (``reduction``, a :class:`~deepspeed.runtime.zero.gradients.reduction_spec.ReductionPlan`): a
bucket holds parameters of one spec only and is reduced (and, stages 1 and 2, partitioned) over
its spec's group, so that dense and expert parameters go through one pipeline, each over its
own group. The default plan has one spec, the geometry's ``group``.

Partitions may live on the host (optimizer offload, ``part_device`` given): folding then goes
through a :class:`~deepspeed.runtime.zero.offload.host_fold.HostFolder` (device-to-host copies on a side
stream, host adds on a worker thread, lazy zeroing), and :meth:`_Geometry.partitions` settles it
first, so whoever reads the partitions sees the complete window gradient.
"""

import torch
import torch.nn.functional as F

import deepspeed.comm as dist
from deepspeed.runtime.zero.gradients import grad_ops
from deepspeed.runtime.zero.gradients.grad_buffer import FlatLayout
from deepspeed.runtime.zero.gradients.grad_pipeline import GradBucket, GradSlot
from deepspeed.runtime.zero.offload.host_fold import HostFolder
from deepspeed.runtime.zero.gradients.reduction_spec import ReductionPlan
from deepspeed.runtime.zero.offload.transfers import DONE, pinned
from deepspeed.runtime.zero.gradients.transport import DEFAULT_TRANSPORT


class Flight:
    """A bucket's reduction in flight: its work handle, where the result lands, what to clear after."""

    __slots__ = ("bucket", "work", "out", "staged", "own")

    def __init__(self, bucket, work, out, staged, own):
        self.bucket = bucket
        self.work = work
        self.out = out
        self.staged = staged
        self.own = own


def _world(group):
    if dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def _flat_copy_in(target, bucket, slots, grads, factor, fresh):
    """Add ``factor * grads`` into the flat ``target`` laid out like ``bucket`` (overwrite when ``fresh``)."""
    if slots is bucket.slots:  # every slot, in layout order: one contiguous run from offset 0
        grad_ops.flatten_into(grads, target, factor, accumulate=not fresh)
        return
    if fresh:
        target.zero_()
    start = slots[0].offset
    end = start
    for slot in slots:
        if slot.offset != end:
            break
        end += slot.numel
    else:  # one contiguous run (the usual partial copy-in: backward delivers in layout order)
        grad_ops.flatten_into(grads, target.narrow(0, start, end - start), factor, accumulate=True)
        return
    grad_ops.scale_accumulate([target.narrow(0, s.offset, s.numel).view(s.shape) for s in slots], grads, factor)


def _comm_cast(tensor, comm_dtype):
    return tensor if comm_dtype is None or tensor.dtype == comm_dtype else tensor.to(comm_dtype)


class _Geometry:
    """What every geometry shares: the group, the transport, host folding."""

    replicated = False

    def __init__(self,
                 *,
                 device,
                 group,
                 comm_dtype,
                 accum_dtype,
                 transport=None,
                 part_device=None,
                 pin_memory=False,
                 reduction=None):
        self.device = torch.device(device)
        self.group = group
        self.world_size, self.rank = _world(group)
        self.reduction = reduction if reduction is not None else ReductionPlan.single(group)
        self.spec = self.reduction.dense
        self.accum_dtype = accum_dtype
        self.comm_dtype = comm_dtype if comm_dtype is not None and comm_dtype != accum_dtype else None
        self.transport = transport or DEFAULT_TRANSPORT
        self.offloaded = part_device is not None
        self.part_device = torch.device(part_device) if part_device is not None else self.device
        self.pin_memory = pin_memory
        self.identity = (all(spec.world_size * spec.tensor_size == 1 for spec in self.reduction.specs())
                         and not self.offloaded and self.part_device == self.device)
        # Host partitions: every fold goes through the folder (on a CPU-only machine too, so the logic the
        # GPU runs is the one tests exercise).
        self.folder = HostFolder(self.device) if self.offloaded else None

    def set_comm_dtype(self, comm_dtype):
        """Reduce in ``comm_dtype`` from the next launch on (None, or the accumulation dtype: no cast)."""
        self.comm_dtype = comm_dtype if comm_dtype is not None and comm_dtype != self.accum_dtype else None

    def _new_part(self, numel):
        return pinned(torch.zeros(numel, dtype=self.accum_dtype, device=self.part_device), self.pin_memory)

    def _register_piece(self, piece):
        if self.folder is not None:
            self.folder.register(piece)

    def _fold_into(self, part, piece):
        """``part += piece`` where ``part`` may be on the host and ``piece`` on the device.

        Returns the transfer after which ``piece`` was read (see :meth:`HostFolder.fold`).
        """
        if self.folder is not None:
            return self.folder.fold(part, piece)
        part.add_(piece)
        return DONE

    def settle(self):
        """Complete every fold issued so far (host partitions: the copies and host adds in flight)."""
        if self.folder is not None:
            self.folder.settle()

    def _reduce(self, send, chunk, spec):
        """Start reducing the flat ``send`` over ``spec``'s group; return ``(work, out)`` with ``out`` this rank's
        ``chunk`` elements."""
        if spec.tensor_size > 1:  # a tensor-parallel model's replicated parameters: over the data ranks, then
            work, out = self._reduce_data(send, chunk, spec)  # the chunk over the tensor-parallel ranks
            if work is not None:
                work.wait()  # the chunk must be complete before it is summed again
            return self.transport.all_reduce(out, spec.tensor_group), out
        return self._reduce_data(send, chunk, spec)

    def _reduce_data(self, send, chunk, spec):
        if spec.world_size == 1:
            return None, send
        if self._use_reduce_scatter:
            out = torch.empty(chunk, dtype=send.dtype, device=send.device)
            return self.transport.reduce_scatter(out, send, spec.group), out
        work = self.transport.all_reduce(send, spec.group)
        return work, send.narrow(0, spec.rank * chunk, chunk)

    def state_tensors(self):
        """``(window gradient, reduction buffers)`` this geometry holds on the device now (the state table's
        ``lp_grads`` and ``contiguous_grad_buffer``; host partitions are not listed)."""
        grads = [] if self.offloaded else list(self.partitions())
        return grads, [b.staging for b in getattr(self, "buckets", ()) if getattr(b, "staging", None) is not None]

    def reduce_replicas(self):
        """Sum over the tensor-parallel group the gradients this geometry keeps partial for parameters replicated
        over it (UnitGeometry's shards); the other geometries reduce those with the rest of their bucket."""

    def zero_window(self):
        if self.folder is not None:
            self.folder.new_window()  # lazy: each piece's next fold overwrites it
            return
        for part in self.partitions():
            part.zero_()

    def release(self):
        if self.folder is not None:
            self.folder.close()


class ReplicatedGeometry(_Geometry):
    """Stage 0: the window gradient ``acc`` is replicated; buckets are all-reduced (module docstring)."""

    replicated = True

    def __init__(self, params, *, bucket_numel, **common):
        super().__init__(**common)
        self.layout = layout = FlatLayout(params, bucket_numel, key=self.reduction.spec_of)
        self.acc = torch.zeros(layout.numel, dtype=self.accum_dtype, device=self.device)
        self.buckets = []
        self._regions = []
        for spec in layout.buckets:
            bucket = GradBucket(spec.index, spec=self.reduction.spec_of(spec.params[0]))
            for param in spec.params:
                slot = layout.slots[param]
                bucket.slots.append(GradSlot(param, bucket, slot.offset - spec.start, slot.numel, slot.shape))
            self.buckets.append(bucket)
            self._regions.append(self.acc.narrow(0, spec.start, spec.numel))
        self._views = {p: layout.view(self.acc, p) for p in layout.params}
        self._delta = None
        self._reduced = [False] * len(self.buckets)

    def grad_view(self, param):
        """The window gradient of ``param`` (reduced once the window is finished), shaped like it."""
        return self._views[param]

    def regions_by_spec(self):
        """``[(spec, [bucket regions of acc])]``: which part of the window gradient is replicated over which group."""
        out = {}
        for bucket, region in zip(self.buckets, self._regions):
            out.setdefault(id(bucket.spec), (bucket.spec, []))[1].append(region)
        return list(out.values())

    def partitions(self):
        return [self.acc]

    def state_tensors(self):
        return [self.acc], [self._delta] if self._delta is not None else []

    def _delta_region(self, index):
        if self._delta is None:
            self._delta = torch.zeros_like(self.acc)
        spec = self.layout.buckets[index]
        return self._delta.narrow(0, spec.start, spec.numel)

    def _staging(self, index):
        return self._regions[index] if self.identity or not self._reduced[index] else self._delta_region(index)

    def copy_in(self, bucket, slots, grads, factor):
        _flat_copy_in(self._staging(bucket.index), bucket, slots, grads, factor, fresh=False)

    def add_late(self, store, slot, grad, factor):
        index = slot.bucket.index
        buf = store.get(index)
        if buf is None:
            buf = store[index] = torch.zeros_like(self._regions[index])
        buf.narrow(0, slot.offset, slot.numel).view(slot.shape).add_(grad, alpha=factor)

    def launch(self, bucket, own, late):
        if self.identity:
            return None
        index = bucket.index
        if own:
            staged = self._staging(index)
        else:
            staged = late if late is not None else torch.zeros_like(self._regions[index])
        send = _comm_cast(staged, self.comm_dtype)
        group_spec = bucket.spec
        group = group_spec.union_group if group_spec.tensor_size > 1 else group_spec.group
        work = self.transport.all_reduce(send, group) if group_spec.world_size * group_spec.tensor_size > 1 else None
        return Flight(bucket, work, send, staged, own)

    def fold(self, flight):
        staged = flight.staged
        if flight.out is not staged:
            staged.copy_(flight.out)
        index = flight.bucket.index
        region = self._regions[index]
        if staged is region:  # reduced in place: acc holds the reduced value of this bucket now
            self._reduced[index] = True
            return
        region.add_(staged)
        if flight.own:
            staged.zero_()

    def zero_window(self):
        self.acc.zero_()
        if self._delta is not None:
            self._delta.zero_()
        self._reduced = [False] * len(self.buckets)

    def release(self):
        self.acc = None
        self._delta = None
        self._views = {}
        self._regions = []


class PartitionGeometry(_Geometry):
    """Stages 1 and 2: flat buckets reduce-scattered into the rank's partitions (module docstring)."""

    def __init__(self, layout, *, persistent_staging, use_reduce_scatter, **common):
        super().__init__(**common)
        self.layout = layout
        self._use_reduce_scatter = use_reduce_scatter
        self.grad_parts = [self._new_part(numel) for numel in layout.group_part_numel]
        self.buckets = []
        self._dest = []
        for spec in layout.buckets:
            bucket = GradBucket(spec.index, spec=spec.spec)
            for param in spec.params:
                if param.requires_grad:
                    slot = layout.slots[param]
                    bucket.slots.append(GradSlot(param, bucket, slot.offset - spec.start, slot.numel, slot.shape))
            self.buckets.append(bucket)
            self._dest.append(layout.bucket_part(self.grad_parts[spec.group], spec))
            if bucket.slots:
                self._register_piece(self._dest[-1])
        # Stage 1 accumulates a whole window into one staging buffer of the model's size; it exists only while
        # some bucket holds contributions not yet reduced (allocated by the window's first contribution, dropped
        # when the boundary has folded every bucket), so between steps the memory is free for others (generation)
        self._persistent_staging = persistent_staging and not self.identity
        self._persistent = None
        self._unreduced = set()  # buckets with contributions in the persistent staging

    def partitions(self):
        self.settle()
        return self.grad_parts

    def use_partitions(self, parts):
        """From now on fold into ``parts`` (host tensors shaped like the partitions) instead: the caller keeps
        reading the previous ones (ZenFlow's host worker does, while the next window fills these)."""
        self.settle()
        self.grad_parts = list(parts)
        self._dest = [self.layout.bucket_part(self.grad_parts[spec.group], spec) for spec in self.layout.buckets]
        if self.folder is not None:
            self.folder.clear_pieces()
            for bucket, dest in zip(self.buckets, self._dest):
                if bucket.slots:
                    self.folder.register(dest)

    def state_tensors(self):
        grads, buffers = super().state_tensors()
        return grads, buffers + ([self._persistent] if self._persistent is not None else [])

    def _persistent_region(self, index):
        spec = self.layout.buckets[index]
        return self._persistent.narrow(0, spec.start, spec.padded)

    def _staging_for(self, index):
        """The persistent staging of bucket ``index``, allocated (zeros) by the window's first contribution."""
        if self._persistent is None:
            self._persistent = torch.zeros(self.layout.numel, dtype=self.accum_dtype, device=self.device)
        self._unreduced.add(index)
        return self._persistent_region(index)

    def copy_in(self, bucket, slots, grads, factor):
        if self.identity:  # a world of one: the partition is the whole bucket
            _flat_copy_in(self._dest[bucket.index], bucket, slots, grads, factor, fresh=False)
        elif self._persistent_staging:
            _flat_copy_in(self._staging_for(bucket.index), bucket, slots, grads, factor, fresh=False)
        else:
            fresh = bucket.staging is None
            if fresh:
                padded = self.layout.buckets[bucket.index].padded
                bucket.staging = torch.empty(padded, dtype=self.accum_dtype, device=self.device)
            _flat_copy_in(bucket.staging, bucket, slots, grads, factor, fresh)

    def add_late(self, store, slot, grad, factor):
        index = slot.bucket.index
        buf = store.get(index)
        if buf is None:
            buf = store[index] = torch.zeros(self.layout.buckets[index].padded,
                                             dtype=self.accum_dtype,
                                             device=self.device)
        buf.narrow(0, slot.offset, slot.numel).view(slot.shape).add_(grad, alpha=factor)

    def launch(self, bucket, own, late):
        if self.identity or not bucket.slots:
            return None
        spec = self.layout.buckets[bucket.index]
        reuse = None
        if not own:
            staged = late
        elif bucket.index in self._unreduced:
            staged = reuse = self._persistent_region(bucket.index)
        else:
            staged, bucket.staging = bucket.staging, None
        if staged is None:
            staged = torch.zeros(spec.padded, dtype=self.accum_dtype, device=self.device)
        # A per-bucket staging is dropped here: the collective keeps it alive until it is done,
        # so the memory of a whole gradient never accumulates. The persistent one is zeroed after.
        work, out = self._reduce(_comm_cast(staged, self.comm_dtype), spec.chunk, bucket.spec)
        return Flight(bucket, work, out, reuse, own)

    def fold(self, flight):
        read = self._fold_into(self._dest[flight.bucket.index], flight.out)
        if flight.staged is not None:
            read.wait_stream()  # the persistent staging is zeroed on the device once its copy has read it
            flight.staged.zero_()
            self._unreduced.discard(flight.bucket.index)
            if not self._unreduced:  # the window is reduced: nothing to keep until the next contribution
                self._persistent = None

    def release(self):
        super().release()
        self.grad_parts = []
        self._dest = []
        self._persistent = None
        self._unreduced = set()


class UnitGeometry(_Geometry):
    """Stage 3: one rank-major reduce-scatter per parameter unit (module docstring).

    ``units`` are the stage's :class:`~deepspeed.runtime.zero.units.parameter_units.ParamUnit`; the
    partition layout gives each parameter's group and offset in its group partition.
    """

    def __init__(self, units, part_layout, *, use_reduce_scatter, **common):
        super().__init__(**common)
        # units are reduced over the dense group, an expert unit over its expert-data-parallel group (its
        # ``spec``; replicated shards: reduce_replicas)
        self.identity = self.spec.world_size == 1 and not self.offloaded and self.part_device == self.device
        self._use_reduce_scatter = use_reduce_scatter
        self.units = units
        self.part_layout = part_layout
        self.grad_parts = [self._new_part(numel) for numel in part_layout.group_part_numel]
        num_groups = len(self.grad_parts)
        self.buckets = []
        for unit in units:
            bucket = GradBucket(unit.index, spec=unit.spec)
            for param, column, shard in zip(unit.params, unit.columns, unit.shards):
                if param.requires_grad and part_layout.slots[param].group < num_groups:
                    bucket.slots.append(GradSlot(param, bucket, column, param.ds_numel, param.ds_shape, shard=shard))
            self.buckets.append(bucket)
        self._set_destinations()

    def _set_destinations(self):
        """Per unit, the pieces of the group partitions its reduced row folds into (and, on a world of one, the
        one contiguous destination of every column, when there is one)."""
        num_groups = len(self.grad_parts)
        self._segments = []  # per unit: (group partition piece, column offset, length)
        self._flat_dest = []  # per unit: world of one, one contiguous destination for every column, or None
        if self.folder is not None:
            self.folder.clear_pieces()
        for unit, bucket in zip(self.units, self.buckets):
            segments = [(self.grad_parts[g].narrow(0, part_offset, length), column, length)
                        for g, part_offset, column, length in self.part_layout.segments[unit.index] if g < num_groups]
            whole = (len(segments) == 1 and len(bucket.slots) == len(unit.params)
                     and all(s.numel == s.shard for s in bucket.slots))
            self._segments.append(segments)
            self._flat_dest.append(segments[0][0] if whole and self.identity else None)
            if bucket.slots:
                for piece, _, _ in segments:
                    self._register_piece(piece)

    def use_partitions(self, parts):
        """From now on fold into ``parts`` (tensors shaped like the partitions) instead: the caller keeps reading the
        previous ones (ZenFlow's host worker does, while the next step fills these)."""
        self.settle()
        self.grad_parts = list(parts)
        self._set_destinations()

    def partitions(self):
        self.settle()
        return self.grad_parts

    def state_tensors(self):
        grads, buffers = super().state_tensors()
        kept = getattr(self, "_replicas_reduced", None)
        return grads, buffers + ([kept] if kept is not None else [])

    def _rows(self, bucket):
        return bucket.staging.view(self.units[bucket.index].world_size, -1)

    def _every_column(self, bucket, slots):
        return slots is bucket.slots and len(slots) == len(self.units[bucket.index].params)

    def copy_in(self, bucket, slots, grads, factor):
        if self.identity:
            flat = self._flat_dest[bucket.index]
            if flat is not None:
                _flat_copy_in(flat, bucket, slots, grads, factor, fresh=False)
            else:
                views, taken = [], []
                for slot, grad in zip(slots, grads):
                    if slot.numel:
                        views.append(self._dest_view(slot))
                        taken.append(grad)
                grad_ops.scale_accumulate(views, taken, factor)
            return
        fresh = bucket.staging is None
        every = self._every_column(bucket, slots)
        if fresh:
            alloc = torch.empty if every else torch.zeros
            unit = self.units[bucket.index]
            bucket.staging = alloc(unit.world_size * unit.chunk, dtype=self.accum_dtype, device=self.device)
        rows = self._rows(bucket)
        if every:
            grad_ops.chunk_into(grads, rows, factor, accumulate=not fresh)
        else:
            for slot, grad in zip(slots, grads):
                self._add_rows(rows, slot, grad, factor)

    def _dest_view(self, slot):
        ps = self.part_layout.slots[slot.param]
        return self.grad_parts[ps.group].narrow(0, ps.part_offset, slot.numel).view(slot.shape)

    def _add_rows(self, rows, slot, grad, factor):
        world = rows.shape[0]
        flat = grad.reshape(-1)
        if flat.numel() != world * slot.shard:
            flat = F.pad(flat, (0, world * slot.shard - flat.numel()))
        rows.narrow(1, slot.offset, slot.shard).add_(flat.view(world, slot.shard), alpha=factor)

    def add_late(self, store, slot, grad, factor):
        index = slot.bucket.index
        buf = store.get(index)
        if buf is None:
            buf = store[index] = torch.zeros(self.units[index].world_size * self.units[index].chunk,
                                             dtype=self.accum_dtype,
                                             device=self.device)
        self._add_rows(buf.view(self.units[index].world_size, -1), slot, grad, factor)

    def launch(self, bucket, own, late):
        if self.identity or not bucket.slots:
            return None
        if own:
            staged, bucket.staging = bucket.staging, None
        else:
            staged = late
        unit = self.units[bucket.index]
        chunk = unit.chunk
        if staged is None:
            staged = torch.zeros(unit.world_size * chunk, dtype=self.accum_dtype, device=self.device)
        work, out = self._reduce(_comm_cast(staged, self.comm_dtype), chunk, bucket.spec)
        return Flight(bucket, work, out, None, own)

    def fold(self, flight):
        out = flight.out
        for piece, column, length in self._segments[flight.bucket.index]:
            self._fold_into(piece, out.narrow(0, column, length))

    # --------------------------------------------------- replicated parameters of a tensor-parallel model
    def set_replicas(self, params):
        """The replicated parameters (``spec_of(p)`` a tensor-parallel spec), in an order every tensor-parallel
        rank shares (the model's parameter order)."""
        self._replicas = []
        for param in params:
            spec = self.reduction.spec_of(param)
            if spec.tensor_size > 1 and param in self.part_layout.slots:
                slot = self.part_layout.slots[param]
                if slot.group < len(self.grad_parts):
                    self._replicas.append((param, slot.group, slot.part_offset, slot.shard, spec))
        self._replicas_reduced = None

    def replica_pieces(self):
        """This rank's shards of the replicated parameters' window gradient (views of the partitions)."""
        return [
            self.grad_parts[g].narrow(0, offset, shard) for _, g, offset, shard, _ in getattr(self, "_replicas", [])
        ]

    def reduce_replicas(self):
        """Sum the replicated parameters' shards over the tensor-parallel group, once per window (module docstring).

        Idempotent and linear: what was reduced before is kept aside, and only what the window added since is
        reduced (a second call, or a backward after ``finish_window`` in the same window, stays exact).
        """
        replicas = getattr(self, "_replicas", [])
        if not replicas:
            return
        self.settle()
        pieces = self.replica_pieces()
        flat = torch.cat([p.reshape(-1) for p in pieces])
        before = self._replicas_reduced
        delta = flat if before is None else flat - before
        spec = replicas[0][4]
        work = self.transport.all_reduce(delta, spec.tensor_group)
        if work is not None:
            work.wait()
        offset = 0
        for (_, _, _, shard, spec), piece in zip(replicas, pieces):
            part = delta.narrow(0, offset, shard)
            if spec.replicas != 1:
                part.mul_(1.0 / spec.replicas)
            if before is None:
                piece.copy_(part)
            else:
                piece.copy_(before.narrow(0, offset, shard) + part)
            offset += shard
        self._replicas_reduced = torch.cat([p.reshape(-1) for p in pieces])

    def zero_window(self):
        super().zero_window()
        self._replicas_reduced = None

    def release(self):
        super().release()
        self.grad_parts = []
        self._segments = []
        self._flat_dest = []
        self._replicas = []
