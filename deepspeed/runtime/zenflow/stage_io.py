# SPDX-License-Identifier: Apache-2.0
"""Where ZenFlow reads and writes on each ZeRO stage: its pieces, the model's storage, publishing a step.

ZenFlow's step (``zenflow_step.py``) works on the stage's group partitions (gradients, fp32
masters, optimizer state: the same layout on every stage) and needs from the stage only what this
module gives it, one class per layout:

* :class:`PartitionedIO` (ZeRO 1/2): the model's trainable parameters are views of one flat
  16-bit buffer (the *full space*); rank ``r`` owns chunk ``r`` of every bucket, which may cut a
  parameter anywhere. Publishing a step all-gathers every rank's chunks into the flat buffer.
* :class:`UnitIO` (ZeRO 3): every parameter is sharded on its own; the rank's 16-bit shards of a
  group (on the device, or on the host with ``offload_param``) have the partition's layout.
  Publishing a step releases the gathered units (their copies are stale) and gathers the
  persistent one again; the next forward gathers the rest from the updated shards.

Both give: ``weights()`` (every trainable parameter with its shape, the same list on every rank),
``pieces()`` (what this rank holds, :class:`~deepspeed.runtime.zenflow.selection.Piece`),
``targets()`` (per group, the 16-bit tensor the pieces' ``target_offset`` index), ``apply_host()``
(the host step's 16-bit values into this rank's part of the model), ``publish()``, ``full_step()``
(a plain offloaded step of everything, for warm-up rounds) and the rank's 16-bit values for a
checkpoint (``own16`` / ``load_own16``); ``group_of(param)``, the group a parameter is partitioned
over and its size (an expert's expert-data-parallel group, its ``ReductionSpec``), and ``blocks_of(param)``, the
experts of a fused expert weight (AutoEP's ``(E, rows, cols)`` weights; None for any other parameter).
"""

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zenflow.selection import Piece
from deepspeed.runtime.zero.gradients import grad_ops


def partitioned_pieces(layout):
    """ZeRO 1/2: the :class:`Piece` of every parameter rank ``layout.rank`` holds part of (its target offset is in
    the full space, the flat 16-bit parameters)."""
    out = []
    for param in layout.params:
        owned = layout.owned_ranges(param)
        slot = layout.slots[param]
        if owned is None or slot.numel == 0:
            continue
        start, length, part_offset = owned
        out.append(Piece(param, tuple(param.shape), slot.group, start, length, part_offset, slot.offset + start))
    return out


def fused_experts(param, shape):
    """How many experts a fused expert weight of ``shape`` holds (its first dimension; an expert parameter, marked
    ``allreduce=False``, of three or more dimensions), None for any other parameter."""
    if getattr(param, "allreduce", True) or len(shape) < 3:
        return None
    return int(shape[0])


def _host_step_of(stage, parts, coef):
    """One plain step of the inner optimizer on the host masters with ``coef * parts`` (warm-up)."""
    if coef != 1.0:
        grad_ops.scale_(parts, coef)
    for master, part in zip(stage.masters, parts):
        master.grad = part.to(device=master.device, dtype=torch.float32)  # itself when already a host fp32 tensor
    try:
        stage.host_step.step()
    finally:
        for master in stage.masters:
            master.grad = None


class PartitionedIO:
    """ZeRO 1/2 (see the module docstring)."""

    def __init__(self, stage, window_on_device=False):
        self.stage = stage
        self.layout = stage.layout
        self.num_groups = self.layout.num_groups
        self.window_on_device = window_on_device  # the stage keeps its gradient partitions on the device

    def weights(self):
        return [(p, tuple(p.shape)) for p in self.layout.params]

    def pieces(self):
        return partitioned_pieces(self.layout)

    def group_of(self, param):
        bucket = self.layout.buckets[self.layout.slots[param].bucket]
        return self.stage._bucket_group(bucket), bucket.world

    def blocks_of(self, param):
        return fused_experts(param, tuple(param.shape))

    def targets(self):
        return [self.stage.flat_params] * self.num_groups

    def before_write(self):
        """Nothing reads the flat parameters asynchronously between steps."""

    def apply_host(self):
        self.stage.host_step.upload_own(self.layout, self.stage.flat_params)

    def publish(self):
        """Every rank's chunks of the flat parameters into every rank's model (a collective)."""
        if self.layout.world_size == 1:
            return
        layout, flat = self.layout, self.stage.flat_params
        works = []
        for bucket in layout.buckets:
            if bucket.world == 1:  # an expert bucket whose expert-data-parallel group is this rank alone
                continue
            send = layout.bucket_own_chunk_full(flat, bucket).clone()
            works.append(
                dist.all_gather_into_tensor(layout.bucket_full(flat, bucket),
                                            send,
                                            group=self.stage._bucket_group(bucket),
                                            async_op=True))
        for work in works:
            work.wait()

    def full_step(self, parts, coef):
        _host_step_of(self.stage, parts, coef)
        self.stage.host_step.gather_into(self.layout, self.stage.flat_params, self.stage._bucket_group)

    def own16(self):
        layout, flat = self.layout, self.stage.flat_params
        if not layout.buckets:
            return torch.empty(0, dtype=flat.dtype)
        return torch.cat([layout.bucket_own_chunk_full(flat, b).cpu() for b in layout.buckets])

    def load_own16(self, own16):
        layout, flat, at = self.layout, self.stage.flat_params, 0
        for bucket in layout.buckets:
            layout.bucket_own_chunk_full(flat, bucket).copy_(own16.narrow(0, at, bucket.chunk))
            at += bucket.chunk
        self.publish()


class UnitIO:
    """ZeRO 3 (see the module docstring)."""

    window_on_device = False  # the stage's gradient partitions are on the host

    def __init__(self, stage):
        self.stage = stage
        self.layout = stage.layout
        self.num_groups = len(stage.masters)

    def weights(self):
        return [(p, tuple(p.ds_shape)) for p in self.layout.params]

    def pieces(self):
        layout, out = self.layout, []
        for param in layout.params:
            slot = layout.slots[param]
            start = slot.rank * slot.shard  # the rank in the group the parameter is sharded over (experts: theirs)
            length = max(0, min(slot.shard, param.ds_numel - start))
            if length:
                out.append(
                    Piece(param, tuple(param.ds_shape), slot.group, start, length, slot.part_offset, slot.part_offset))
        return out

    def targets(self):
        return self.stage.shards[:self.num_groups]

    def group_of(self, param):
        spec = self.stage._expert_specs.get(param)
        return (self.stage.group, self.stage.world_size) if spec is None else (spec.group, spec.world_size)

    def blocks_of(self, param):
        return fused_experts(param, tuple(param.ds_shape))

    def before_write(self):
        """Host shards (``offload_param``) may still be read by an asynchronous fetch to the device."""
        if self.stage.fetch is not None:
            self.stage.fetch.synchronize()

    def apply_host(self):
        host_step = self.stage.host_step
        if self.stage.fetch is None:
            host_step.upload(self.targets())
            return
        self.before_write()  # the host step's own 16-bit buffers into the host shards
        if not host_step.fresh:
            host_step.refresh()
        host_step.fresh = False
        for shard, values in zip(self.targets(), host_step.targets):
            shard.copy_(values)

    def publish(self):
        """The gathered copies are stale: release them; the persistent unit is gathered again now, the others by
        the next forward."""
        self.stage.coordinator.release_all()
        self.stage._gather_persistent()

    def full_step(self, parts, coef):
        _host_step_of(self.stage, parts, coef)
        self.apply_host()
        self.publish()

    def own16(self):
        return torch.cat([t.detach().to("cpu", copy=True) for t in self.targets()]) if self.num_groups else \
            torch.empty(0)

    def load_own16(self, own16):
        self.before_write()
        at = 0
        for shard in self.targets():
            shard.copy_(own16.narrow(0, at, shard.numel()))
            at += shard.numel()
        self.publish()
